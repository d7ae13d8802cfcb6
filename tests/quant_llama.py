"""A tiny Llama in NNX or Equinox (the quantized-checkpoint tests' model), named either
as transformers' `LlamaForCausalLM` names it (`model.layers.0.self_attn.q_proj`) or as
llama.cpp's GGUF files do (`blk.0.attn_q`), with the rotary embedding of that naming
(transformers rotates the two halves of each head; llama.cpp's converter permutes
q/k rows so that adjacent pairs rotate)."""

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .hf_common import Layers, eqx_call, eqx_node, nnx_call, node


class Config(NamedTuple):
    vocab: int = 64
    dim: int = 256
    hidden: int = 384
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    eps: float = 1e-6
    theta: float = 10000.0

    def hf(self, transformers, **extra):
        return transformers.LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.dim,
            intermediate_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            rms_norm_eps=self.eps,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            **extra,
        )


HF = {
    "embed": "model.embed_tokens",
    "layers": "model.layers",
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "norm1": "input_layernorm",
    "norm2": "post_attention_layernorm",
    "norm": "model.norm",
    "head": "lm_head",
}
GGUF = {
    "embed": "token_embd",
    "layers": "blk",
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
    "norm1": "attn_norm",
    "norm2": "ffn_norm",
    "norm": "output_norm",
    "head": "output",
}


def nnx_layers(dtype=jnp.float32) -> Layers:
    """NNX constructors: biasless linears, RMS norms, parameters of `dtype`."""
    rngs = nnx.Rngs(0)
    kw = dict(param_dtype=dtype, dtype=dtype, rngs=rngs)
    return Layers(
        node=node,
        seq=nnx.List,
        linear=lambda i, o: nnx.Linear(i, o, use_bias=False, **kw),
        norm=lambda n, eps: nnx.RMSNorm(n, epsilon=eps, **kw),
        embed=lambda n, d: nnx.Embed(n, d, **kw),
        conv=None,
        array=None,
        call=nnx_call,
    )


def eqx_layers() -> Layers:
    """Equinox constructors: biasless linears, RMS norms (float32)."""
    keys = iter(jax.random.split(jax.random.key(0), 256))
    return Layers(
        node=eqx_node,
        seq=list,
        linear=lambda i, o: eqx.nn.Linear(i, o, use_bias=False, key=next(keys)),
        norm=lambda n, eps: eqx.nn.RMSNorm(n, eps=eps, use_bias=False),
        embed=lambda n, d: eqx.nn.Embedding(n, d, key=next(keys)),
        conv=None,
        array=None,
        call=eqx_call,
    )


def _nest(layers: Layers, flat: dict):
    """Containers from `{dotted name: layer}`."""
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, last = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value

    def build(d):
        if not isinstance(d, dict):
            return d
        return layers.node(**{k: build(v) for k, v in d.items()})

    return build(tree)


def _get(model, dotted: str):
    for part in dotted.split("."):
        model = getattr(model, part)
    return model


def make(layers: Layers, names: dict, c: Config = Config()):
    """A Llama with `layers`' constructors (nnx_layers()/eqx_layers() with biasless
    linears and RMS norms: `linear(in, out)` and `rms(features, eps)`)."""
    head_dim = c.dim // c.heads
    blocks = []
    for _ in range(c.layers):
        block = {
            names["q"]: layers.linear(c.dim, c.heads * head_dim),
            names["k"]: layers.linear(c.dim, c.kv_heads * head_dim),
            names["v"]: layers.linear(c.dim, c.kv_heads * head_dim),
            names["o"]: layers.linear(c.heads * head_dim, c.dim),
            names["gate"]: layers.linear(c.dim, c.hidden),
            names["up"]: layers.linear(c.dim, c.hidden),
            names["down"]: layers.linear(c.hidden, c.dim),
            names["norm1"]: layers.norm(c.dim, c.eps),
            names["norm2"]: layers.norm(c.dim, c.eps),
        }
        blocks.append(_nest(layers, block))
    flat = {
        names["embed"]: layers.embed(c.vocab, c.dim),
        names["layers"]: layers.seq(blocks),
        names["norm"]: layers.norm(c.dim, c.eps),
        names["head"]: layers.linear(c.dim, c.vocab),
    }
    return _nest(layers, flat)


def _rotary(x, theta, interleaved):
    """`x` `(batch, length, heads, head_dim)` rotated by position."""
    n, d = x.shape[1], x.shape[-1]
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    angles = np.arange(n, dtype=np.float32)[:, None] * inv[None]  # (n, d/2)
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    if interleaved:  # pairs (2i, 2i + 1)
        a, b = x[..., 0::2], x[..., 1::2]
        return jnp.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(x.shape)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def forward(layers: Layers, names: dict, model, tokens, c: Config = Config()):
    """Logits `(batch, length, vocab)` of `tokens` `(batch, length)`."""
    call = layers.call
    interleaved = names is GGUF
    head_dim = c.dim // c.heads
    x = call(_get(model, names["embed"]), tokens)
    b, n, _ = x.shape
    mask = jnp.tril(jnp.ones((n, n), bool))
    for block in _get(model, names["layers"]):
        h = call(_get(block, names["norm1"]), x)
        q = call(_get(block, names["q"]), h).reshape(b, n, c.heads, head_dim)
        k = call(_get(block, names["k"]), h).reshape(b, n, c.kv_heads, head_dim)
        v = call(_get(block, names["v"]), h).reshape(b, n, c.kv_heads, head_dim)
        q, k = _rotary(q, c.theta, interleaved), _rotary(k, c.theta, interleaved)
        k = jnp.repeat(k, c.heads // c.kv_heads, axis=2)
        v = jnp.repeat(v, c.heads // c.kv_heads, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        x = x + call(_get(block, names["o"]), ctx.reshape(b, n, c.heads * head_dim))
        h = call(_get(block, names["norm2"]), x)
        gate = jax.nn.silu(call(_get(block, names["gate"]), h))
        x = x + call(
            _get(block, names["down"]), gate * call(_get(block, names["up"]), h)
        )
    x = call(_get(model, names["norm"]), x)
    return call(_get(model, names["head"]), x)
