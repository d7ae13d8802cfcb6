"""Llama's tensor names in llama.cpp's GGUF files and in Hugging Face checkpoints
(`LlamaForCausalLM`): model-family data.

llama.cpp's `convert_hf_to_gguf.py` renames each tensor (`model.layers.0.self_attn.
q_proj.weight` becomes `blk.0.attn_q.weight`) and permutes the rows of the query and
key projections so that each head's rotary pairs are adjacent: rows `(head, half,
i)` are stored as `(head, i, half)`, with the query's head count for `attn_q` and
the key-value head count for `attn_k` (their biases too). transformers'
`load_gguf_checkpoint` undoes both (`LlamaTensorProcessor`); so does `hf_name` with
`unpermute`.
"""

from __future__ import annotations

import re

import numpy as np


ARCHITECTURES = ("llama",)
"""The GGUF `general.architecture` values whose files these names describe."""

TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
PERMUTED = {
    "attn_q": "attention.head_count",
    "attn_k": "attention.head_count_kv",
}
"""The tensors whose rows llama.cpp permutes, and the key-value (after
`<architecture>.`) giving their head count."""

_BLOCK_RE = re.compile(r"blk\.(?P<i>\d+)\.(?P<part>\w+)\.(?P<kind>weight|bias)")
_TOP_RE = re.compile(r"(?P<part>\w+)\.(?P<kind>weight|bias)")


def hf_name(name: str) -> tuple[str, str | None] | None:
    """`(Hugging Face name, head-count key or None)` of GGUF tensor `name`, None for
    a tensor Hugging Face's Llama does not have (`rope_freqs.weight`).

    ```python
    >>> hf_name("blk.3.attn_k.weight")
    ('model.layers.3.self_attn.k_proj.weight', 'attention.head_count_kv')
    >>> hf_name("output_norm.weight")
    ('model.norm.weight', None)

    ```
    """
    if m := _BLOCK_RE.fullmatch(name):
        part = BLOCK.get(m["part"])
        if part is None:
            return None
        hf = f"model.layers.{m['i']}.{part}.{m['kind']}"
        return hf, PERMUTED.get(m["part"])  # a bias's rows too
    if (m := _TOP_RE.fullmatch(name)) and m["part"] in TOP:
        return f"{TOP[m['part']]}.{m['kind']}", None
    return None


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """The rows of a GGUF `attn_q`/`attn_k` weight `(rows, cols)` or bias `(rows,)`
    in Hugging Face's order (`LlamaTensorProcessor._reverse_permute_weights`).

    ```python
    >>> unpermute(np.arange(8)[:, None], 2)[:, 0]
    array([0, 2, 1, 3, 4, 6, 5, 7])

    ```
    """
    rows = weight.shape[0]
    w = weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(2, 1).reshape(weight.shape))
