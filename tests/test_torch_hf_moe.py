"""Mixture-of-experts checkpoints in every layout: a tiny Qwen2-MoE (transformers,
random weights, no download) read from its v5 packed state dict
(`mlp.experts.gate_up_proj` `(E, 2F, D)`) and from `save_pretrained`'s per-expert
folder (`mlp.experts.{e}.gate_proj.weight`) into the same model written in NNX with
its experts as a stack (`nnx.vmap`: `gate_proj.kernel` `(E, D, F)`); written back as a
Hugging Face folder per expert and packed (`packed_experts="qwen2_moe"`), both opened
by `from_pretrained` with transformers' logits. The same in Equinox (its experts an
`eqx.filter_vmap` stack: `gate_proj.weight` `(E, F, D)`). Skipped without torch and
transformers (`nox -s tests_torch`)."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import bridge

from .helpers import requires
from .hf_common import eqx_node, node, perturb


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, requires("NNX")]

D, FF, MOE_FF, SHARED_FF, VOCAB, LAYERS, HEADS, KV, E = 16, 32, 8, 24, 64, 2, 4, 2, 4
IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 40]])


def _qwen2_moe():
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=FF,
        moe_intermediate_size=MOE_FF,
        shared_expert_intermediate_size=SHARED_FF,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        num_experts=E,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return perturb(transformers.Qwen2MoeForCausalLM(config), torch)


class Expert(nnx.Module):
    def __init__(self, rngs):
        self.gate_proj = nnx.Linear(D, MOE_FF, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(D, MOE_FF, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(MOE_FF, D, use_bias=False, rngs=rngs)


@nnx.split_rngs(splits=E)
@nnx.vmap(in_axes=(0,), out_axes=0)
def experts(rngs):
    """E experts as one stack: each array has a leading expert axis."""
    return Expert(rngs)


def qwen2_moe_in_nnx():
    rngs = nnx.Rngs(0)
    lin = lambda i, o, bias=False: nnx.Linear(i, o, use_bias=bias, rngs=rngs)  # noqa: E731
    norm = lambda: nnx.RMSNorm(D, epsilon=1e-6, rngs=rngs)  # noqa: E731

    def layer():
        attn = node(
            q_proj=lin(D, D, True),
            k_proj=lin(D, D // HEADS * KV, True),
            v_proj=lin(D, D // HEADS * KV, True),
            o_proj=lin(D, D),
        )
        mlp = node(
            gate=lin(D, E),
            experts=experts(rngs),
            shared_expert=node(
                gate_proj=lin(D, SHARED_FF),
                up_proj=lin(D, SHARED_FF),
                down_proj=lin(SHARED_FF, D),
            ),
            shared_expert_gate=lin(D, 1),
        )
        return node(
            self_attn=attn,
            mlp=mlp,
            input_layernorm=norm(),
            post_attention_layernorm=norm(),
        )

    body = node(
        embed_tokens=nnx.Embed(VOCAB, D, rngs=rngs),
        layers=nnx.List([layer() for _ in range(LAYERS)]),
        norm=norm(),
    )
    return node(model=body, lm_head=lin(D, VOCAB))


def qwen2_moe_in_equinox():
    keys = iter(jax.random.split(jax.random.key(0), 200))
    lin = lambda i, o, bias=False: eqx.nn.Linear(i, o, use_bias=bias, key=next(keys))  # noqa: E731
    norm = lambda: eqx.nn.RMSNorm(D, eps=1e-6, use_bias=False)  # noqa: E731

    def expert(key):
        k1, k2, k3 = jax.random.split(key, 3)
        return eqx_node(
            gate_proj=eqx.nn.Linear(D, MOE_FF, use_bias=False, key=k1),
            up_proj=eqx.nn.Linear(D, MOE_FF, use_bias=False, key=k2),
            down_proj=eqx.nn.Linear(MOE_FF, D, use_bias=False, key=k3),
        )

    def layer():
        attn = eqx_node(
            q_proj=lin(D, D, True),
            k_proj=lin(D, D // HEADS * KV, True),
            v_proj=lin(D, D // HEADS * KV, True),
            o_proj=lin(D, D),
        )
        mlp = eqx_node(
            gate=lin(D, E),
            experts=eqx.filter_vmap(expert)(jax.random.split(next(keys), E)),
            shared_expert=eqx_node(
                gate_proj=lin(D, SHARED_FF),
                up_proj=lin(D, SHARED_FF),
                down_proj=lin(SHARED_FF, D),
            ),
            shared_expert_gate=lin(D, 1),
        )
        return eqx_node(
            self_attn=attn,
            mlp=mlp,
            input_layernorm=norm(),
            post_attention_layernorm=norm(),
        )

    body = eqx_node(
        embed_tokens=eqx.nn.Embedding(VOCAB, D, key=next(keys)),
        layers=[layer() for _ in range(LAYERS)],
        norm=norm(),
    )
    return eqx_node(model=body, lm_head=lin(D, VOCAB))


MODELS = {"nnx": qwen2_moe_in_nnx, "equinox": qwen2_moe_in_equinox}


def _up_proj(model, layer, fw):
    """The layer's experts' up_proj as `(E, F, D)` (PyTorch's orientation)."""
    experts = model.model.layers[layer].mlp.experts
    if fw == "nnx":
        return np.swapaxes(np.asarray(experts.up_proj.kernel[...]), 1, 2)
    return np.asarray(experts.up_proj.weight)


def _gate_proj(model, layer, fw):
    experts = model.model.layers[layer].mlp.experts
    if fw == "nnx":
        return np.swapaxes(np.asarray(experts.gate_proj.kernel[...]), 1, 2)
    return np.asarray(experts.gate_proj.weight)


def _state(hf):
    return {k: v.detach().numpy() for k, v in hf.state_dict().items()}


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("fw", ["nnx", "equinox"])
def test_packed_file_into_an_expert_stack_and_out_both_ways(tmp_path, fw):
    hf = _qwen2_moe()
    state = _state(hf)
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, 2 * MOE_FF, D)
    packed = tmp_path / "packed.safetensors"
    safetensors.numpy.save_file(state, packed, metadata={"format": "pt"})
    model = bridge.load(packed, like=MODELS[fw]())
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
    assert np.array_equal(_up_proj(model, 1, fw), gate_up[:, MOE_FF:])
    expected = _logits(hf)
    for how in (None, "qwen2_moe"):
        out = tmp_path / f"out-{how}"
        bridge.save_pretrained(
            out, model, max_shard_size="8KB", config=hf.config, packed_experts=how
        )
        index = json.loads((out / "model.safetensors.index.json").read_text())
        names = set(index["weight_map"])
        assert ("model.layers.0.mlp.experts.gate_up_proj" in names) == (how is not None)
        assert ("model.layers.0.mlp.experts.3.up_proj.weight" in names) == (how is None)
        back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        loaded = back.state_dict()
        assert all(torch.equal(v, loaded[k]) for k, v in hf.state_dict().items())
        # the same weights; torch's MoE kernels may sum in another order (6e-8 seen)
        assert torch.allclose(_logits(back), expected, rtol=0, atol=1e-6), how


@pytest.mark.parametrize("fw", ["nnx", "equinox"])
def test_save_pretrained_folder_per_expert_into_the_stack(tmp_path, fw):
    hf = _qwen2_moe()
    folder = tmp_path / "hf"
    hf.save_pretrained(folder, max_shard_size="8KB")  # per expert on disk
    model = bridge.load(folder, like=MODELS[fw]())
    state = _state(hf)
    gate_up = state["model.layers.0.mlp.experts.gate_up_proj"]
    assert np.array_equal(_gate_proj(model, 0, fw), gate_up[:, :MOE_FF])
    norm = model.model.norm
    scale = norm.scale[...] if fw == "nnx" else norm.weight
    assert jnp.array_equal(scale, state["model.norm.weight"])
