"""Tiny transformers models and JAX rewrites of them with names of their own that
compute layers side by side (attention's q, k, v; a gated MLP's gate and up; two
norms or two heads on one input) in another order than transformers does. Each
rewrite is written once, over one framework's constructors (`hf_common.Layers`:
NNX, Equinox, Linen). Imported by `tests/test_torch_orders.py` only, after it skips
without torch and transformers."""

from types import SimpleNamespace
from typing import Any, NamedTuple

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from .hf_common import (
    Layers,
    attention,
    eqx_call,
    eqx_layers,
    nnx_call,
    nnx_layers,
)
from .llamas import attend, rotary, rotate


D, HEADS, HD, FF, VOCAB, LAYERS = 32, 4, 8, 48, 64, 2
RMS_EPS, LN_EPS, BERT_EPS = 1e-6, 1e-5, 1e-12


# Linen: the layers are made inside the compact call, auto-named in the order the
# rewrite creates them (Dense_0, Dense_1, ...): names that say nothing of their role
LINEN_LAYERS = Layers(
    node=SimpleNamespace,
    seq=list,
    linear=lambda i, o, bias=True: nn.Dense(o, use_bias=bias),
    norm=lambda n, eps: nn.LayerNorm(epsilon=eps),
    embed=lambda n, d: nn.Embed(n, d),
    conv=None,
    array=None,
    call=lambda layer, x: layer(x),
    rms=lambda n, eps: nn.RMSNorm(epsilon=eps),
)


class Rewrite(NamedTuple):
    """A model family's rewrite: `build(layers, order)` makes its layers with
    `Layers`' constructors (in the order it computes them), `forward(net, ids, call,
    order)` runs them on `ids (batch, length)`; `order` says which side-by-side
    layer comes first."""

    build: Any
    forward: Any


def created_computed(order: str) -> tuple[str, str]:
    """`"vkq>qkv"`: layers created in one order, computed in another; `"kqv"`: both."""
    created, _, computed = order.rpartition(">")
    return created or computed, computed


class NNXModel(nnx.Module):
    """A rewrite in NNX: `ids (batch, length)` -> its outputs."""

    def __init__(self, rewrite: Rewrite, order: str):
        created, self.order = created_computed(order)
        self.net = rewrite.build(nnx_layers(), created)
        self.forward = rewrite.forward

    def __call__(self, ids):
        return self.forward(self.net, ids, nnx_call, self.order)


class EqxModel(eqx.Module):
    """A rewrite in Equinox, one sequence: `ids (length,)` -> its outputs."""

    net: Any
    forward: Any = eqx.field(static=True)
    order: str = eqx.field(static=True)

    def __init__(self, rewrite: Rewrite, order: str):
        created, self.order = created_computed(order)
        self.net = rewrite.build(eqx_layers(), created)
        self.forward = rewrite.forward

    def __call__(self, ids):
        out = self.forward(self.net, ids[None], eqx_call, self.order)
        return jax.tree.map(lambda y: y[0], out)


class LinenModel(nn.Module):
    """A rewrite in Linen, its layers auto-named: `ids (batch, length)` -> outputs."""

    rewrite: Rewrite
    order: str

    @nn.compact
    def __call__(self, ids):
        created, computed = created_computed(self.order)
        net = self.rewrite.build(LINEN_LAYERS, created)
        return self.rewrite.forward(net, ids, LINEN_LAYERS.call, computed)


def _hf(transformers, model: str, attn: str, **config):
    """transformers' `model` (a class name) of these sizes and `config`, random
    weights, its attention `attn` ("sdpa" or "eager")."""
    cls = getattr(transformers, model)
    sizes = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF)
    depth = dict(num_hidden_layers=LAYERS, num_attention_heads=HEADS)
    config = dict(max_position_embeddings=64, attn_implementation=attn, **config)
    return cls(cls.config_class(**sizes, **depth, **config))


# --- decoders: what Llama, Qwen3, Phi and NeoX rewrites share -------------------------


