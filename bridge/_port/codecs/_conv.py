"""Codecs: `Conv` (1-D, 2-D, 3-D, any groups and strides) and `ConvTranspose`
(Flax with `transpose_kernel=False`, the default).

Canonical (Flax): `kernel` shape `(*kernel_size, in // groups, out)` (HWIO), `bias`
shape `(out,)`. Equinox stores `weight` shape `(out, in // groups, *kernel_size)`
(OIHW) and `bias` shape `(out, 1, ..., 1)`. PyTorch: `nn.Conv{1,2,3}d` weight
`(O, I/groups, *k)` (OIHW), bias `(O,)`; `nn.ConvTranspose{1,2,3}d` weight
`(I, O/groups, *k)`, applied flipped: canonical `kernel = flip(weight, k axes)` moved
to `(*k, I, O)` (groups 1 only, as Flax's).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx

from .._codec import Codec, Leaves, of_class, register_codec, same, same_as_like
from ._host import flip, transpose
from ._torch import (
    bias_flag,
    by_class,
    has_entries,
    module_of,
    register_torch,
    shape_of,
)


def _linen_conv(cls, leaves: Leaves) -> bool:
    kernel, bias = leaves.get("kernel"), leaves.get("bias")
    return (
        set(leaves) <= {"kernel", "bias"}
        and kernel is not None
        and 3 <= kernel.ndim <= 5
        and (bias is None or tuple(bias.shape) == kernel.shape[-1:])
    )


def _eqx_decode(leaves: Leaves, hyper) -> Leaves:
    weight = leaves["weight"]
    spatial = tuple(range(2, weight.ndim))
    out = {"kernel": transpose(weight, (*spatial, 1, 0))}
    if "bias" in leaves:
        out["bias"] = jnp.reshape(leaves["bias"], leaves["bias"].shape[:1])
    return out


def _eqx_encode(canonical: Leaves, like: Leaves, hyper) -> Leaves:
    kernel = canonical["kernel"]
    n = kernel.ndim - 2
    out = {"weight": transpose(kernel, (n + 1, n, *range(n)))}
    if "bias" in like:
        out["bias"] = jnp.reshape(canonical["bias"], like["bias"].shape)
    return out


def _tuple(value: Any, n: int) -> tuple[int, ...]:
    if value is None:
        return (1,) * n
    if isinstance(value, int):
        return (value,) * n
    return tuple(value)


def _padding(padding: Any, kernel: tuple[int, ...], dilation, strides) -> Any:
    """Flax and Equinox paddings in one form: `"SAME"` with stride 1 and explicit
    paddings become `((lo, hi), ...)`; other strings stay strings."""
    n = len(kernel)
    if isinstance(padding, str):
        padding = padding.upper()
        if padding == "VALID":
            return ((0, 0),) * n
        if padding == "SAME" and all(s == 1 for s in strides):
            total = [(k - 1) * d for k, d in zip(kernel, dilation)]
            return tuple((t // 2, t - t // 2) for t in total)
        return padding
    if isinstance(padding, int):
        return ((padding, padding),) * n
    return tuple(
        (p, p) if isinstance(p, int) else (int(p[0]), int(p[1])) for p in padding
    )


def _nnx_hyper(module: Any) -> dict[str, Any]:
    kernel = tuple(module.kernel_size)
    n = len(kernel)
    strides = _tuple(module.strides, n)
    dilation = _tuple(module.kernel_dilation, n)
    return {
        "strides": strides,
        "dilation": dilation,
        "groups": getattr(module, "feature_group_count", 1),
        "padding": _padding(module.padding, kernel, dilation, strides),
        "use_bias": module.use_bias,
    }


def _eqx_hyper(module: Any) -> dict[str, Any]:
    kernel = tuple(module.kernel_size)
    return {
        "strides": tuple(module.stride),
        "dilation": tuple(module.dilation),
        "groups": module.groups,
        "padding": _padding(module.padding, kernel, module.dilation, module.stride),
        "use_bias": module.use_bias,
    }


_DEFAULTS = {"bias": 0.0}
_LAYOUT = "weight OIHW, bias (O,1,..)"


def _eqx_conv(cls, leaves: Leaves) -> bool:
    return isinstance(cls, type) and issubclass(cls, eqx.nn.Conv)


def _eqx_args(canonical: Leaves) -> tuple[int, dict[str, Any]]:
    """The number of spatial dimensions, and the arguments of an Equinox convolution
    holding the canonical `kernel` (and `bias`)."""
    kernel = canonical["kernel"]
    *size, n_in, n_out = kernel.shape
    return len(size), dict(
        in_channels=n_in,
        out_channels=n_out,
        kernel_size=tuple(size),
        use_bias="bias" in canonical,
        dtype=kernel.dtype,
        key=jax.random.key(0),
    )


# the classes an Equinox model of 1, 2 or 3 spatial dimensions uses (bridge.save
# records them)
_CONVS = {1: eqx.nn.Conv1d, 2: eqx.nn.Conv2d, 3: eqx.nn.Conv3d}
_CONV_TRANSPOSES = {
    1: eqx.nn.ConvTranspose1d,
    2: eqx.nn.ConvTranspose2d,
    3: eqx.nn.ConvTranspose3d,
}


def _eqx_build_conv(canonical: Leaves, options) -> eqx.nn.Conv:
    n, args = _eqx_args(canonical)
    return _CONVS[n](**args, padding="SAME")


def _eqx_build_transpose(canonical: Leaves, options) -> eqx.nn.ConvTranspose:
    n, args = _eqx_args(canonical)
    return _CONV_TRANSPOSES[n](**args)


CONV_LINEN = register_codec(
    Codec(
        "Conv",
        "linen",
        _linen_conv,
        same,
        same_as_like,
        names=("Conv",),
        defaults=_DEFAULTS,
    )
)
CONV_NNX = register_codec(
    Codec(
        "Conv",
        "nnx",
        of_class(nnx.Conv),
        same,
        same_as_like,
        _nnx_hyper,
        defaults=_DEFAULTS,
    )
)
CONV_EQUINOX = register_codec(
    Codec(
        "Conv",
        "equinox",
        _eqx_conv,
        _eqx_decode,
        _eqx_encode,
        _eqx_hyper,
        layout=_LAYOUT,
        build=_eqx_build_conv,
        defaults=_DEFAULTS,
    )
)


def _nnx_transpose_hyper(module: Any) -> dict[str, Any]:
    n = len(tuple(module.kernel_size))
    return {"strides": _tuple(module.strides, n), "use_bias": module.use_bias}


def _eqx_transpose_hyper(module: Any) -> dict[str, Any]:
    return {"strides": tuple(module.stride), "use_bias": module.use_bias}


# Flax's ConvTranspose (transpose_kernel=False) and Equinox's read the same kernel
# unflipped: the layout change is the Conv one.
CONV_TRANSPOSE_LINEN = register_codec(
    Codec(
        "ConvTranspose",
        "linen",
        _linen_conv,
        same,
        same_as_like,
        names=("ConvTranspose",),
        defaults=_DEFAULTS,
    )
)
CONV_TRANSPOSE_NNX = register_codec(
    Codec(
        "ConvTranspose",
        "nnx",
        of_class(nnx.ConvTranspose),
        same,
        same_as_like,
        _nnx_transpose_hyper,
        defaults=_DEFAULTS,
    )
)
CONV_TRANSPOSE_EQUINOX = register_codec(
    Codec(
        "ConvTranspose",
        "equinox",
        of_class(eqx.nn.ConvTranspose),
        _eqx_decode,
        _eqx_encode,
        _eqx_transpose_hyper,
        layout=_LAYOUT,
        build=_eqx_build_transpose,
        defaults=_DEFAULTS,
    )
)

# --- PyTorch: nn.Conv{1,2,3}d, nn.ConvTranspose{1,2,3}d ------------------------------


@by_class("Conv1d", "Conv2d", "Conv3d", needs=("weight",))
def _torch_conv(leaves: Leaves) -> bool:
    w, b = shape_of(leaves, "weight"), shape_of(leaves, "bias")
    return (
        has_entries(leaves, {"weight"}, {"bias"})
        and w is not None
        and 3 <= len(w) <= 5
        and (b is None or b == w[:1])
    )


@by_class("ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", needs=("weight",))
def _torch_conv_transpose(leaves: Leaves) -> bool:
    w, b = shape_of(leaves, "weight"), shape_of(leaves, "bias")
    return (
        has_entries(leaves, {"weight"}, {"bias"})
        and w is not None
        and 3 <= len(w) <= 5
        and (b is None or b == w[1:2])
    )


def _torch_conv_hyper(layer: Any) -> dict[str, Any]:
    module = module_of(layer)
    if module is None:
        return {}
    kernel = tuple(module.kernel_size)
    strides, dilation = tuple(module.stride), tuple(module.dilation)
    out = {
        "strides": strides,
        "dilation": dilation,
        "groups": module.groups,
        "padding": _padding(module.padding, kernel, dilation, strides),
    }
    if module.padding_mode != "zeros":
        out["padding_mode"] = module.padding_mode
    return bias_flag(layer, out)


def _torch_conv_transpose_hyper(layer: Any) -> dict[str, Any]:
    module = module_of(layer)
    if module is None:
        return {}
    out = {"strides": tuple(module.stride)}
    if module.groups != 1:
        out["groups"] = module.groups
    return bias_flag(layer, out)


def _torch_conv_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    w = leaves["weight"]
    spatial = tuple(range(2, w.ndim))
    out = {"kernel": transpose(w, (*spatial, 1, 0))}
    if "bias" in leaves:
        out["bias"] = leaves["bias"]
    return out


def _torch_conv_encode(
    canonical: Leaves, like: Leaves, hyper: dict[str, Any]
) -> Leaves:
    kernel = canonical["kernel"]
    n = kernel.ndim - 2
    out = {"weight": transpose(kernel, (n + 1, n, *range(n)))}
    if "bias" in canonical and (not like or "bias" in like):
        out["bias"] = canonical["bias"]
    return out


_GROUPED_TRANSPOSE = (
    "a grouped ConvTranspose (groups={groups}) has no Flax counterpart (Flax's "
    "ConvTranspose has no feature groups)"
)


def _torch_conv_transpose_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    if hyper.get("groups", 1) != 1:
        raise ValueError(_GROUPED_TRANSPOSE.format(groups=hyper["groups"]))
    w = leaves["weight"]
    spatial = tuple(range(2, w.ndim))
    flipped = flip(w, spatial)
    out = {"kernel": transpose(flipped, (*spatial, 0, 1))}
    if "bias" in leaves:
        out["bias"] = leaves["bias"]
    return out


def _torch_conv_transpose_encode(
    canonical: Leaves, like: Leaves, hyper: dict[str, Any]
) -> Leaves:
    kernel = canonical["kernel"]
    n = kernel.ndim - 2
    # flipped over the kernel's spatial axes first: a host array is then copied once
    out = {"weight": transpose(flip(kernel, tuple(range(n))), (n, n + 1, *range(n)))}
    if "bias" in canonical and (not like or "bias" in like):
        out["bias"] = canonical["bias"]
    return out


CONV_TORCH = register_torch(
    "Conv",
    _torch_conv,
    _torch_conv_decode,
    _torch_conv_encode,
    _torch_conv_hyper,
    "torch OIHW",
    {"bias": 0.0},
)
CONV_TRANSPOSE_TORCH = register_torch(
    "ConvTranspose",
    _torch_conv_transpose,
    _torch_conv_transpose_decode,
    _torch_conv_transpose_encode,
    _torch_conv_transpose_hyper,
    "torch (I,O,*k) flipped",
    {"bias": 0.0},
)
