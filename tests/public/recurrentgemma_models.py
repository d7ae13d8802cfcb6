"""Google DeepMind's RecurrentGemma (Griffin, `pip install recurrentgemma`): one
package, a Flax Linen implementation (`recurrentgemma.jax.Griffin`) and a PyTorch
one (`recurrentgemma.torch.Griffin`) by the same authors, with the same layer
names. Its layers are the ones no other suite has: RMSNorm written by hand with a
`scale` used as `1 + scale`, block-diagonal einsum products (`(heads, in, out)`
weights), a depthwise causal Conv1D (`w (temporal_width, width)`), the RG-LRU's
per-channel decay `a_param`, an embedding tied to the logits on both sides.

Twins: the Linen model against the package's own PyTorch model (its checkpoints
are its state dict: `load_state_dict(strict=True)` is its loader), and against
transformers' `RecurrentGemmaForCausalLM` (the same architecture in transformers'
names, a `save_pretrained` folder)."""

from __future__ import annotations

import numpy as np

from .code_bases import (
    Case,
    hf_folder,
    read_state_dict_file,
    state_dict_file,
    to_numpy,
    torch_tensors,
)


BATCH, SEQ, VOCAB = 2, 6, 64
# the local-attention window no shorter than the sequence: with a shorter one,
# transformers' RecurrentGemma and recurrentgemma mask different past tokens (0.40
# apart at window 4 by the hand mapping `hf_by_hand`; equal from window 6 on)
WIDTH, HEADS, MLP, WINDOW = 16, 2, 32, 8


def _config():
    from recurrentgemma import common

    block = common.TemporalBlockType
    return common.GriffinConfig(
        vocab_size=VOCAB,
        width=WIDTH,
        mlp_expanded_width=MLP,
        num_heads=HEADS,
        block_types=(block.RECURRENT, block.RECURRENT, block.ATTENTION),
        embeddings_scale_by_sqrt_dim=True,
        attention_window_size=WINDOW,
        logits_soft_cap=30.0,
    )


def _inputs():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy()
    return tokens, positions


def _linen():
    import jax
    import jax.numpy as jnp
    from recurrentgemma import jax as rg

    config = _config()
    module = rg.Griffin(config, gradient_checkpointing=False)
    tokens, positions = _inputs()
    variables = module.init(
        jax.random.key(0), jnp.asarray(tokens), jnp.asarray(positions)
    )
    return module, variables


def _linen_call(model) -> np.ndarray:
    import jax.numpy as jnp

    module, variables = model
    tokens, positions = _inputs()
    logits, _ = module.apply(
        variables, jnp.asarray(tokens), jnp.asarray(positions), return_cache=False
    )
    return to_numpy(logits)


def _torch():
    from recurrentgemma import torch as rg

    return rg.Griffin(_config(), gradient_checkpointing=False).eval()


def _torch_call(model) -> np.ndarray:
    import torch

    tokens, positions = _inputs()
    inputs = torch_tensors(tokens=tokens, positions=positions)
    with torch.no_grad():
        logits, _ = model(inputs["tokens"], inputs["positions"], return_cache=False)
    return to_numpy(logits)


def griffin() -> Case:
    """The Linen Griffin against the package's own PyTorch Griffin; the file is the
    PyTorch model's state dict in safetensors."""
    tokens, positions = _inputs()
    return Case(
        "recurrentgemma",
        "recurrentgemma",
        "linen",
        _linen,
        _torch,
        _linen_call,
        _torch_call,
        (tokens, positions),
        {"return_cache": False},
        {"return_cache": False},
        state_dict_file,
        read_state_dict_file(_torch),
        save_path="griffin.safetensors",
    )


def _hf_config():
    import transformers

    config = _config()
    return transformers.RecurrentGemmaConfig(
        num_hidden_layers=len(config.block_types),
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * MLP,  # transformers halves it (`intermediate_size // 2`)
        num_attention_heads=HEADS,
        num_key_value_heads=1,
        lru_width=WIDTH,
        attention_window_size=WINDOW,
        conv1d_width=4,
        logits_soft_cap=30.0,
        block_types=["recurrent", "recurrent", "attention"],
        hidden_activation="gelu_pytorch_tanh",
        partial_rotary_factor=0.5,
        pad_token_id=0,
    )


def _hf():
    import transformers

    return transformers.RecurrentGemmaForCausalLM(_hf_config()).eval()


