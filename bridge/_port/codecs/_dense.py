"""Codecs: `Dense` (Linen `nn.Dense`, NNX `nnx.Linear`, Equinox `eqx.nn.Linear`) and
`DenseGeneral` (Linen `nn.DenseGeneral`, NNX `nnx.LinearGeneral`; Flax only).

Canonical: `kernel` shape `(in, out)`, `bias` shape `(out,)`. Equinox stores
`weight` shape `(out, in)`: a transpose.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx

from .._codec import (
    Codec,
    Leaves,
    attributes,
    of_class,
    register_codec,
    same,
    same_as_like,
)


def _linen_dense(cls, leaves: Leaves) -> bool:
    kernel, bias = leaves.get("kernel"), leaves.get("bias")
    return (
        set(leaves) <= {"kernel", "bias"}
        and kernel is not None
        and kernel.ndim == 2
        and (bias is None or tuple(bias.shape) == kernel.shape[1:])
    )


def _linen_dense_general(cls, leaves: Leaves) -> bool:
    kernel, bias = leaves.get("kernel"), leaves.get("bias")
    return (
        set(leaves) <= {"kernel", "bias"}
        and kernel is not None
        and kernel.ndim >= 2
        and (
            bias is None
            or (
                0 < bias.ndim < kernel.ndim and kernel.shape[-bias.ndim :] == bias.shape
            )
        )
    )


def _eqx_decode(leaves: Leaves, hyper) -> Leaves:
    out = {"kernel": jnp.transpose(leaves["weight"])}
    if "bias" in leaves:
        out["bias"] = leaves["bias"]
    return out


def _eqx_encode(canonical: Leaves, like: Leaves, hyper) -> Leaves:
    out = {"weight": jnp.transpose(canonical["kernel"])}
    if "bias" in like:
        out["bias"] = canonical["bias"]
    return out


_DEFAULTS = {"bias": 0.0}
_USE_BIAS = attributes(use_bias="use_bias")


def _eqx_build(canonical: Leaves, options) -> eqx.nn.Linear:
    kernel = canonical["kernel"]
    n_in, n_out = kernel.shape
    use_bias = "bias" in canonical
    return eqx.nn.Linear(
        n_in, n_out, use_bias=use_bias, dtype=kernel.dtype, key=jax.random.key(0)
    )


DENSE_LINEN = register_codec(
    Codec(
        "Dense",
        "linen",
        _linen_dense,
        same,
        same_as_like,
        names=("Dense",),
        defaults=_DEFAULTS,
    )
)
DENSE_NNX = register_codec(
    Codec(
        "Dense",
        "nnx",
        of_class(nnx.Linear),
        same,
        same_as_like,
        _USE_BIAS,
        defaults=_DEFAULTS,
    )
)
DENSE_EQUINOX = register_codec(
    Codec(
        "Dense",
        "equinox",
        of_class(eqx.nn.Linear),
        _eqx_decode,
        _eqx_encode,
        _USE_BIAS,
        layout="weight (out,in)",
        build=_eqx_build,
        defaults=_DEFAULTS,
    )
)
DENSE_GENERAL_LINEN = register_codec(
    Codec(
        "DenseGeneral",
        "linen",
        _linen_dense_general,
        same,
        same_as_like,
        names=("DenseGeneral",),
        defaults=_DEFAULTS,
    )
)
DENSE_GENERAL_NNX = register_codec(
    Codec(
        "DenseGeneral",
        "nnx",
        of_class(nnx.LinearGeneral),
        same,
        same_as_like,
        _USE_BIAS,
        defaults=_DEFAULTS,
    )
)
