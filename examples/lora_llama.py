"""LoRA on a Hugging Face Llama, in JAX, and back to PyTorch with PEFT.

1. A Hugging Face Llama folder (a tiny `LlamaConfig`, random weights, made offline
   with `save_pretrained`) is loaded into a Llama written in NNX with Hugging Face's
   names (`model.layers.0.self_attn.q_proj`, ...).
2. `bridge.lora` puts rank-4 adapters on every `q_proj` and `v_proj`; 20 Adam steps
   train the adapters alone (`bridge.trainable(tree, "lora")`).
3. `bridge.save_peft` writes `adapter_model.safetensors` + `adapter_config.json`;
   `transformers` + `peft` load them onto the PyTorch model: the same logits.
4. The same adapter goes into a Llama written in Equinox: the same logits again.
5. `bridge.merge_lora` folds the adapters into the weights;
   `bridge.save_state_dict` writes a `model.safetensors` that `from_pretrained` loads.

Steps 1, 3 and 5 need `torch`, `transformers` and `peft`; without them the example
makes the base model in JAX and runs steps 2 and 4 only.

    python examples/lora_llama.py
"""

import importlib.util
import shutil
import tempfile
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import bridge


VOCAB, DIM, HEADS, KV_HEADS, HIDDEN, LAYERS = 32, 16, 4, 2, 24, 2
HD, EPS, THETA = DIM // HEADS, 1e-6, 10000.0
HAVE_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft"))


# --- the Llama computation, shared by the NNX and Equinox models --------------------
def rotary(length):
    inv = 1.0 / THETA ** (jnp.arange(0, HD, 2, dtype=jnp.float32) / HD)
    emb = jnp.arange(length, dtype=jnp.float32)[:, None] * inv[None, :]
    emb = jnp.concatenate([emb, emb], axis=-1)
    return jnp.cos(emb)[None, :, None, :], jnp.sin(emb)[None, :, None, :]


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def attention(q, k, v):
    """Causal grouped-query attention; `q (B, T, H, HD)`, `k, v (B, T, KV, HD)`."""
    k, v = (jnp.repeat(z, HEADS // KV_HEADS, axis=-2) for z in (k, v))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(HD)
    mask = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))[None, None]
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), v)


def block(layer, x, cos, sin, run):
    """One decoder layer; `run(module, x)` applies a layer of either framework."""
    b, t, _ = x.shape
    a, m = layer.self_attn, layer.mlp
    h = run(layer.input_layernorm, x)
    q = rotate(run(a.q_proj, h).reshape(b, t, HEADS, HD), cos, sin)
    k = rotate(run(a.k_proj, h).reshape(b, t, KV_HEADS, HD), cos, sin)
    v = run(a.v_proj, h).reshape(b, t, KV_HEADS, HD)
    x = x + run(a.o_proj, attention(q, k, v).reshape(b, t, DIM))
    h = run(layer.post_attention_layernorm, x)
    return x + run(m.down_proj, jax.nn.silu(run(m.gate_proj, h)) * run(m.up_proj, h))


# --- in NNX -------------------------------------------------------------------------
def nnx_linear(i, o, rngs):
    return nnx.Linear(i, o, use_bias=False, rngs=rngs)


