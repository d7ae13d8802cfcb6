"""One Llama through every framework, with no rules: a MaxText-style Linen decoder
(`nn.scan` with the params' layer axis at 1, bias-free projections, RMSNorm,
MaxText's names `query`, `wi_0`, `decoder_norm`, ...) -> a per-layer NNX Llama with
Hugging Face's names (example inputs pair them: no name is shared) -> an Equinox
Llama whose layers are one `eqx.filter_vmap` stack -> transformers'
`LlamaForCausalLM`, and back. At every hop the ported model's logits are compared
with the first model's own forward pass (transformers' for the torch model)."""

from functools import partial

import equinox as eqx
import flax.linen as nn
import jax
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import bridge

from .helpers import requires
from .llamas import (
    DIM,
    EPS,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    VOCAB,
    DecoderLayer,
    LlamaForCausalLM,
    attend,
    llama_config,
    rotary,
    rotate,
    tokens,
)


pytestmark = requires("NNX")

HD = DIM // HEADS


# --- MaxText-style Linen decoder --------------------------------------------------


class MaxTextBlock(nn.Module):
    """One decoder layer as MaxText names it (`query`, `key`, `value`, `out`, `wi_0`,
    `wi_1`, `wo`, `pre_self_attention_layer_norm`, ...), bias-free."""

    @nn.compact
    def __call__(self, x, _):
        b, t, _ = x.shape
        cos, sin = rotary(t, HD)
        dense = partial(nn.Dense, use_bias=False)
        norm = partial(nn.RMSNorm, epsilon=EPS)
        h = norm(name="pre_self_attention_layer_norm")(x)
        q = dense(HEADS * HD, name="query")(h).reshape(b, t, HEADS, HD)
        k = dense(KV_HEADS * HD, name="key")(h).reshape(b, t, KV_HEADS, HD)
        v = dense(KV_HEADS * HD, name="value")(h).reshape(b, t, KV_HEADS, HD)
        a = attend(rotate(q, cos, sin), rotate(k, cos, sin), v)
        x = x + dense(DIM, name="out")(a.reshape(b, t, DIM))
        h = norm(name="post_self_attention_layer_norm")(x)
        gate = jax.nn.silu(dense(HIDDEN, name="wi_0")(h))
        return x + dense(DIM, name="wo")(gate * dense(HIDDEN, name="wi_1")(h)), None


class MaxTextDecoder(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, DIM, name="token_embedder")(ids)
        layers = nn.scan(
            MaxTextBlock,
            variable_axes={"params": 1},  # MaxText's param_scan_axis
            split_rngs={"params": True},
            length=LAYERS,
        )
        x, _ = layers(name="decoder")(x, None)
        x = nn.RMSNorm(epsilon=EPS, name="decoder_norm")(x)
        return nn.Dense(VOCAB, use_bias=False, name="logits_dense")(x)


def maxtext(seed: int):
    """`(module, variables)`, initialised under `jax.jit` as MaxText does (its dicts
    come back sorted), the norms' scales made random so that a norm paired with
    the wrong one shows."""
    module = MaxTextDecoder()

    @jax.jit
    def init(key):
        params = module.init(key, tokens())["params"]
        return jax.tree_util.tree_map_with_path(
            lambda p, x: (
                x * jax.random.uniform(key, x.shape, x.dtype, 0.5, 1.5)
                if "norm" in jax.tree_util.keystr(p)
                else x
            ),
            params,
        )

    return module, {"params": init(jax.random.key(seed))}


# --- Equinox Llama with Hugging Face's names, its layers one stack ------------------


def _per_token(linear: eqx.nn.Linear, x: jax.Array) -> jax.Array:
    return jax.vmap(linear)(x)


class EqxAttention(eqx.Module):
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        linear = partial(eqx.nn.Linear, use_bias=False)
        self.q_proj = linear(DIM, HEADS * HD, key=k[0])
        self.k_proj = linear(DIM, KV_HEADS * HD, key=k[1])
        self.v_proj = linear(DIM, KV_HEADS * HD, key=k[2])
        self.o_proj = linear(HEADS * HD, DIM, key=k[3])

    def __call__(self, x, cos, sin):
        t = x.shape[0]
        q = _per_token(self.q_proj, x).reshape(1, t, HEADS, HD)
        k = _per_token(self.k_proj, x).reshape(1, t, KV_HEADS, HD)
        v = _per_token(self.v_proj, x).reshape(1, t, KV_HEADS, HD)
        a = attend(rotate(q, cos, sin), rotate(k, cos, sin), v)
        return _per_token(self.o_proj, a.reshape(t, DIM))


