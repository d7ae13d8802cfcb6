"""What the Hugging Face tests share (`tests/test_torch_hf*.py`): containers that name
their children as transformers does, in NNX and Equinox; multi-head attention as
math; the distance of outputs from transformers'; export back to `from_pretrained`.
Imported by those tests only, after they skip without torch and transformers."""

import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bridge


TOL = dict(rtol=1e-4, atol=1e-4)  # float32 through different summation orders


# --- containers named as transformers names its modules -----------------------------


class _Node(nnx.Module):
    def __init__(self, children):
        for name, child in children.items():
            setattr(self, name, child)


def node(**children):
    """An NNX module with these children (a child may be called `self`)."""
    return _Node(children)


def _eqx_class(*fields):
    """An Equinox module with these fields (some may be called `self`)."""

    def init(this, **children):
        for name in fields:
            setattr(this, name, children[name])

    namespace = {"__annotations__": dict.fromkeys(fields, object), "__init__": init}
    return type("EqxNode_" + "_".join(fields), (eqx.Module,), namespace)


_EQX_CLASSES: dict = {}


def eqx_node(**children):
    """An Equinox module with these fields, one class per set of field names."""
    fields = tuple(children)
    if fields not in _EQX_CLASSES:
        _EQX_CLASSES[fields] = _eqx_class(*fields)
    return _EQX_CLASSES[fields](**children)


def over_leading(fn, x):
    """An Equinox layer (one example) over the leading axes of `x` (all but the
    feature axis of a float array; all of an integer array of indices)."""
    for _ in range(x.ndim - (1 if jnp.issubdtype(x.dtype, jnp.inexact) else 0)):
        fn = jax.vmap(fn)
    return fn(x)


def nnx_call(module, x):
    return module(x)


def eqx_call(module, x):
    return over_leading(module, jnp.asarray(x))


class Layers(NamedTuple):
    """One framework's constructors, so that a model is written once for NNX and
    Equinox: `node(**children)`, `seq(list)`, `linear(in, out, bias=True)`,
    `norm(features, eps)` (LayerNorm), `embed(num, features)`, `conv(in, out, kernel,
    stride)` (VALID), `array(shape)` (a loose parameter), `call(layer, x)` over
    leading axes, and `rms(features, eps)` (RMSNorm, where given)."""

    node: Any
    seq: Any
    linear: Any
    norm: Any
    embed: Any
    conv: Any
    array: Any
    call: Any
    rms: Any = None


def nnx_layers() -> Layers:
    rngs = nnx.Rngs(0)
    return Layers(
        node=node,
        seq=nnx.List,
        linear=lambda i, o, bias=True: nnx.Linear(i, o, use_bias=bias, rngs=rngs),
        norm=lambda n, eps: nnx.LayerNorm(n, epsilon=eps, rngs=rngs),
        embed=lambda n, d: nnx.Embed(n, d, rngs=rngs),
        conv=lambda i, o, k, s: nnx.Conv(
            i, o, (k, k), strides=s, padding="VALID", rngs=rngs
        ),
        array=lambda shape: nnx.Param(jax.random.normal(rngs.params(), shape)),
        call=nnx_call,
        rms=lambda n, eps: nnx.RMSNorm(n, epsilon=eps, rngs=rngs),
    )


def eqx_layers() -> Layers:
    keys = iter(jax.random.split(jax.random.key(0), 256))
    return Layers(
        node=eqx_node,
        seq=list,
        linear=lambda i, o, bias=True: eqx.nn.Linear(
            i, o, use_bias=bias, key=next(keys)
        ),
        norm=lambda n, eps: eqx.nn.LayerNorm(n, eps=eps),
        embed=lambda n, d: eqx.nn.Embedding(n, d, key=next(keys)),
        conv=lambda i, o, k, s: eqx.nn.Conv2d(i, o, k, stride=s, key=next(keys)),
        array=lambda shape: jax.random.normal(next(keys), shape),
        call=eqx_call,
        rms=lambda n, eps: eqx.nn.RMSNorm(n, eps=eps, use_bias=False),
    )


# --- the math both frameworks share ---------------------------------------------------


def attention(q, k, v, heads, *, causal=False):
    """Multi-head scaled dot-product attention of projected `q`, `k`, `v`, each
    `(batch, length, heads * head_dim)`, as transformers' eager attention; `causal`
    masks later positions (GPT-2). Returns `(batch, length, heads * head_dim)`."""
    b, n, width = q.shape
    split = lambda y: jnp.reshape(y, (b, n, heads, width // heads))  # noqa: E731
    scores = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k))
    scores = scores / math.sqrt(width // heads)
    if causal:
        mask = jnp.tril(jnp.ones((n, n), bool))
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    ctx = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), split(v))
    return jnp.reshape(ctx, (b, n, width))


# --- comparing with transformers and going back ---------------------------------------


def excess(got, expected) -> float:
    """How far the outputs are beyond `TOL` (`|a - b| - atol - rtol |b|`, the
    largest over every output): <= 0 when all are close. Outputs of another count
    are infinitely far."""
    got, expected = list(got), list(expected)
    if not expected or len(got) != len(expected):
        return float("inf")
    return max(
        float(np.max(np.abs(np.asarray(a) - b) - TOL["atol"] - TOL["rtol"] * np.abs(b)))
        for a, b in zip(got, expected)
    )


def perturb(model, torch):
    """A transformers model's parameters moved away from their initial values (1 for
    LayerNorm scales, 0 for biases), in place; returns it in eval mode."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def export(folder, model, hf, **save_options):
    """`model` saved with `layout="torch"` next to `hf`'s config in `folder`, and read
    back by `from_pretrained` of `hf`'s class."""
    folder.mkdir()
    hf.config.save_pretrained(folder)
    bridge.save_state_dict(folder / "model.safetensors", model, **save_options)
    return type(hf).from_pretrained(folder).eval()
