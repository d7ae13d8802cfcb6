"""Codecs: `Dense` (Linen `nn.Dense`, NNX `nnx.Linear`, Equinox `eqx.nn.Linear`) and
`DenseGeneral` (Linen `nn.DenseGeneral`, NNX `nnx.LinearGeneral`; Flax only).

Canonical: `kernel` shape `(in, out)`, `bias` shape `(out,)`. Equinox stores
`weight` shape `(out, in)`: a transpose. PyTorch (framework `"torch"`, kit in
`_torch.py`): `nn.Linear` weight `(out, in)` (transposed); Hugging Face's `Conv1D`
weight `(in, out)` (canonical already), told by its class, else by its name
(`_families/_gpt2.py`), else by the bias's shape.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
from flax import nnx

from ..._families._gpt2 import CONV1D_CLASS, CONV1D_NAMES
from .._codec import (
    Codec,
    Leaves,
    attributes,
    of_class,
    register_codec,
    same,
    same_as_like,
)
from ._host import transpose
from ._torch import (
    bias_flag,
    by_class,
    class_names,
    has_entries,
    register_torch,
    shape_of,
)


def _linen_dense(cls, leaves: Leaves) -> bool:
    kernel, bias = leaves.get("kernel"), leaves.get("bias")
    return (
        set(leaves) <= {"kernel", "bias"}
        and kernel is not None
        and kernel.ndim == 2
        and (bias is None or tuple(bias.shape) == kernel.shape[1:] or by_bias(leaves))
    )


def by_bias(leaves: Leaves) -> bool:
    """Whether a Linen kernel is read `(out, in)` by its bias alone: the kernel is
    not square and the bias spans its first axis, not its last (transformers'
    `FlaxConv1D`). Only a whole layer's arrays tell so: a stack's slice along
    another axis looks the same (a stack of Dense kernels `(L, in, out)` and biases
    `(L, out)`, sliced at axis 1), so `_find` takes no such reading for a stack's
    layer axis."""
    kernel, bias = leaves.get("kernel"), leaves.get("bias")
    return (
        kernel is not None
        and bias is not None
        and kernel.ndim == 2
        and kernel.shape[0] != kernel.shape[1]
        and tuple(bias.shape) == kernel.shape[:1]
    )


def _out_in(leaves: Leaves, hyper: dict[str, Any]) -> bool:
    """Whether a Linen kernel is stored `(out, in)`, as transformers' `FlaxConv1D`
    holds it: told by the forward pass (`hyper["out_in"]`, set by
    `_port/_computed.py` from the axis the product contracts), else by a bias of
    `out` where the kernel is not square (`by_bias`). `hyper["out_in"]` is None
    (`open_square`) for a square kernel of a model that stores others `(out, in)`:
    a setting nothing gave (`KeyError`, see `_errors.SETTINGS`), never a guess."""
    if "out_in" not in hyper:
        return by_bias(leaves)
    told = hyper["out_in"]
    if told is None:
        raise KeyError("out_in")
    return bool(told)


def reads_out_in(leaves: Leaves, hyper: dict[str, Any]) -> bool:
    """Whether the Linen `Dense` codec reads these arrays `(out, in)` (for the
    plan's words; a setting left open reads neither way: False)."""
    try:
        return _out_in(leaves, hyper)
    except KeyError:
        return False


def open_square(layers: list[Any]) -> list[Any]:
    """Where a Linen model holds a kernel read `(out, in)` by its bias
    (`by_bias`), its other square kernels read by the Linen `Dense` codec under
    names its author chose (not an `nn.Dense`'s auto-name `Dense_0`) may be stored
    either way: their `out_in` setting is left open (None) for the forward pass to
    tell (`_port/_computed.py`), else refused. `layers`: one model's
    (`_layer.Layer`s); returns those left open."""
    linen = [x for x in layers if DENSE_LINEN in x.codecs]
    if not any(by_bias(x.leaves) for x in linen):
        return []
    out = []
    for x in linen:
        kernel = x.leaves["kernel"]
        name = str(x.path[-1]) if x.path else ""
        square = kernel.shape[0] == kernel.shape[1]
        if square and "out_in" not in x.hyper and not name.startswith("Dense_"):
            x.hyper["out_in"] = None
            out.append(x)
    return out


def _linen_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    if not _out_in(leaves, hyper):
        return leaves
    return {**leaves, "kernel": transpose(leaves["kernel"])}


def _linen_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    out = same_as_like(canonical, like, hyper)
    if like and "kernel" in like and _out_in(like, hyper):
        out["kernel"] = transpose(canonical["kernel"])
    return out


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
    out = {"kernel": transpose(leaves["weight"])}
    if "bias" in leaves:
        out["bias"] = leaves["bias"]
    return out


def _eqx_encode(canonical: Leaves, like: Leaves, hyper) -> Leaves:
    out = {"weight": transpose(canonical["kernel"])}
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
        _linen_decode,
        _linen_encode,
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

# --- PyTorch: nn.Linear and Hugging Face Conv1D --------------------------------------


@by_class("Linear", CONV1D_CLASS, needs=("weight",))
def _torch_dense(leaves: Leaves) -> bool:
    w, b = shape_of(leaves, "weight"), shape_of(leaves, "bias")
    return (
        has_entries(leaves, {"weight"}, {"bias"})
        and w is not None
        and len(w) == 2
        and (b is None or b in ((w[0],), (w[1],)))
    )


def _torch_hyper(layer: Any) -> dict[str, Any]:
    """`conv1d`: True for GPT-2's `Conv1D` (weight `(in, out)`), False for an
    `nn.Linear`, by the class; None where only a name speaks (a state dict, a file
    of no known family) and the name is one of GPT-2's `Conv1D` names."""
    cls = getattr(layer, "cls", None)
    name = getattr(layer, "name", "")
    if cls is not None:
        conv1d = CONV1D_CLASS in class_names(cls)
    else:
        conv1d = None if name.rsplit(".", 1)[-1] in CONV1D_NAMES else False
    return bias_flag(layer, {"conv1d": conv1d})


def _is_conv1d(leaves: Leaves, hyper: dict[str, Any]) -> bool:
    """`Conv1D` when the class says so, or when only its layout fits the bias; a
    name alone decides a weight that is not square, never a square one."""
    w, b = shape_of(leaves, "weight"), shape_of(leaves, "bias")
    assert w is not None
    if b is not None and w[0] != w[1]:
        return b == (w[1],)
    conv1d = hyper.get("conv1d", False)  # absent: read as another kind first
    if conv1d is None and w[0] == w[1]:  # a setting nothing gave: see SETTING
        raise KeyError("conv1d")
    return conv1d is not False


def _torch_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    w = leaves["weight"]
    out = {"kernel": w if _is_conv1d(leaves, hyper) else transpose(w)}
    if "bias" in leaves:
        out["bias"] = leaves["bias"]
    return out


def _torch_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    kernel = canonical["kernel"]
    if like:
        conv1d = _is_conv1d(like, hyper)
    else:  # written with no model to follow: the class, else the name's family
        shape = tuple(kernel.shape)
        conv1d = _is_conv1d(
            {"weight": jax.ShapeDtypeStruct(shape, kernel.dtype)}, hyper
        )
    out = {"weight": kernel if conv1d else transpose(kernel)}
    if "bias" in canonical and (not like or "bias" in like):
        out["bias"] = canonical["bias"]
    return out


DENSE_TORCH = register_torch(
    "Dense",
    _torch_dense,
    _torch_decode,
    _torch_encode,
    _torch_hyper,
    "torch weight (out,in) or Conv1D (in,out)",
    {"bias": 0.0},
)
