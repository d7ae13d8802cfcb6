"""LoRA on a PyTorch-layout model: a Hugging Face folder, no model class in JAX.

1. A tiny Hugging Face Llama folder (`LlamaConfig`, random weights, offline) and a
   PEFT adapter on its `q_proj`/`v_proj`, trained 5 Adam steps in PyTorch.
2. `bridge.load(folder / "model.safetensors")` reads the folder in PyTorch layout;
   `bridge.load_peft` puts the adapter on it and `bridge.merge_lora` folds it in:
   the merged checkpoint made without PyTorch, `bridge.save_state_dict`,
   loads with `from_pretrained` and gives `merge_and_unload`'s logits.
3. `bridge.lora` on the same Tree: adapters in PEFT's orientation (`lora_a (r, in)`,
   `lora_b (out, r)`); `bridge.to_torch` gives the state dict of PEFT's LoRA model
   (`peft.inject_adapter_in_model`), which loads strictly and computes what
   `bridge.save_peft`'s files compute in `PeftModel.from_pretrained`.

Needs `torch`, `transformers` and `peft`; without them the example says so and stops.

    python examples/lora_torch.py
"""

import copy
import importlib.util
import shutil
import tempfile
import warnings
from pathlib import Path

import jax
import numpy as np

import bridge


HAVE_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft"))
TARGETS = ["q_proj", "v_proj"]


def main() -> None:
    if not HAVE_TORCH:
        print("lora_torch.py needs torch, transformers and peft: skipped")
        return
    import peft
    import torch
    import transformers

    warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
    work = Path(tempfile.mkdtemp())
    ids = torch.tensor([[1, 5, 9, 3, 7, 2], [4, 4, 8, 0, 11, 6]])

    # 1. the Hugging Face folder and a PEFT adapter trained in PyTorch
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(work / "base")
    tuned = peft.get_peft_model(
        copy.deepcopy(hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)
    )
    opt = torch.optim.Adam([p for p in tuned.parameters() if p.requires_grad], 1e-2)
    for _ in range(5):
        opt.zero_grad()
        tuned(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    tuned.eval().save_pretrained(work / "adapter")

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids).logits.numpy()

    # 2. merged without PyTorch, into a folder from_pretrained loads
    tree = bridge.load(work / "base" / "model.safetensors")  # PyTorch layout
    merged = bridge.merge_lora(bridge.load_peft(work / "adapter", tree))
    shutil.copytree(work / "base", work / "merged")
    bridge.save_state_dict(work / "merged" / "model.safetensors", merged)
    loaded = transformers.LlamaForCausalLM.from_pretrained(work / "merged").eval()
    want = logits(copy.deepcopy(tuned).merge_and_unload())
    gap = np.abs(logits(loaded) - want).max()
    print(f"merged without PyTorch: logits within {gap:.1e} of merge_and_unload's")
    assert gap < 1e-5

    # 3. adapters on the PyTorch-layout Tree itself
    adapted = bridge.lora(tree, TARGETS, rank=2, alpha=4, key=jax.random.key(0))
    adapted = jax.tree_util.tree_map_with_path(  # as after training: lora_b nonzero
        lambda p, x: x + 0.1 if "lora_b" in jax.tree_util.keystr(p) else x, adapted
    )
    q = adapted.model.layers[0].self_attn.q_proj
    print("q_proj adapter:", q.lora_a.shape, q.lora_b.shape)
    injected = peft.inject_adapter_in_model(
        peft.LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS), copy.deepcopy(hf)
    )
    injected.load_state_dict(bridge.to_torch(adapted, tensors=True), strict=True)
    bridge.save_peft(work / "mine", adapted)
    from_files = peft.PeftModel.from_pretrained(copy.deepcopy(hf), work / "mine")
    gap = np.abs(logits(injected) - logits(from_files)).max()
    moved = np.abs(logits(injected) - logits(hf)).max()
    print(f"to_torch in PEFT's model: logits within {gap:.1e} of save_peft's files")
    print(f"(the adapters move the logits by {moved:.2f})")
    assert gap < 1e-5 and moved > 1e-3


if __name__ == "__main__":
    main()