_RMS = lambda k: k.rms(D, RMS_EPS)  # noqa: E731
_LN = lambda k: k.norm(D, LN_EPS)  # noqa: E731


def _decoder(layers: Layers, order: str, block, norm, bias: bool):
    """`emb`, `blocks[i]` (`block(layers, order)`), a final norm `norm_f`
    (`norm(layers)`) and the head `head`."""
    return layers.node(
        emb=layers.embed(VOCAB, D),
        blocks=layers.seq([block(layers, order) for _ in range(LAYERS)]),
        norm_f=norm(layers),
        head=layers.linear(D, VOCAB, bias),
    )


def _rotated(y, cos, sin):
    """The first `cos.shape[-1]` features of each head of `y (B, T, H, HD)` rotated
    (transformers' partial rotary), the rest as they are."""
    rot = cos.shape[-1]
    return jnp.concatenate([rotate(y[..., :rot], cos, sin), y[..., rot:]], axis=-1)


def _attention(blk, h, call, order: str, cos, sin, qk_norm: bool = False):
    """Causal attention of `h (B, T, D)` through `blk.wq, wk, wv` computed in
    `order` (q and k normed by `blk.nq, nk` first with `qk_norm`, then rotated),
    out through `blk.wo`."""
    b, t, _ = h.shape
    got = {}
    for c in order[:3]:
        y = call(getattr(blk, f"w{c}"), h).reshape(b, t, -1, HD)
        if c != "v":
            y = _rotated(call(getattr(blk, f"n{c}"), y) if qk_norm else y, cos, sin)
        got[c] = y
    return call(blk.wo, attend(got["q"], got["k"], got["v"]).reshape(b, t, -1))


def _run_decoder(net, ids, call, layer, rot: int = HD):
    """`layer(blk, x, cos, sin)` for each block between `net`'s embedding and head."""
    cos, sin = rotary(ids.shape[1], rot)
    x = call(net.emb, ids)
    for blk in net.blocks:
        x = layer(blk, x, cos, sin)
    return call(net.head, call(net.norm_f, x))


# --- Llama and Qwen3: GQA or not, q/k norms or not; `order` is a permutation of
# "qkv", then "u" (up before gate) or "g" --------------------------------------------


def llama_rewrite(kv: int, qk_norm: bool = False) -> Rewrite:
    def block(layers: Layers, order: str):
        lin = lambda i, o: lambda k: k.linear(i, o, False)  # noqa: E731
        width = {"q": HEADS * HD, "k": kv * HD, "v": kv * HD}
        makers = {"pre_attn": _RMS}
        makers.update({f"w{c}": lin(D, width[c]) for c in order[:3]})
        if qk_norm:  # the norms in the order of their projections
            for c in order[:3].replace("v", ""):
                makers[f"n{c}"] = lambda k: k.rms(HD, RMS_EPS)
        makers["wo"] = lin(HEADS * HD, D)
        makers["pre_ffn"] = _RMS
        ffn = ("w_up", "w_gate") if order[3] == "u" else ("w_gate", "w_up")
        makers.update({n: lin(D, FF) for n in ffn})
        makers["w_down"] = lin(FF, D)
        return layers.node(**{n: m(layers) for n, m in makers.items()})

    def forward(net, ids, call, order):
        def layer(blk, x, cos, sin):
            h = call(blk.pre_attn, x)
            x = x + _attention(blk, h, call, order, cos, sin, qk_norm)
            h = call(blk.pre_ffn, x)
            if order[3] == "u":
                up = call(blk.w_up, h)
                gate = call(blk.w_gate, h)
            else:
                gate = call(blk.w_gate, h)
                up = call(blk.w_up, h)
            return x + call(blk.w_down, jax.nn.silu(gate) * up)

        return _run_decoder(net, ids, call, layer)

    return Rewrite(
        lambda layers, order: _decoder(layers, order, block, _RMS, False), forward
    )


