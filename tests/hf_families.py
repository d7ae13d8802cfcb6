"""Tiny decoder-only language models of the Hugging Face families beyond Llama
(Qwen2, Qwen3, Mistral, Phi-3, Gemma), each written in NNX (one module
per layer, an `nnx.List`) and in Equinox (the layers one `eqx.filter_vmap` stack,
run with `lax.scan`), with transformers' names, computing what transformers'
modeling files compute; and the matching transformers models (random weights, no
download). Imported by `tests/test_torch_hf_families.py` only, after it skips
without torch and transformers."""

import functools
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx

from .hf_common import over_leading
from .llamas import attend, rotary, rotate


# rope_theta is transformers' default, 10000, as llamas.THETA
D, HEADS, KV, HEAD_DIM, FF, VOCAB, LAYERS, EPS = 32, 4, 2, 8, 48, 96, 2, 1e-6


class Family(NamedTuple):
    """What a family computes beyond Llama, and its transformers classes."""

    config: str
    lm: str
    bias: bool = False  # q_proj, k_proj, v_proj with biases (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head of q and k (Qwen3)
    fused: bool = False  # qkv_proj and gate_up_proj, each one nn.Linear (Phi-3)
    gemma: bool = False  # x * (1 + scale) norms, embedding tied and scaled, GELU


FAMILIES = {
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", bias=True),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", qk_norm=True),
    "mistral": Family("MistralConfig", "MistralForCausalLM"),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", fused=True),
}
GEMMA = Family("GemmaConfig", "GemmaForCausalLM", gemma=True)


def hf_model(family: Family, torch, transformers):
    """The family's transformers model, its parameters moved away from their initial
    values (norm scales 1, biases 0) so that a misplaced one shows in the logits."""
    config = getattr(transformers, family.config)(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=FF,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HEAD_DIM,
        rms_norm_eps=EPS,
        max_position_embeddings=64,
        tie_word_embeddings=family.gemma,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = getattr(transformers, family.lm)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _split_qkv(qkv):
    return jnp.split(qkv, [HEADS * HEAD_DIM, (HEADS + KV) * HEAD_DIM], axis=-1)


def _heads(q, k, v):
    """`(..., T, width)` -> `(1, T, heads, head_dim)`, as `attend` takes them."""
    t = q.shape[-2]
    return (
        q.reshape(-1, t, HEADS, HEAD_DIM),
        k.reshape(-1, t, KV, HEAD_DIM),
        v.reshape(-1, t, KV, HEAD_DIM),
    )


class GemmaNorm(nnx.Module):
    """Gemma's RMSNorm, as Google's JAX Gemma writes it: `x * (1 + scale)`, `scale`
    starting at 0 (not Flax's RMSNorm)."""

    def __init__(self, features: int):
        self.scale = nnx.Param(jnp.zeros(features))

    def __call__(self, x):
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)
        return x * (1 + self.scale[...]).reshape((1,) * (x.ndim - 1) + (-1,))


def _norm(family: Family, features: int, rngs: nnx.Rngs):
    if family.gemma:
        return GemmaNorm(features)
    return nnx.RMSNorm(features, epsilon=EPS, rngs=rngs)


# --- NNX: one module per layer --------------------------------------------------------


class Attention(nnx.Module):
    def __init__(self, family: Family, rngs: nnx.Rngs):
        def linear(i, o, bias=False):
            return nnx.Linear(i, o, use_bias=bias, rngs=rngs)

        self.family = family
        if family.fused:
            self.qkv_proj = linear(D, (HEADS + 2 * KV) * HEAD_DIM)
        else:
            self.q_proj = linear(D, HEADS * HEAD_DIM, family.bias)
            self.k_proj = linear(D, KV * HEAD_DIM, family.bias)
            self.v_proj = linear(D, KV * HEAD_DIM, family.bias)
        self.o_proj = linear(HEADS * HEAD_DIM, D)
        if family.qk_norm:
            self.q_norm = _norm(family, HEAD_DIM, rngs)
            self.k_norm = _norm(family, HEAD_DIM, rngs)

    def __call__(self, x, cos, sin):
        b, t, _ = x.shape
        if self.family.fused:
            q, k, v = _split_qkv(self.qkv_proj(x))
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = _heads(q, k, v)
        if self.family.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = attend(rotate(q, cos, sin), rotate(k, cos, sin), v)
        return self.o_proj(out.reshape(b, t, HEADS * HEAD_DIM))


