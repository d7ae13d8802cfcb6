"""Mamba2 in Flax NNX (`pip install mamba2-jax`, the jax-state-spaces port)
against transformers' `Mamba2ForCausalLM`.

Its layers: a hand-written RMSNorm (`weight`, gated by `silu(z)` inside the
mixer), a depthwise causal convolution stored as an `nnx.Conv` kernel `(K, 1, C)`
but computed by hand as shifted products (transformers: `nn.Conv1d(groups=C)`
`(C, 1, K)`), per-head vectors `A_log`, `D`, `dt_bias` used elementwise, one fused
input projection split five ways, and the logits computed as `hidden @
embedding.T` (a tie inside the JAX model; transformers ties `lm_head.weight`)."""

from __future__ import annotations

import numpy as np

from .code_bases import Case, hf_folder, to_numpy, torch_tensors


BATCH, SEQ, VOCAB = 2, 8, 64
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    state_size=8,
    head_dim=8,
    expand=2,
    chunk_size=4,
    conv_kernel=4,
    num_hidden_layers=2,
    layer_norm_epsilon=1e-5,
    use_bias=False,
    use_conv_bias=True,
    residual_in_fp32=True,
    tie_word_embeddings=True,
    # finite: transformers writes an infinite limit into config.json as
    # {"__float__": "Infinity"}, which its own from_pretrained then refuses
    time_step_limit=(0.0, 100.0),
)


def _ids() -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)


def _hf_config():
    import transformers

    return transformers.Mamba2Config(
        **SIZES,
        num_heads=SIZES["expand"] * SIZES["hidden_size"] // SIZES["head_dim"],
        n_groups=1,  # mamba2-jax shares B and C across heads
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )


def _nnx():
    from flax import nnx
    from mamba2_jax import Mamba2Config, Mamba2ForCausalLM

    return Mamba2ForCausalLM(Mamba2Config(**SIZES), rngs=nnx.Rngs(0))


def _nnx_call(model) -> np.ndarray:
    import jax.numpy as jnp

    return to_numpy(model(jnp.asarray(_ids()))["logits"])


def _hf():
    import transformers

    return transformers.Mamba2ForCausalLM(_hf_config()).eval()


def _hf_call(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return to_numpy(
            model(**torch_tensors(input_ids=_ids()), use_cache=False).logits
        )


def mamba2() -> Case:
    import transformers

    def read(folder):
        return transformers.Mamba2ForCausalLM.from_pretrained(folder).eval()

    return Case(
        "mamba2",
        "mamba2-jax",
        "nnx",
        _nnx,
        _hf,
        _nnx_call,
        _hf_call,
        (_ids(),),
        {},
        {"use_cache": False},
        hf_folder,
        read,
        save_kwargs={"config": _hf_config()},
    )


PACKAGE = "mamba2_jax"
CASES = {"mamba2": mamba2}