class EqxMLP(eqx.Module):
    gate_proj: eqx.nn.Linear
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        linear = partial(eqx.nn.Linear, use_bias=False)
        self.gate_proj = linear(DIM, HIDDEN, key=k[0])
        self.up_proj = linear(DIM, HIDDEN, key=k[1])
        self.down_proj = linear(HIDDEN, DIM, key=k[2])

    def __call__(self, x):
        gate = jax.nn.silu(_per_token(self.gate_proj, x))
        return _per_token(self.down_proj, gate * _per_token(self.up_proj, x))


def _rms_norm() -> eqx.nn.RMSNorm:
    return eqx.nn.RMSNorm(DIM, eps=EPS, use_bias=False)


class EqxDecoderLayer(eqx.Module):
    self_attn: EqxAttention
    mlp: EqxMLP
    input_layernorm: eqx.nn.RMSNorm
    post_attention_layernorm: eqx.nn.RMSNorm

    def __init__(self, key):
        k = jax.random.split(key)
        self.self_attn = EqxAttention(k[0])
        self.mlp = EqxMLP(k[1])
        self.input_layernorm = _rms_norm()
        self.post_attention_layernorm = _rms_norm()

    def __call__(self, x, cos, sin):
        x = x + self.self_attn(jax.vmap(self.input_layernorm)(x), cos, sin)
        return x + self.mlp(jax.vmap(self.post_attention_layernorm)(x))


class EqxLlamaModel(eqx.Module):
    embed_tokens: eqx.nn.Embedding
    layers: EqxDecoderLayer  # one stack: every array has a leading layer axis
    norm: eqx.nn.RMSNorm

    def __init__(self, key):
        k = jax.random.split(key)
        self.embed_tokens = eqx.nn.Embedding(VOCAB, DIM, key=k[0])
        self.layers = eqx.filter_vmap(EqxDecoderLayer)(jax.random.split(k[1], LAYERS))
        self.norm = _rms_norm()

    def __call__(self, ids):
        cos, sin = rotary(ids.shape[0], HD)
        x = jax.vmap(self.embed_tokens)(ids)
        arrays, static = eqx.partition(self.layers, eqx.is_array)

        def step(x, layer):
            return eqx.combine(layer, static)(x, cos, sin), None

        x, _ = jax.lax.scan(step, x, arrays)
        return jax.vmap(self.norm)(x)


class EqxLlamaForCausalLM(eqx.Module):
    """`x`: one example's token ids `(T,)`; returns its logits `(T, VOCAB)`."""

    model: EqxLlamaModel
    lm_head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key)
        self.model = EqxLlamaModel(k[0])
        self.lm_head = eqx.nn.Linear(DIM, VOCAB, use_bias=False, key=k[1])

    def __call__(self, ids):
        return _per_token(self.lm_head, self.model(ids))


# --- NNX Llama whose layers are one nnx.vmap stack (the flax guide's pattern) -----


class NNXStackModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(VOCAB, DIM, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return DecoderLayer(rngs)

        self.layers = make(rngs)
        self.norm = nnx.RMSNorm(DIM, epsilon=EPS, rngs=rngs)

    def __call__(self, ids):
        cos, sin = rotary(ids.shape[1], DIM // HEADS)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, layer):
            return layer(x, cos, sin)

        return self.norm(forward(self.embed_tokens(ids), self.layers))


class NNXStackLlama(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.model = NNXStackModel(rngs)
        self.lm_head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        return self.lm_head(self.model(ids))


# --- the chain ---------------------------------------------------------------------


def _torch():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return torch, transformers


def _hf_logits(torch, hf, ids) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.numpy()


def _hf_with(torch, transformers, state_dict):
    """A fresh `LlamaForCausalLM` holding `state_dict` (`load_state_dict(strict=True)`:
    every name and shape must be there)."""
    torch.manual_seed(7)
    hf = transformers.LlamaForCausalLM(llama_config()).eval()
    hf.load_state_dict(state_dict, strict=True)
    return hf


TOLERANCE = 1e-5


# Slow (25 s on 2 shared cores: a decoder run eagerly under `nn.scan`). The default
# session covers its paths on smaller models: an `nn.scan` stack of RMSNorm and
# bias-free Dense layers, the params' layer axis at 1, into per-layer NNX layers and
# back by example inputs (test_port_stacked.py::
# test_a_stack_whose_axis_only_the_scan_tells_ports_with_example_inputs[1]); layers
# whose names share nothing (Embed, Dense, LayerNorm, Conv) paired by the forward
# pass, and refused as ambiguous without example inputs, proposing them
# (test_port_property.py::
# test_example_inputs_port_whatever_the_names_and_orders_a_few_cases).
@pytest.mark.slow
def test_maxtext_decoder_to_nnx_pairs_by_the_forward_pass():
    """MaxText's names share nothing with Hugging Face's, and the scanned kernels'
    layer axis is 1; one example input pairs every layer."""
    source = maxtext(0)
    assert source[1]["params"]["decoder"]["query"]["kernel"].shape == (
        DIM,
        LAYERS,
        HEADS * HD,
    )
    ids = tokens()
    target = LlamaForCausalLM(nnx.Rngs(1))
    with pytest.raises(bridge.PortError, match=r"ambiguous.*Give example inputs"):
        bridge.port(source, target)
    plan = bridge.port_plan(source, target, example=ids)
    assert not plan.problems, plan
    rows = {(s.source, s.target) for s in plan.steps}
    assert (".decoder[1].key", ".model.layers[1].self_attn.k_proj") in rows
    assert (".decoder[1].wi_1", ".model.layers[1].mlp.up_proj") in rows
    assert (
        ".decoder[0].post_self_attention_layer_norm",
        ".model.layers[0].post_attention_layernorm",
    ) in rows
    ported = bridge.port(source, target, example=ids)
    assert bridge.compare(source, ported, ids) < TOLERANCE


@pytest.mark.torch
@pytest.mark.slow  # four hops each way, transformers' model run at each end
def test_a_llama_through_every_framework_and_back_without_rules(tmp_path):
    torch, transformers = _torch()
    ids = tokens()
    source = maxtext(0)
    nnx_llama = bridge.port(source, LlamaForCausalLM(nnx.Rngs(1)), example=ids)
    assert bridge.compare(source, nnx_llama, ids) < TOLERANCE
    nnx_stack = bridge.port(nnx_llama, NNXStackLlama(nnx.Rngs(8)), example=ids)
    assert nnx_stack.model.layers.mlp.up_proj.kernel.shape == (LAYERS, DIM, HIDDEN)
    assert bridge.compare(source, nnx_stack, ids) < TOLERANCE
    eqx_llama = bridge.port(nnx_stack, EqxLlamaForCausalLM(jax.random.key(2)))
    assert eqx_llama.model.layers.self_attn.q_proj.weight.shape == (LAYERS, DIM, DIM)
    assert bridge.compare(source, eqx_llama, ids) < TOLERANCE
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(llama_config()).eval()
    state_dict = bridge.port(eqx_llama, hf)
    hf = _hf_with(torch, transformers, state_dict)
    linen_logits = source[0].apply(source[1], ids)
    diff = np.max(np.abs(_hf_logits(torch, hf, ids) - np.asarray(linen_logits)))
    assert diff < TOLERANCE

    # the stacks exported in PyTorch layout, checked against transformers' model,
    # read back by from_pretrained and load_state_dict(strict=True)
    folder = tmp_path / "hf"
    bridge.save_pretrained(folder, eqx_llama, like=hf, config=llama_config())
    read = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    diff = np.max(np.abs(_hf_logits(torch, read, ids) - np.asarray(linen_logits)))
    assert diff < TOLERANCE
    file = tmp_path / "stack.safetensors"
    bridge.save_state_dict(file, nnx_stack, like=hf.state_dict())
    state = {k: torch.tensor(v) for k, v in safetensors.numpy.load_file(file).items()}
    read = _hf_with(torch, transformers, state)
    diff = np.max(np.abs(_hf_logits(torch, read, ids) - np.asarray(linen_logits)))
    assert diff < TOLERANCE

    # and back, from transformers' own model and logits
    torch.manual_seed(4)
    hf = transformers.LlamaForCausalLM(llama_config()).eval()
    hf_logits = _hf_logits(torch, hf, ids)
    eqx_back = bridge.port(hf, EqxLlamaForCausalLM(jax.random.key(5)))
    nnx_back = bridge.port(eqx_back, LlamaForCausalLM(nnx.Rngs(6)))
    linen_back = bridge.port(nnx_back, maxtext(7), example=ids)
    module, variables = linen_back
    hf.save_pretrained(tmp_path / "saved")  # its save_pretrained folder, read lazily
    from_folder = bridge.load(tmp_path / "saved", like=NNXStackLlama(nnx.Rngs(9)))
    for logits in (
        jax.vmap(eqx_back)(ids),
        nnx_back(ids),
        module.apply(variables, ids),
        from_folder(ids),
    ):
        assert np.max(np.abs(np.asarray(logits) - hf_logits)) < TOLERANCE