class MLP(nnx.Module):
    def __init__(self, family: Family, rngs: nnx.Rngs):
        def linear(i, o):
            return nnx.Linear(i, o, use_bias=False, rngs=rngs)

        self.family = family
        if family.fused:
            self.gate_up_proj = linear(D, 2 * FF)
        else:
            self.gate_proj, self.up_proj = linear(D, FF), linear(D, FF)
        self.down_proj = linear(FF, D)

    def __call__(self, x):
        if self.family.fused:
            gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(_act(self.family)(gate) * up)


class DecoderLayer(nnx.Module):
    def __init__(self, family: Family, rngs: nnx.Rngs):
        self.self_attn = Attention(family, rngs)
        self.mlp = MLP(family, rngs)
        self.input_layernorm = _norm(family, D, rngs)
        self.post_attention_layernorm = _norm(family, D, rngs)

    def __call__(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nnx.Module):
    def __init__(self, family: Family, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(VOCAB, D, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(family, rngs) for _ in range(LAYERS)])
        self.norm = _norm(family, D, rngs)


class CausalLM(nnx.Module):
    """`model.layers[i].self_attn.q_proj`, ..., `lm_head`: transformers' names.
    `ids (batch, length)` -> logits `(batch, length, VOCAB)`. Gemma: the embedding
    scaled by `sqrt(D)` and tied (its `attend` gives the logits), no `lm_head`."""

    def __init__(self, family: Family, rngs: nnx.Rngs):
        self.family = family
        self.model = Decoder(family, rngs)
        if not family.gemma:
            self.lm_head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        cos, sin = rotary(ids.shape[1], HEAD_DIM)
        x = self.model.embed_tokens(ids)
        if self.family.gemma:
            x = x * jnp.asarray(D**0.5, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        if self.family.gemma:
            return self.model.embed_tokens.attend(x)
        return self.lm_head(x)


# --- Equinox: the layers one stack, run with lax.scan ---------------------------------


def _apply(layer, x):
    return over_leading(layer, x)


class EqxGemmaNorm(eqx.Module):
    """`GemmaNorm` in Equinox, one vector: `x * (1 + scale)`."""

    scale: jax.Array

    def __init__(self, features: int):
        self.scale = jnp.zeros(features)

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x) + EPS) * (1 + self.scale)


def _eqx_norm(family: Family, features: int):
    if family.gemma:
        return EqxGemmaNorm(features)
    return eqx.nn.RMSNorm(features, eps=EPS, use_bias=False)


def _act(family: Family):
    if family.gemma:  # transformers' gelu_pytorch_tanh
        return functools.partial(jax.nn.gelu, approximate=True)
    return jax.nn.silu