def _hf_call(model) -> np.ndarray:
    import torch

    tokens, positions = _inputs()
    inputs = torch_tensors(input_ids=tokens, position_ids=positions)
    with torch.no_grad():
        out = model(**inputs, use_cache=False)
    return to_numpy(out.logits)


def griffin_hf() -> Case:
    """The Linen Griffin against transformers' `RecurrentGemmaForCausalLM` (a
    `save_pretrained` folder, opened by `from_pretrained`)."""
    import transformers

    tokens, positions = _inputs()

    def read(folder):
        return transformers.RecurrentGemmaForCausalLM.from_pretrained(folder).eval()

    return Case(
        "recurrentgemma-hf",
        "recurrentgemma",
        "linen",
        _linen,
        _hf,
        _linen_call,
        _hf_call,
        (tokens,),
        {"segment_pos": positions, "return_cache": False},
        {"position_ids": torch_tensors(p=positions)["p"], "use_cache": False},
        hf_folder,
        read,
        save_kwargs={"config": _hf_config()},
    )


def hf_by_hand(torch_model):
    """transformers' `RecurrentGemmaForCausalLM` state as the Linen Griffin's
    variables, mapped by hand from the two codes, no bridge: the oracle that the
    twins compute alike. Linear weights transposed; the MLP's `gate_proj` and
    `up_proj` stacked as `ffw_up.w[0]`, `[1]` (its bias `(2, 1, 1, out)`); the
    depthwise conv `(C, 1, K)` as `w (K, C)`; the RG-LRU's gates `input_gate_*`,
    `recurrent_gate_*` as `input_gate`, `a_gate`, `recurrent_param` as
    `a_param`; norms' `weight` as `scale` (both compute `1 + scale`)."""
    import jax.numpy as jnp

    state = {
        k: jnp.asarray(v.detach().numpy()) for k, v in torch_model.state_dict().items()
    }
    params = {
        "embedder": {"input_embedding": state["model.embed_tokens.weight"]},
        "final_norm": {"scale": state["model.final_norm.weight"]},
    }

    def dense(name, bias=True):
        out = {"kernel": state[name + ".weight"].T}
        if bias:
            out["bias"] = state[name + ".bias"]
        return out

    for i, kind in enumerate(_config().block_types):
        theirs = f"model.layers.{i}."
        mlp = theirs + "mlp_block."
        block = {
            "temporal_pre_norm": {"scale": state[theirs + "temporal_pre_norm.weight"]},
            "channel_pre_norm": {"scale": state[theirs + "channel_pre_norm.weight"]},
            "mlp_block": {
                "ffw_up": {
                    "w": jnp.stack(
                        [state[mlp + p + ".weight"].T for p in ("gate_proj", "up_proj")]
                    ),
                    "b": jnp.stack(
                        [state[mlp + p + ".bias"] for p in ("gate_proj", "up_proj")]
                    )[:, None, None, :],
                },
                "ffw_down": dense(mlp + "down_proj"),
            },
        }
        t = theirs + "temporal_block."
        if kind.name == "ATTENTION":
            block["attention_block"] = {
                "proj_q": dense(t + "q_proj", bias=False),
                "proj_k": dense(t + "k_proj", bias=False),
                "proj_v": dense(t + "v_proj", bias=False),
                "proj_final": dense(t + "o_proj"),
            }
        else:
            lru = t + "rg_lru."
            block["recurrent_block"] = {
                "linear_x": dense(t + "linear_x"),
                "linear_y": dense(t + "linear_y"),
                "linear_out": dense(t + "linear_out"),
                "conv_1d": {
                    "w": state[t + "conv_1d.weight"][:, 0, :].T,
                    "b": state[t + "conv_1d.bias"],
                },
                "rg_lru": {
                    "a_param": state[lru + "recurrent_param"],
                    "input_gate": {
                        "w": state[lru + "input_gate_weight"],
                        "b": state[lru + "input_gate_bias"],
                    },
                    "a_gate": {
                        "w": state[lru + "recurrent_gate_weight"],
                        "b": state[lru + "recurrent_gate_bias"],
                    },
                },
            }
        params[f"blocks.{i}"] = block
    return _linen()[0], {"params": params}


PACKAGE = "recurrentgemma"
CASES = {"recurrentgemma": griffin, "recurrentgemma-hf": griffin_hf}
