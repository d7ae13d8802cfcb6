"""A PEFT adapter for GPT-2, trained in PyTorch, continued in JAX, and back to PEFT.

GPT-2's projections are Hugging Face `Conv1D` layers (weight `(in, out)`), and its
queries, keys and values are one fused layer, `c_attn` (`(E, 3E)`). PEFT adapts
`c_attn` whole: `lora_A (r, E)`, `lora_B (3E, r)`.

1. A tiny GPT-2 (`GPT2Config`, random weights, offline) gets a PEFT adapter on
   `c_attn` and both `c_proj`s, trained 5 Adam steps in PyTorch.
2. A GPT-2 written in NNX with `query`, `key` and `value` layers takes the weights
   (`bridge.from_torch(..., split=SPLIT)`) and the adapter (`bridge.load_peft(...,
   split=SPLIT)`: each part gets `lora_A` and its rows of `lora_B`): PEFT's logits.
3. 10 more Adam steps in JAX on the adapters alone, then `bridge.save_peft(...,
   split=SPLIT)` writes one `c_attn` adapter again (rank 3r: the parts' adapters
   were trained apart); `PeftModel.from_pretrained` gives the JAX model's logits.

Needs `torch`, `transformers` and `peft`; without them the example says so and stops.

    python examples/lora_gpt2.py
"""

import copy
import importlib.util
import json
import math
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import bridge


E, HEADS, LAYERS, VOCAB, POSITIONS = 32, 2, 2, 50, 16
SPLIT = {r"h\.\d+\.attn\.c_attn": ("query", "key", "value")}
PREFIX = "transformer."  # GPT2LMHeadModel's base_model_prefix
HAVE_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft"))


class Attention(nnx.Module):
    def __init__(self, rngs):
        self.query = nnx.Linear(E, E, rngs=rngs)
        self.key = nnx.Linear(E, E, rngs=rngs)
        self.value = nnx.Linear(E, E, rngs=rngs)
        self.c_proj = nnx.Linear(E, E, rngs=rngs)

    def __call__(self, x):
        b, n, _ = x.shape
        q, k, v = (
            p(x).reshape(b, n, HEADS, -1) for p in (self.query, self.key, self.value)
        )
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(E // HEADS)
        mask = jnp.tril(jnp.ones((n, n), bool))
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        return self.c_proj(ctx.reshape(b, n, E))


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.c_fc = nnx.Linear(E, 4 * E, rngs=rngs)
        self.c_proj = nnx.Linear(4 * E, E, rngs=rngs)

    def __call__(self, x):
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.ln_1 = nnx.LayerNorm(E, epsilon=1e-5, rngs=rngs)
        self.attn = Attention(rngs)
        self.ln_2 = nnx.LayerNorm(E, epsilon=1e-5, rngs=rngs)
        self.mlp = MLP(rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nnx.Module):
    """GPT-2 with Hugging Face's names, `c_attn` as three layers, the LM head tied."""

    def __init__(self, rngs):
        self.wte = nnx.Embed(VOCAB, E, rngs=rngs)
        self.wpe = nnx.Embed(POSITIONS, E, rngs=rngs)
        self.h = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.ln_f = nnx.LayerNorm(E, epsilon=1e-5, rngs=rngs)

    def __call__(self, ids):
        x = self.wte(ids) + self.wpe(jnp.arange(ids.shape[1])[None])
        for block in self.h:
            x = block(x)
        return self.wte.attend(self.ln_f(x))


def main() -> None:
    if not HAVE_TORCH:
        print("lora_gpt2.py needs torch, transformers and peft: skipped")
        return
    import peft
    import torch
    import transformers

    warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
    work = Path(tempfile.mkdtemp())
    ids = np.array([[1, 5, 9, 3, 7, 2], [4, 4, 8, 0, 11, 6]])
    targets = np.roll(ids, -1, axis=1)

    # 1. a PEFT adapter on GPT-2's Conv1D layers, trained in PyTorch
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=E,
        n_layer=LAYERS,
        n_head=HEADS,
        vocab_size=VOCAB,
        n_positions=POSITIONS,
        bos_token_id=0,
        eos_token_id=0,
    )
    hf = transformers.GPT2LMHeadModel(config).eval()
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True
    )
    model = peft.get_peft_model(copy.deepcopy(hf), lora)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 1e-2)
    for _ in range(5):
        opt.zero_grad()
        model(input_ids=torch.tensor(ids), labels=torch.tensor(ids)).loss.backward()
        opt.step()
    model.eval().save_pretrained(work / "from_torch")

    def torch_logits(m):
        with torch.no_grad():
            return m(input_ids=torch.tensor(ids)).logits.numpy()

    # 2. into NNX: the weights with c_attn split, then the adapter split the same way
    base = bridge.port(
        bridge.from_torch(hf, prefix=PREFIX, split=SPLIT), GPT2(nnx.Rngs(0))
    )
    tuned = bridge.load_peft(work / "from_torch", base, prefix=PREFIX, split=SPLIT)
    gap = np.abs(np.asarray(tuned(jnp.asarray(ids))) - torch_logits(model)).max()
    print(f"PEFT adapter in NNX, split c_attn: logits within {gap:.1e} of PEFT's")
    assert gap < 1e-5

    # 3. 10 more steps in JAX on the adapters alone, back to PEFT as one c_attn
    def loss_fn(m, x, y):
        logits = m(x)[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y[:, :-1]).mean()

    tree = bridge.to_neutral(tuned)
    step = bridge.make_step(loss_fn, optax.adam(1e-2), bridge.trainable(tree, "lora"))
    opt_state = step.init(tree)
    for _ in range(10):
        tree, opt_state, loss = step(
            tree, opt_state, jnp.asarray(ids), jnp.asarray(targets)
        )
    print(f"loss after 10 JAX steps: {float(loss):.4f}")
    bridge.save_peft(work / "from_jax", tree, prefix=PREFIX, split=SPLIT)
    written = json.loads((work / "from_jax/adapter_config.json").read_text())
    print(
        "written:", written["target_modules"], "rank_pattern", written["rank_pattern"]
    )
    back = peft.PeftModel.from_pretrained(copy.deepcopy(hf), work / "from_jax").eval()
    gap = np.abs(
        np.asarray(bridge.to_native(tree)(jnp.asarray(ids))) - torch_logits(back)
    ).max()
    print(f"loaded by PeftModel.from_pretrained: logits within {gap:.1e} of NNX's")
    assert gap < 1e-5


if __name__ == "__main__":
    main()