class EqxAttention(eqx.Module):
    q_proj: eqx.nn.Linear | None
    k_proj: eqx.nn.Linear | None
    v_proj: eqx.nn.Linear | None
    qkv_proj: eqx.nn.Linear | None
    o_proj: eqx.nn.Linear
    q_norm: eqx.Module | None
    k_norm: eqx.Module | None

    def __init__(self, family: Family, key):
        keys = iter(jax.random.split(key, 5))

        def linear(i, o, bias=False):
            return eqx.nn.Linear(i, o, use_bias=bias, key=next(keys))

        self.q_proj = self.k_proj = self.v_proj = self.qkv_proj = None
        if family.fused:
            self.qkv_proj = linear(D, (HEADS + 2 * KV) * HEAD_DIM)
        else:
            self.q_proj = linear(D, HEADS * HEAD_DIM, family.bias)
            self.k_proj = linear(D, KV * HEAD_DIM, family.bias)
            self.v_proj = linear(D, KV * HEAD_DIM, family.bias)
        self.o_proj = linear(HEADS * HEAD_DIM, D)
        self.q_norm = self.k_norm = None
        if family.qk_norm:
            self.q_norm = _eqx_norm(family, HEAD_DIM)
            self.k_norm = _eqx_norm(family, HEAD_DIM)

    def __call__(self, x, cos, sin):  # x: (T, D)
        if self.qkv_proj is not None:
            q, k, v = _split_qkv(_apply(self.qkv_proj, x))
        else:
            q, k, v = (_apply(p, x) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = _heads(q, k, v)
        if self.q_norm is not None:
            q, k = _apply(self.q_norm, q), _apply(self.k_norm, k)
        out = attend(rotate(q, cos, sin), rotate(k, cos, sin), v)
        return _apply(self.o_proj, out.reshape(x.shape[0], HEADS * HEAD_DIM))


class EqxMLP(eqx.Module):
    gate_proj: eqx.nn.Linear | None
    up_proj: eqx.nn.Linear | None
    gate_up_proj: eqx.nn.Linear | None
    down_proj: eqx.nn.Linear
    family: Family = eqx.field(static=True)

    def __init__(self, family: Family, key):
        self.family = family
        keys = iter(jax.random.split(key, 3))

        def linear(i, o):
            return eqx.nn.Linear(i, o, use_bias=False, key=next(keys))

        self.gate_proj = self.up_proj = self.gate_up_proj = None
        if family.fused:
            self.gate_up_proj = linear(D, 2 * FF)
        else:
            self.gate_proj, self.up_proj = linear(D, FF), linear(D, FF)
        self.down_proj = linear(FF, D)

    def __call__(self, x):
        if self.gate_up_proj is not None:
            gate, up = jnp.split(_apply(self.gate_up_proj, x), 2, axis=-1)
        else:
            gate, up = _apply(self.gate_proj, x), _apply(self.up_proj, x)
        return _apply(self.down_proj, _act(self.family)(gate) * up)


class EqxDecoderLayer(eqx.Module):
    self_attn: EqxAttention
    mlp: EqxMLP
    input_layernorm: eqx.Module
    post_attention_layernorm: eqx.Module

    def __init__(self, family: Family, key):
        k1, k2 = jax.random.split(key)
        self.self_attn, self.mlp = EqxAttention(family, k1), EqxMLP(family, k2)
        self.input_layernorm = _eqx_norm(family, D)
        self.post_attention_layernorm = _eqx_norm(family, D)

    def __call__(self, x, cos, sin):
        x = x + self.self_attn(_apply(self.input_layernorm, x), cos, sin)
        return x + self.mlp(_apply(self.post_attention_layernorm, x))


class EqxDecoder(eqx.Module):
    embed_tokens: eqx.nn.Embedding
    layers: EqxDecoderLayer  # a stack: every array has a leading layer axis
    norm: eqx.Module

    def __init__(self, family: Family, key):
        k1, k2 = jax.random.split(key)
        self.embed_tokens = eqx.nn.Embedding(VOCAB, D, key=k1)
        make = eqx.filter_vmap(lambda k: EqxDecoderLayer(family, k))
        self.layers = make(jax.random.split(k2, LAYERS))
        self.norm = _eqx_norm(family, D)


class EqxCausalLM(eqx.Module):
    """The NNX `CausalLM` in Equinox, one sequence: `ids (length,)` -> logits
    `(length, VOCAB)`."""

    model: EqxDecoder
    lm_head: eqx.nn.Linear | None  # Gemma: none, the embedding gives the logits
    gemma: bool = eqx.field(static=True)

    def __init__(self, family: Family, key):
        k1, k2 = jax.random.split(key)
        self.gemma = family.gemma
        self.model = EqxDecoder(family, k1)
        self.lm_head = None
        if not family.gemma:
            self.lm_head = eqx.nn.Linear(D, VOCAB, use_bias=False, key=k2)

    def __call__(self, ids):
        cos, sin = rotary(ids.shape[0], HEAD_DIM)
        layers, static = eqx.partition(self.model.layers, eqx.is_array)

        def step(x, layer):
            return eqx.combine(layer, static)(x, cos, sin), None

        x = _apply(self.model.embed_tokens, ids)
        if self.gemma:
            x = x * jnp.asarray(D**0.5, x.dtype)
        x, _ = jax.lax.scan(step, x, layers)
        x = _apply(self.model.norm, x)
        if self.lm_head is None:
            return x @ self.model.embed_tokens.weight.T
        return _apply(self.lm_head, x)
