"""Codecs: weight-normed `Conv`, `ConvTranspose` and `Dense` layers (kinds
`WeightNormConv`, `WeightNormConvTranspose`, `WeightNormDense`): the weight is
computed as `g * v / ||v||`, the norm taken over every axis where `g` has length 1
(Salimans & Kingma, 2016).

Canonical: `kernel` = `v` in the plain kind's Flax layout (`(*kernel_size, in //
groups, out)`, a `ConvTranspose`'s `(*kernel_size, in, out)` unflipped, or `(in,
out)`), `scale` = `g` with as many axes as `kernel`, in the same order, length 1 on
every normalised axis (PyTorch's `dim=0` on a `Conv`/`Linear`: `(1, ..., 1, out)`;
on a `ConvTranspose`, whose weight is `(in, out, *k)`, it is per input channel:
`(1, ..., in, 1)`; Wav2Vec2's `dim=2` on a `Conv1d`: `(k, 1, 1)`; `dim=None`: all
ones), `bias` `(out,)`. The norm axes are those of `g`'s shape, never assumed: where
a module records them (PyTorch's `dim`, Equinox's `axis`, NNX's `feature_axes`) they
must agree with it.

- PyTorch: a `Conv{1,2,3}d`/`ConvTranspose{1,2,3}d`/`Linear` under
  `torch.nn.utils.parametrizations.weight_norm` (`parametrizations.weight.original0`
  = `g`, `original1` = `v`) or the old `torch.nn.utils.weight_norm` (`weight_g`,
  `weight_v`); `v` in the layer's own layout (`(O, I/groups, *k)`, a transposed
  convolution's `(I, O, *k)` applied flipped, `(out, in)`), `g` of the same rank (a
  scalar for `dim=None`). A `g` that no `dim` gives (shaped like `v`: a norm over
  no axis) is refused, here and in a Flax module holding `weight_g`. Without a
  class (a file), a `ConvTranspose` is read only where its `bias` spans `v`'s
  second axis and not its first.
- Flax (Linen, NNX): a module holding `weight_v`, `weight_g` (and `bias`) used as
  `v * g / ||v||` (transformers' `FlaxConvWithWeightNorm`). Which axes of `v` are the
  kernel's is read from the forward pass on example inputs (`axes`: `v`'s stored
  axes as `(out, in, *spatial)`, `bridge._port._weight_norm.read_axes`); without
  one, PyTorch's order, whose names these are; a `bias` that does not fit it
  leaves the axes unknown, and the layer refused. It is a `ConvTranspose` where
  the pass applies the weight transposed (`hyper["turned"]`: reversed first, as
  `jax.lax.conv_transpose(..., transpose_kernel=True)` does with PyTorch's `(in,
  out, *k)`, or over a stride-dilated input, unreversed, as `nn.ConvTranspose`
  does: `read_axes` changes its kind), a `Conv` otherwise; never a
  `ConvTranspose` without a forward pass.
- Linen: `nn.WeightNorm(layer)` around a `Dense`, `Conv` or `ConvTranspose`: the
  layer's `kernel` (`v`) and `bias` where the layer is, its scale (`g`, the lengths
  of `feature_axes`) in the wrapper's scope (`_weight_norm.linen_weight_norms` makes
  the layer, entry `scale`); the feature axis is the one the scale's length fits,
  else the one the forward pass reshapes it to (`hyper["feature_axes"]`).
- NNX: `nnx.WeightNorm(layer)` around an `nnx.Linear`, `nnx.Conv` or
  `nnx.ConvTranspose` (`layer_instance.kernel` = `v` in Flax's layout, `scales`
  `{('kernel',): g}` holding only the lengths of `feature_axes`, reshaped as
  `nnx.WeightNorm` does). Its `epsilon` (`rsqrt(sum(v**2) + 1e-12)`) is left out.
- Equinox: `eqx.nn.WeightNorm(layer)` around a `Conv`, `ConvTranspose` or `Linear`
  (`layer.weight` = `v`, `g`).

Each layer is also a candidate of the plain kind (`Conv`, `ConvTranspose`, `Dense`)
through a view (`bridge._port._weight_norm`): into a plain layer the weight is `g *
v / ||v||`; from one, `v = w` and `g = ||w||` (a re-parametrisation: the same
function, other arrays).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.numpy as jnp
from flax import nnx

from ..._adapters._skeleton import Skeleton
from .._codec import WRAPPERS, Codec, Leaves, Wrapping, register_codec
from ._conv import (
    _eqx_hyper,
    _eqx_transpose_hyper,
    _nnx_hyper,
    _nnx_transpose_hyper,
    _torch_conv_hyper,
    _torch_conv_transpose_hyper,
)
from ._host import flip, transpose
from ._torch import class_names, module_of


WEIGHT_NORM = {
    "Conv": "WeightNormConv",
    "ConvTranspose": "WeightNormConvTranspose",
    "Dense": "WeightNormDense",
}
"""The weight-normed kind of each plain kind."""

_TORCH_NAMES = (
    ("parametrizations/weight/original0", "parametrizations/weight/original1"),
    ("weight_g", "weight_v"),
)
"""PyTorch's `(g, v)` entries: `parametrizations.weight_norm`, the old hook's."""
_FLAX_NAMES = ("weight_g", "weight_v")

WRAPPERS[nnx.WeightNorm] = "layer_instance"
WRAPPERS[eqx.nn.WeightNorm] = "layer"


def _to_canonical(n: int, transposed: bool = False) -> tuple[int, ...]:
    """The permutation of a weight stored `(out, in, *spatial)` (a PyTorch
    `ConvTranspose`'s `(in, out, *spatial)`: `transposed`) to Flax's `(*spatial,
    in, out)` (`(in, out)` for a Dense weight)."""
    return (*range(2, n), 0, 1) if transposed else (*range(2, n), 1, 0)


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(perm.index(a) for a in range(len(perm)))


def _g_as_v(g: Any, rank: int) -> Any:
    """`g` with as many axes as `v` (a scalar `g` normalises over every axis)."""
    return jnp.reshape(g, (1,) * rank) if g.ndim == 0 and rank else g


def _broadcasts(g: tuple[int, ...], v: tuple[int, ...]) -> bool:
    """Whether `g`'s shape is `v`'s with some axes of length 1 (or a scalar)."""
    return not g or (len(g) == len(v) and all(a in (1, b) for a, b in zip(g, v)))


def _canonical(x: Any, perm: tuple[int, ...], flipped: bool) -> Any:
    """A stored array in the canonical layout: its spatial axes (`2:`) flipped
    first where the layer applies it flipped (PyTorch's `ConvTranspose`)."""
    return transpose(flip(x, tuple(range(2, x.ndim))) if flipped else x, perm)


def _stored(x: Any, perm: tuple[int, ...], flipped: bool) -> Any:
    """`_canonical`'s inverse."""
    y = transpose(x, _inverse(perm))
    return flip(y, tuple(range(2, y.ndim))) if flipped else y


def _decode(
    v: Any, g: Any, bias: Any, perm: tuple[int, ...], flipped: bool = False
) -> Leaves:
    out = {
        "kernel": _canonical(v, perm, flipped),
        "scale": _canonical(_g_as_v(g, v.ndim), perm, flipped),
    }
    if bias is not None:
        out["bias"] = bias
    return out


def _encode(
    canonical: Leaves, perm: tuple[int, ...], g_shape: Any, flipped: bool = False
) -> tuple:
    """`(v, g)` in a stored layout (`perm` from it to canonical), `g` reshaped to
    `g_shape` (a scalar) unless None."""
    v = _stored(canonical["kernel"], perm, flipped)
    g = _stored(canonical["scale"], perm, flipped)
    return v, g if g_shape is None else jnp.reshape(g, g_shape)


def _rank_fits(plain: str, rank: int) -> bool:
    return rank == 2 if plain == "Dense" else 3 <= rank <= 5


# --- PyTorch ----------------------------------------------------------------------

_TORCH_CLASSES = {
    "Conv": ("Conv1d", "Conv2d", "Conv3d"),
    "ConvTranspose": ("ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"),
    "Dense": ("Linear",),
}


def _torch_names(leaves: Leaves) -> tuple[str, str] | None:
    for g, v in _TORCH_NAMES:
        if g in leaves and v in leaves and set(leaves) <= {g, v, "bias"}:
            return g, v
    return None


def _torch_recognise(plain: str):
    def recognise(cls: Any, leaves: Leaves) -> bool:
        names = _torch_names(leaves)
        if names is None:
            return False
        g, v = (tuple(leaves[n].shape) for n in names)
        if not _broadcasts(g, v):
            return False
        bias = leaves.get("bias")
        out = v[1:2] if plain == "ConvTranspose" else v[:1]
        if bias is not None and tuple(bias.shape) != out:
            return False
        if cls is not None and class_names(cls) - {"Module"}:
            return bool(class_names(cls) & set(_TORCH_CLASSES[plain]))
        if plain == "ConvTranspose":  # a file: only where the bias tells
            return bias is not None and v[0] != v[1] and _rank_fits(plain, len(v))
        return _rank_fits(plain, len(v))

    return recognise


def _torch_dim(module: Any) -> int | None:
    """The `dim` a PyTorch module's weight norm keeps (-1: none), or None."""
    for p in getattr(getattr(module, "parametrizations", None), "weight", ()):
        if type(p).__name__ == "_WeightNorm":
            return int(p.dim)
    for hook in getattr(module, "_forward_pre_hooks", {}).values():
        if type(hook).__name__ == "WeightNorm":
            return int(hook.dim)
    return None


def _torch_hyper(plain: str):
    def read(layer: Any) -> dict[str, Any]:
        module = module_of(layer)
        conv = plain != "Dense" and hasattr(module, "kernel_size")  # nn.Conv*d
        if not conv:
            out = {}
        elif plain == "ConvTranspose":
            out = _torch_conv_transpose_hyper(layer)
        else:
            out = _torch_conv_hyper(layer)
        dim = _torch_dim(module)
        if dim is not None:
            out["weight_norm_dim"] = dim
        return out

    return read


_DIM = (
    "its weight norm keeps axis {dim} (the module's `dim`), but `g` has shape "
    "{g} for `v` {v}: the stored arrays do not belong to this module"
)
_NO_DIM = (
    "`{g}` has shape {g_shape} for `{v}` {v_shape}: no axis of PyTorch's weight "
    "norm explains it (its `dim` keeps one axis of `v` and norms the others, `g` "
    "{dim0} for dim=0, or none: a scalar), so `g * v / ||v||` is not defined by "
    "these arrays. Save `g` as torch's weight_norm makes it (`||v||` over every "
    "axis but `dim`, kept as axes of length 1)"
)


def _check_dim(names: tuple[str, str], g: Any, v: Any) -> None:
    """Refuses a `g` whose shape is not one PyTorch's weight norm gives `v`: `v`'s
    with every axis but one (`dim`) of length 1, or all of them (a scalar,
    `dim=None`). A `g` shaped like `v` would norm over no axis at all."""
    if _broadcasts(g.shape, v.shape) and sum(n != 1 for n in g.shape) <= 1:
        return
    raise ValueError(
        _NO_DIM.format(
            g=names[0],
            g_shape=tuple(g.shape),
            v=names[1],
            v_shape=tuple(v.shape),
            dim0=(v.shape[0],) + (1,) * (v.ndim - 1),
        )
    )


_GROUPED_TRANSPOSE = (
    "a grouped ConvTranspose (groups={groups}) has no Flax counterpart (Flax's "
    "ConvTranspose has no feature groups)"
)


def _torch_decoder(plain: str):
    transposed = plain == "ConvTranspose"

    def decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
        names = _torch_names(leaves)
        assert names is not None  # recognised
        g, v = (leaves[n] for n in names)
        if transposed and hyper.get("groups", 1) != 1:
            raise ValueError(_GROUPED_TRANSPOSE.format(groups=hyper["groups"]))
        dim = hyper.get("weight_norm_dim")
        if dim is not None:
            want = (
                ()
                if dim == -1
                else tuple(n if a == dim else 1 for a, n in enumerate(v.shape))
            )
            if tuple(g.shape) != want:
                raise ValueError(
                    _DIM.format(dim=dim, g=tuple(g.shape), v=tuple(v.shape))
                )
        else:
            _check_dim(names, g, v)
        perm = _to_canonical(v.ndim, transposed)
        return _decode(v, g, leaves.get("bias"), perm, transposed)

    return decode


def _torch_encoder(plain: str):
    transposed = plain == "ConvTranspose"

    def encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
        names = _torch_names(like) or _TORCH_NAMES[0]
        rank = canonical["kernel"].ndim
        g_shape = tuple(like[names[0]].shape) if names[0] in like else None
        perm = _to_canonical(rank, transposed)
        v, g = _encode(canonical, perm, g_shape, transposed)
        out = {names[0]: g, names[1]: v}
        if "bias" in canonical and (not like or "bias" in like):
            out["bias"] = canonical["bias"]
        return out

    return encode


# --- Flax (Linen, NNX): weight_v, weight_g, bias; axes from the forward pass -------


def _flax_recognise(plain: str):
    def recognise(cls: Any, leaves: Leaves) -> bool:
        if plain == "ConvTranspose":  # read_axes makes one where the pass tells
            return False
        if not set(_FLAX_NAMES) <= set(leaves) <= {*_FLAX_NAMES, "bias"}:
            return False
        g, v = (tuple(leaves[n].shape) for n in _FLAX_NAMES)
        return _broadcasts(g, v) and _rank_fits(plain, len(v))

    return recognise


def _flax_perm(hyper: dict[str, Any], rank: int) -> tuple[int, ...]:
    """The permutation from `v` as stored to canonical: `hyper["axes"]` are its
    stored axes as `(out, in, *spatial)`, as the forward pass reads them
    (`bridge._port._weight_norm.read_axes`); without a forward pass, PyTorch's
    order, which its names (`weight_v`) are PyTorch's for."""
    axes = hyper.get("axes", tuple(range(rank)))
    return (*axes[2:], axes[1], axes[0])


_BIAS = (
    "`weight_v` {v} read with axes {axes} as (out, in, *spatial), as the forward "
    "pass uses it, has {out} outputs, but `bias` has shape {bias}"
)


def _flax_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    v, g, bias = leaves["weight_v"], leaves["weight_g"], leaves.get("bias")
    _check_dim(_FLAX_NAMES, g, v)
    perm = _flax_perm(hyper, v.ndim)
    if bias is not None and tuple(bias.shape) != (v.shape[perm[-1]],):
        if "axes" not in hyper:  # not PyTorch's order: the forward pass tells
            raise KeyError("axes")
        raise ValueError(
            _BIAS.format(
                v=tuple(v.shape),
                axes=(perm[-1], perm[-2], *perm[:-2]),
                out=v.shape[perm[-1]],
                bias=tuple(bias.shape),
            )
        )
    return _decode(v, g, bias, perm)


def _flax_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    rank = canonical["kernel"].ndim
    g_shape = tuple(like["weight_g"].shape) if "weight_g" in like else None
    v, g = _encode(canonical, _flax_perm(hyper, rank), g_shape)
    out = {"weight_g": g, "weight_v": v}
    if "bias" in like and "bias" in canonical:
        out["bias"] = canonical["bias"]
    return out


def _spatial_flip(x: Any) -> Any:
    """A canonical `(*k, in, out)` array with its kernel axes reversed."""
    return flip(x, tuple(range(x.ndim - 2)))


def _turned_decode(decode: Any) -> Any:
    """A `ConvTranspose`'s `decode`: a module holding `weight_v` is read only as the
    forward pass applies it transposed (`hyper["turned"]`, set by
    `bridge._port._weight_norm.read_axes`: whether it reverses the kernel axes
    first), else its kind stays unknown (a `Conv`'s, whose layout is the same)."""

    def run(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
        if _FLAX_NAMES[1] not in leaves:
            return decode(leaves, hyper)
        if "turned" not in hyper:
            raise KeyError("turned")
        out = decode(leaves, hyper)
        if hyper["turned"]:
            out["kernel"] = _spatial_flip(out["kernel"])
            out["scale"] = _spatial_flip(out["scale"])
        return out

    return run


def _turned_encode(encode: Any) -> Any:
    """`_turned_decode`'s inverse."""

    def run(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
        if _FLAX_NAMES[1] in like and hyper.get("turned"):
            canonical = {
                **canonical,
                "kernel": _spatial_flip(canonical["kernel"]),
                "scale": _spatial_flip(canonical["scale"]),
            }
        return encode(canonical, like, hyper)

    return run


# --- Linen: nn.WeightNorm, its scale in its own scope -------------------------------

LINEN_SCALE = "scale"
"""The entry of a Linen layer wrapped by `nn.WeightNorm` holding the scale, which the
Linen variables keep at `<WeightNorm's path>/<layer name>/kernel/scale`
(`_weight_norm.linen_weight_norms` makes the layer, its scale `Layer.held` there)."""
_LINEN_AXES = (
    "a Linen nn.WeightNorm's scale {scale} for kernel {kernel}: its length fits "
    "several axes, and nothing tells its `feature_axes`"
)


def _linen_feature_axes(kernel: Any, scale: Any, hyper: dict[str, Any]) -> tuple:
    """The kernel axes `g` spans: as the forward pass reshapes the scale
    (`hyper["feature_axes"]`), else the one axis its length fits; a scalar spans
    none."""
    if "feature_axes" in hyper:
        return hyper["feature_axes"]
    if not scale.shape:
        return ()
    fits = [a for a, n in enumerate(kernel.shape) if (n,) == tuple(scale.shape)]
    if len(fits) != 1:
        raise KeyError("feature_axes")  # the forward pass tells (`read_axes`)
    return (fits[0],)


def _linen_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    if "kernel" not in leaves:  # a module holding weight_v, weight_g
        return _flax_decode(leaves, hyper)
    kernel, scale = leaves["kernel"], leaves[LINEN_SCALE]
    if scale.ndim > 1:
        raise ValueError(
            _LINEN_AXES.format(scale=tuple(scale.shape), kernel=tuple(kernel.shape))
        )
    axes = _linen_feature_axes(kernel, scale, hyper)
    shape = tuple(n if a in axes else 1 for a, n in enumerate(kernel.shape))
    out = {"kernel": kernel, "scale": jnp.reshape(scale, shape)}
    if "bias" in leaves:
        out["bias"] = leaves["bias"]
    return out


def _linen_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    if "kernel" not in like:
        return _flax_encode(canonical, like, hyper)
    out = {
        "kernel": canonical["kernel"],
        LINEN_SCALE: jnp.reshape(canonical["scale"], like[LINEN_SCALE].shape),
    }
    if "bias" in like and "bias" in canonical:
        out["bias"] = canonical["bias"]
    return out


# --- NNX: nnx.WeightNorm around a Linear, Conv or ConvTranspose ----------------------

_NNX_CLASSES = {
    "Conv": nnx.Conv,
    "ConvTranspose": nnx.ConvTranspose,
    "Dense": nnx.Linear,
}
_NNX_KERNEL, _NNX_BIAS = "layer_instance/kernel", "layer_instance/bias"
_NNX_SCALE = "scales/('kernel',)"
_NNX_HYPER = {"Conv": _nnx_hyper, "ConvTranspose": _nnx_transpose_hyper}


def _is_nnx_wrapper(cls: Any) -> bool:
    return isinstance(cls, Wrapping) and issubclass(cls.outer, nnx.WeightNorm)


def _wraps(cls: Any, classes: Any) -> bool:
    return isinstance(cls.inner, type) and issubclass(cls.inner, classes)


def _nnx_recognise(plain: str):
    flax = _flax_recognise(plain)

    def recognise(cls: Any, leaves: Leaves) -> bool:
        if not _is_nnx_wrapper(cls):
            return flax(cls, leaves)
        if _wraps(cls, _NNX_CLASSES[plain]):
            return True
        # around another layer: claimed (by one kind) to be refused, naming it
        return plain == "Dense" and not _wraps(cls, tuple(_NNX_CLASSES.values()))

    return recognise


def _nnx_hyper_of(plain: str):
    def read(module: Any) -> dict[str, Any]:
        if not isinstance(module, nnx.WeightNorm):
            return {}
        layer = module.layer_instance
        if not isinstance(layer, _NNX_CLASSES[plain]):
            return {"wrapped": type(layer).__name__}
        out = _NNX_HYPER.get(plain, lambda m: {"use_bias": m.use_bias})(layer)
        axes = module.feature_axes
        axes = () if axes is None else (axes,) if isinstance(axes, int) else axes
        rank = len(getattr(layer, "kernel_size", ())) + 2
        out["feature_axes"] = tuple(sorted({a % rank for a in axes}))
        out["use_scale"] = bool(module.use_scale)
        return out

    return read


_NNX_PARTS = ("layer_instance/", "scales/")
_NNX_WRAPPED = (
    "an nnx.WeightNorm wrapping {cls}: only an nnx.Linear, nnx.Conv or "
    "nnx.ConvTranspose's `kernel` is read"
)
_NNX_ENTRIES = (
    "an nnx.WeightNorm holding {found}: only a weight norm of the wrapped layer's "
    "`kernel` (variable_filter matching `kernel` alone, use_scale=True) is read; "
    "its `scales` are `{{('kernel',): g}}`"
)
_NNX_AXES = (
    "an nnx.WeightNorm with scale {scale} for kernel {kernel}: no single set of "
    "feature axes fits (the module is not at hand to say its `feature_axes`)"
)


def _nnx_feature_axes(leaves: Leaves, hyper: dict[str, Any]) -> tuple[int, ...]:
    """The kernel axes `g` spans: the module's `feature_axes`, else the one axis
    the scale's length fits (a file read without its model)."""
    if "feature_axes" in hyper:
        return hyper["feature_axes"]
    kernel, scale = leaves[_NNX_KERNEL].shape, tuple(leaves[_NNX_SCALE].shape)
    if not scale:
        return ()
    fits = [a for a, n in enumerate(kernel) if (n,) == scale]
    if len(scale) != 1 or len(fits) != 1:
        raise ValueError(_NNX_AXES.format(scale=scale, kernel=tuple(kernel)))
    return (fits[0],)


def _nnx_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    if "wrapped" in hyper:
        raise ValueError(_NNX_WRAPPED.format(cls=hyper["wrapped"]))
    if not any(k.startswith(_NNX_PARTS) for k in leaves):  # weight_v, weight_g
        return _flax_decode(leaves, hyper)
    entries = set(leaves) - {_NNX_BIAS}
    if entries != {_NNX_KERNEL, _NNX_SCALE} or not hyper.get("use_scale", True):
        raise ValueError(_NNX_ENTRIES.format(found=sorted(leaves)))
    kernel, scale = leaves[_NNX_KERNEL], leaves[_NNX_SCALE]
    axes = _nnx_feature_axes(leaves, hyper)
    shape = tuple(n if a in axes else 1 for a, n in enumerate(kernel.shape))
    out = {"kernel": kernel, "scale": jnp.reshape(scale, shape)}
    if _NNX_BIAS in leaves:
        out["bias"] = leaves[_NNX_BIAS]
    return out


def _nnx_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    if _NNX_KERNEL not in like:
        return _flax_encode(canonical, like, hyper)
    out = {
        _NNX_KERNEL: canonical["kernel"],
        _NNX_SCALE: jnp.reshape(canonical["scale"], like[_NNX_SCALE].shape),
    }
    if _NNX_BIAS in like and "bias" in canonical:
        out[_NNX_BIAS] = canonical["bias"]
    return out


# --- Equinox: eqx.nn.WeightNorm around a Conv, ConvTranspose or Linear ---------------

_EQX_CLASSES = {
    "Conv": eqx.nn.Conv,
    "ConvTranspose": eqx.nn.ConvTranspose,
    "Dense": eqx.nn.Linear,
}


def _eqx_recognise(plain: str):
    def recognise(cls: Any, leaves: Leaves) -> bool:
        wrapped = isinstance(cls, Wrapping) and issubclass(cls.outer, eqx.nn.WeightNorm)
        if wrapped and cls.inner is not None:
            if not _wraps(cls, _EQX_CLASSES[plain]):
                return False
        elif wrapped or (isinstance(cls, type) and issubclass(cls, eqx.nn.WeightNorm)):
            if plain == "ConvTranspose":  # the class recorded alone: a Conv
                return False
        else:
            return False
        if (
            not {"layer/weight", "g"}
            <= set(leaves)
            <= {"layer/weight", "layer/bias", "g"}
        ):
            return False
        return _rank_fits(plain, leaves["layer/weight"].ndim)

    return recognise


_EQX_WRAPPED = (
    "an eqx.nn.WeightNorm around a {cls} (weight_name={name!r}): only a Conv, a "
    "ConvTranspose or a Linear's `weight` is read"
)
_EQX_HYPER = {"Conv": _eqx_hyper, "ConvTranspose": _eqx_transpose_hyper}


def _eqx_hyper_of(plain: str):
    def read(module: Any) -> dict[str, Any]:
        layer = module.layer
        # a file read back (a Skeleton): the recorded class already chose the kind
        fits = isinstance(layer, (Skeleton, _EQX_CLASSES[plain]))
        if module.weight_name != "weight" or not fits:
            return {"wrapped": type(layer).__name__, "weight_name": module.weight_name}
        out = _EQX_HYPER[plain](layer) if plain in _EQX_HYPER else {}
        out["weight_norm_axis"] = module.axis
        return out

    return read


def _eqx_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    if "wrapped" in hyper:
        raise ValueError(
            _EQX_WRAPPED.format(cls=hyper["wrapped"], name=hyper["weight_name"])
        )
    v, g = leaves["layer/weight"], leaves["g"]
    bias = leaves.get("layer/bias")
    bias = None if bias is None else jnp.reshape(bias, bias.shape[:1])
    return _decode(v, g, bias, _to_canonical(v.ndim))


def _eqx_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    rank = canonical["kernel"].ndim
    v, g = _encode(canonical, _to_canonical(rank), tuple(like["g"].shape))
    out = {"layer/weight": v, "g": g}
    if "layer/bias" in like and "bias" in canonical:
        out["layer/bias"] = jnp.reshape(canonical["bias"], like["layer/bias"].shape)
    return out


_DEFAULTS = {"bias": 0.0}
_TORCH_LAYOUT = {
    "Conv": "torch OIHW",
    "ConvTranspose": "torch (I,O,*k) flipped",
    "Dense": "torch (out,in)",
}
_EQX_LAYOUT = {"Conv": "OIHW", "ConvTranspose": "OIHW", "Dense": "(out,in)"}


def _register(plain: str) -> tuple[Codec, ...]:
    kind = WEIGHT_NORM[plain]
    turned = plain == "ConvTranspose"
    linen = (_linen_decode, _linen_encode)
    nnx_ = (_nnx_decode, _nnx_encode)
    if turned:
        linen = (_turned_decode(_linen_decode), _turned_encode(_linen_encode))
        nnx_ = (_turned_decode(_nnx_decode), _turned_encode(_nnx_encode))
    return register_codec(
        Codec(
            kind,
            "linen",
            _flax_recognise(plain),
            *linen,
            layout="nn.WeightNorm, or weight_v (out,in,..) as the pass reads it",
            defaults=_DEFAULTS,
        ),
        Codec(
            kind,
            "nnx",
            _nnx_recognise(plain),
            *nnx_,
            _nnx_hyper_of(plain),
            layout="nnx.WeightNorm, or weight_v (out,in,..) as the pass reads it",
            defaults=_DEFAULTS,
        ),
        Codec(
            kind,
            "equinox",
            _eqx_recognise(plain),
            _eqx_decode,
            _eqx_encode,
            _eqx_hyper_of(plain),
            layout=f"WeightNorm, weight {_EQX_LAYOUT[plain]}",
            defaults=_DEFAULTS,
        ),
        Codec(
            kind,
            "torch",
            _torch_recognise(plain),
            _torch_decoder(plain),
            _torch_encoder(plain),
            _torch_hyper(plain),
            layout=f"{_TORCH_LAYOUT[plain]}, weight norm",
            defaults=_DEFAULTS,
        ),
    )


WEIGHT_NORM_CONV = _register("Conv")
WEIGHT_NORM_CONV_TRANSPOSE = _register("ConvTranspose")
WEIGHT_NORM_DENSE = _register("Dense")