class NNXAttention(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = nnx_linear(DIM, HEADS * HD, rngs)
        self.k_proj = nnx_linear(DIM, KV_HEADS * HD, rngs)
        self.v_proj = nnx_linear(DIM, KV_HEADS * HD, rngs)
        self.o_proj = nnx_linear(HEADS * HD, DIM, rngs)


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.gate_proj = nnx_linear(DIM, HIDDEN, rngs)
        self.up_proj = nnx_linear(DIM, HIDDEN, rngs)
        self.down_proj = nnx_linear(HIDDEN, DIM, rngs)


class NNXLayer(nnx.Module):
    def __init__(self, rngs):
        self.self_attn, self.mlp = NNXAttention(rngs), NNXMLP(rngs)
        self.input_layernorm = nnx.RMSNorm(DIM, epsilon=EPS, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(DIM, epsilon=EPS, rngs=rngs)


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.embed_tokens = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.layers = nnx.List([NNXLayer(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(DIM, epsilon=EPS, rngs=rngs)


class NNXLlama(nnx.Module):
    """Hugging Face's names: `model.layers[0].self_attn.q_proj`, ..., `lm_head`."""

    def __init__(self, rngs):
        self.model = NNXModel(rngs)
        self.lm_head = nnx_linear(DIM, VOCAB, rngs)

    def __call__(self, ids):
        cos, sin = rotary(ids.shape[1])
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = block(layer, x, cos, sin, lambda module, h: module(h))
        return self.lm_head(self.model.norm(x))


# --- in Equinox (layers act on one token: vmapped over batch and time) --------------
def eqx_linear(i, o, key):
    return eqx.nn.Linear(i, o, use_bias=False, key=key)


def eqx_norm():
    return eqx.nn.RMSNorm(DIM, eps=EPS, use_bias=False)


class EqxAttention(eqx.Module):
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.q_proj = eqx_linear(DIM, HEADS * HD, k[0])
        self.k_proj = eqx_linear(DIM, KV_HEADS * HD, k[1])
        self.v_proj = eqx_linear(DIM, KV_HEADS * HD, k[2])
        self.o_proj = eqx_linear(HEADS * HD, DIM, k[3])


class EqxMLP(eqx.Module):
    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.gate_proj = eqx_linear(DIM, HIDDEN, k[0])
        self.up_proj = eqx_linear(DIM, HIDDEN, k[1])
        self.down_proj = eqx_linear(HIDDEN, DIM, k[2])


class EqxLayer(eqx.Module):
    self_attn: EqxAttention
    mlp: EqxMLP
    input_layernorm: eqx.nn.RMSNorm
    post_attention_layernorm: eqx.nn.RMSNorm

    def __init__(self, key):
        k = jax.random.split(key)
        self.self_attn, self.mlp = EqxAttention(k[0]), EqxMLP(k[1])
        self.input_layernorm, self.post_attention_layernorm = eqx_norm(), eqx_norm()


class EqxModel(eqx.Module):
    embed_tokens: eqx.nn.Embedding
    layers: list
    norm: eqx.nn.RMSNorm

    def __init__(self, key):
        k = jax.random.split(key, LAYERS + 1)
        self.embed_tokens = eqx.nn.Embedding(VOCAB, DIM, key=k[0])
        self.layers = [EqxLayer(k[i + 1]) for i in range(LAYERS)]
        self.norm = eqx_norm()


class EqxLlama(eqx.Module):
    model: EqxModel
    lm_head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key)
        self.model, self.lm_head = EqxModel(k[0]), eqx_linear(DIM, VOCAB, k[1])

    def __call__(self, ids):
        per_token = lambda module, h: jax.vmap(jax.vmap(module))(h)  # noqa: E731
        cos, sin = rotary(ids.shape[1])
        x = per_token(self.model.embed_tokens, ids)
        for layer in self.model.layers:
            x = block(layer, x, cos, sin, per_token)
        return per_token(self.lm_head, per_token(self.model.norm, x))


def loss_fn(model, ids):
    """Next-token cross-entropy."""
    logits = model(ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def main():
    work = Path(tempfile.mkdtemp())
    ids = jax.random.randint(jax.random.key(0), (4, 12), 0, VOCAB)

    # 1. a Hugging Face Llama folder -> the NNX Llama
    if HAVE_TORCH:
        import torch
        import transformers

        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN,
            num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS, rms_norm_eps=EPS, rope_theta=THETA,
            max_position_embeddings=64, tie_word_embeddings=False,
        )  # fmt: skip
        transformers.LlamaForCausalLM(config).save_pretrained(work / "llama")
        base = bridge.load(
            work / "llama" / "model.safetensors", like=NNXLlama(nnx.Rngs(0))
        )
    else:
        base = NNXLlama(nnx.Rngs(0))

    # 2. adapters on q_proj and v_proj, 20 steps training them alone
    tree = bridge.lora(
        bridge.from_nnx(base), ["q_proj", "v_proj"], rank=4, alpha=8,
        key=jax.random.key(1),
    )  # fmt: skip
    step = bridge.make_step(loss_fn, optax.adam(1e-2), bridge.trainable(tree, "lora"))
    opt_state = step.init(tree)
    first = None
    for _ in range(20):
        tree, opt_state, loss = step(tree, opt_state, ids)
        first = float(loss) if first is None else first
    print(f"20 LoRA steps: loss {first:.4f} -> {float(loss):.4f}")
    tuned = bridge.to_native(tree)
    logits = np.asarray(tuned(ids))

    # 3. save_peft -> transformers + peft: the same logits
    bridge.save_peft(work / "adapter", tree)
    if HAVE_TORCH:
        import peft
        import torch
        import transformers

        hf = transformers.LlamaForCausalLM.from_pretrained(work / "llama")
        hf = peft.PeftModel.from_pretrained(hf, work / "adapter").eval()
        with torch.no_grad():
            hf_logits = hf(torch.tensor(np.asarray(ids))).logits.numpy()
        print(f"PEFT vs bridge logits: max diff {np.abs(hf_logits - logits).max():.1e}")
        assert np.abs(hf_logits - logits).max() < 1e-4

    # 4. the same adapter into the Equinox Llama
    eqx_base = bridge.port(base, EqxLlama(jax.random.key(0)))
    eqx_tuned = bridge.load_peft(work / "adapter", eqx_base)
    eqx_logits = np.asarray(eqx_tuned(ids))
    print(f"Equinox vs NNX logits: max diff {np.abs(eqx_logits - logits).max():.1e}")
    assert np.abs(eqx_logits - logits).max() < 1e-4

    # 5. merged, in PyTorch layout, loaded by from_pretrained
    merged = bridge.merge_lora(tree)
    if HAVE_TORCH:
        import torch
        import transformers

        out = work / "merged"
        shutil.copytree(work / "llama", out)
        bridge.save_state_dict(out / "model.safetensors", merged, prefix="")
        hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            merged_logits = hf(torch.tensor(np.asarray(ids))).logits.numpy()
        print(
            "merged, from_pretrained vs bridge: "
            f"{np.abs(merged_logits - logits).max():.1e}"
        )
        assert np.abs(merged_logits - logits).max() < 1e-4
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