def llama_torch(transformers, kv: int, qk_norm: bool = False, attn: str = "sdpa"):
    """transformers' `LlamaForCausalLM` (`Qwen3ForCausalLM` with `qk_norm`)."""
    model = "Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM"
    sizes = dict(num_key_value_heads=kv, head_dim=HD, tie_word_embeddings=False)
    return _hf(transformers, model, attn, rms_norm_eps=RMS_EPS, **sizes)


# --- Phi: parallel attention and MLP on one norm, partial rotary (half of each head);
# `order` a permutation of "qkv" then "m" (the MLP before the attention) or "a" --------


def phi_rewrite() -> Rewrite:
    def block(layers: Layers, order: str):
        lin = lambda i, o: lambda k: k.linear(i, o, True)  # noqa: E731
        makers = {"norm": _LN}
        mlp = {"w1": lin(D, FF), "w2": lin(FF, D)}
        if order[3] == "m":
            makers.update(mlp)
        makers.update({f"w{c}": lin(D, D) for c in order[:3]})
        makers["wo"] = lin(D, D)
        makers.update(mlp)
        return layers.node(**{n: m(layers) for n, m in makers.items()})

    def forward(net, ids, call, order):
        def layer(blk, x, cos, sin):
            h = call(blk.norm, x)
            mlp = lambda: call(  # noqa: E731
                blk.w2, jax.nn.gelu(call(blk.w1, h), approximate=True)
            )
            if order[3] == "m":
                ff = mlp()
                return _attention(blk, h, call, order, cos, sin) + ff + x
            return _attention(blk, h, call, order, cos, sin) + mlp() + x

        return _run_decoder(net, ids, call, layer, HD // 2)

    return Rewrite(
        lambda layers, order: _decoder(layers, order, block, _LN, True), forward
    )


def phi_torch(transformers, attn: str = "sdpa"):
    rotary = dict(num_key_value_heads=HEADS, partial_rotary_factor=0.5)
    return _hf(transformers, "PhiForCausalLM", attn, layer_norm_eps=LN_EPS, **rotary)


# --- GPT-NeoX: fused per-head qkv, a quarter of each head rotated, parallel residual
# (two LayerNorms read the same input); `order` "m" (the MLP branch first) or "a" ----


def neox_rewrite() -> Rewrite:
    def block(layers: Layers, order: str):
        attn = {
            "ln_a": layers.norm(D, LN_EPS),
            "qkv": layers.linear(D, 3 * D, True),
            "wo": layers.linear(D, D, True),
        }
        mlp = {
            "ln_m": layers.norm(D, LN_EPS),
            "fc_in": layers.linear(D, FF, True),
            "fc_out": layers.linear(FF, D, True),
        }
        return layers.node(**({**mlp, **attn} if order == "m" else {**attn, **mlp}))

    def forward(net, ids, call, order):
        def attention_branch(blk, x, cos, sin):
            b, t, _ = x.shape
            qkv = call(blk.qkv, call(blk.ln_a, x)).reshape(b, t, HEADS, 3, HD)
            q, k = (_rotated(qkv[..., i, :], cos, sin) for i in (0, 1))
            return call(blk.wo, attend(q, k, qkv[..., 2, :]).reshape(b, t, D))

        def mlp_branch(blk, x):
            h = jax.nn.gelu(call(blk.fc_in, call(blk.ln_m, x)), approximate=False)
            return call(blk.fc_out, h)

        def layer(blk, x, cos, sin):
            if order == "m":
                m = mlp_branch(blk, x)
                return m + attention_branch(blk, x, cos, sin) + x
            a = attention_branch(blk, x, cos, sin)
            return mlp_branch(blk, x) + a + x

        return _run_decoder(net, ids, call, layer, HD // 4)

    return Rewrite(
        lambda layers, order: _decoder(layers, order, block, _LN, False), forward
    )


def neox_torch(transformers, attn: str = "sdpa"):
    parallel = dict(rotary_pct=0.25, use_parallel_residual=True)
    model = "GPTNeoXForCausalLM"
    return _hf(transformers, model, attn, layer_norm_eps=LN_EPS, **parallel)


# --- BERT: q, k, v alike (biases, no rotation, no mask); outputs the last hidden
# states and the pooled first token; `order` a permutation of "qkv" ------------------


def bert_rewrite() -> Rewrite:
    def block(layers: Layers, order: str):
        qkv = {f"w{c}": layers.linear(D, D, True) for c in order}
        return layers.node(
            **qkv,
            wo=layers.linear(D, D, True),
            attn_norm=layers.norm(D, BERT_EPS),
            fc_in=layers.linear(D, FF, True),
            fc_out=layers.linear(FF, D, True),
            out_norm=layers.norm(D, BERT_EPS),
        )

    def build(layers: Layers, order: str):
        return layers.node(
            words=layers.embed(VOCAB, D),
            places=layers.embed(64, D),
            segments=layers.embed(2, D),
            emb_norm=layers.norm(D, BERT_EPS),
            blocks=layers.seq([block(layers, order) for _ in range(LAYERS)]),
            pool=layers.linear(D, D, True),
        )

    def forward(net, ids, call, order):
        b, t = ids.shape
        x = call(net.words, ids)
        x = x + call(net.places, jnp.arange(t)[None, :])
        x = call(net.emb_norm, x + call(net.segments, jnp.zeros_like(ids)))
        for blk in net.blocks:
            got = {c: call(getattr(blk, f"w{c}"), x) for c in order}
            ctx = attention(got["q"], got["k"], got["v"], HEADS)
            x = call(blk.attn_norm, call(blk.wo, ctx) + x)
            h = jax.nn.gelu(call(blk.fc_in, x), approximate=False)
            x = call(blk.out_norm, call(blk.fc_out, h) + x)
        return x, jnp.tanh(call(net.pool, x[:, 0]))

    return Rewrite(build, forward)


def bert_torch(transformers, attn: str = "sdpa"):
    """`BertModel`: its positions up to 64, two token types."""
    return _hf(
        transformers, "BertModel", attn, type_vocab_size=2, layer_norm_eps=BERT_EPS
    )


# --- two heads of one shape on one input, both returned; `order` "ab" or "ba" is the
# order the rewrite computes them in; `combine` what is returned -----------------------


COMBINE = {
    "tuple": lambda a, b: (a, b),
    "concat": lambda a, b: jnp.concatenate([a, b], axis=-1),
    "difference": lambda a, b: a - b,
    "product": lambda a, b: jnp.tanh(a) * jnp.tanh(b),  # either pairing is exact
}


def heads_rewrite(combine: str) -> Rewrite:
    def build(layers: Layers, order: str):
        made = {
            {"a": "left", "b": "right"}[c]: layers.linear(8, 4, True) for c in order
        }  # created in the order computed
        return layers.node(trunk=layers.linear(4, 8, True), **made)

    def forward(net, x, call, order):
        h = jnp.tanh(call(net.trunk, x))
        got = {c: call(getattr(net, {"a": "left", "b": "right"}[c]), h) for c in order}
        return COMBINE[combine](got["a"], got["b"])

    return Rewrite(build, forward)


def heads_torch(torch, combine: str):
    """A torch module: a trunk, then two `Linear(8, 4)` heads on its output."""
    together = {
        "tuple": lambda a, b: (a, b),
        "concat": lambda a, b: torch.cat([a, b], dim=-1),
        "difference": lambda a, b: a - b,
        "product": lambda a, b: torch.tanh(a) * torch.tanh(b),
    }[combine]

    class Heads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = torch.nn.Linear(4, 8)
            self.head_a = torch.nn.Linear(8, 4)
            self.head_b = torch.nn.Linear(8, 4)

        def forward(self, x):
            h = torch.tanh(self.trunk(x))
            return together(self.head_a(h), self.head_b(h))

    return Heads()
