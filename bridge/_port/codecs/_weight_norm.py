"""Codecs: weight-normed `Conv` and `Dense` layers (kinds `WeightNormConv`,
`WeightNormDense`): the weight is computed as `g * v / ||v||`, the norm taken over
every axis where `g` has length 1 (Salimans & Kingma, 2016).

Canonical: `kernel` = `v` in the plain kind's Flax layout (`(*kernel_size, in //
groups, out)`, or `(in, out)`), `scale` = `g` with as many axes as `kernel`, in the
same order, length 1 on every normalised axis (PyTorch's `dim=0`: `(1, ..., 1, out)`;
Wav2Vec2's `dim=2` on a `Conv1d`: `(k, 1, 1)`; `dim=None`: all ones), `bias` `(out,)`.
The norm axes are those of `g`'s shape, never assumed: where a module records them
(PyTorch's `dim`, Equinox's `axis`) they must agree with it.

- PyTorch: a `Conv{1,2,3}d`/`Linear` under `torch.nn.utils.parametrizations.weight_norm`
  (`parametrizations.weight.original0` = `g`, `original1` = `v`) or the old
  `torch.nn.utils.weight_norm` (`weight_g`, `weight_v`); `v` in the layer's own layout
  (`(O, I/groups, *k)`, `(out, in)`), `g` of the same rank (a scalar for `dim=None`).
- Flax (Linen, NNX): a module holding `weight_v`, `weight_g` (and `bias`) used as
  `v * g / ||v||` (transformers' `FlaxConvWithWeightNorm`). Which axes of `v` are the
  kernel's is read from the forward pass on example inputs (`axes`: `v`'s stored
  axes as `(out, in, *spatial)`, `bridge._port._weight_norm.read_axes`); without
  one, PyTorch's order, whose names these are; a `bias` that does not fit it
  leaves the axes unknown, and the layer refused.
- Equinox: `eqx.nn.WeightNorm(layer)` around a `Conv`/`Linear` (`layer.weight` = `v`,
  `g`).

Each layer is also a candidate of the plain kind (`Conv`, `Dense`) through a view
(`bridge._port._weight_norm`): into a plain layer the weight is `g * v / ||v||`; from
one, `v = w` and `g = ||w||` (a re-parametrisation: the same function, other arrays).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.numpy as jnp

from .._codec import Codec, Leaves, register_codec
from ._conv import _eqx_hyper, _torch_conv_hyper
from ._host import transpose
from ._torch import class_names, module_of


WEIGHT_NORM = {"Conv": "WeightNormConv", "Dense": "WeightNormDense"}
"""The weight-normed kind of each plain kind."""

_TORCH_NAMES = (
    ("parametrizations/weight/original0", "parametrizations/weight/original1"),
    ("weight_g", "weight_v"),
)
"""PyTorch's `(g, v)` entries: `parametrizations.weight_norm`, the old hook's."""
_FLAX_NAMES = ("weight_g", "weight_v")


def _to_canonical(n: int) -> tuple[int, ...]:
    """The permutation of a weight stored `(out, in, *spatial)` to Flax's
    `(*spatial, in, out)` (`(in, out)` for a Dense weight)."""
    return (*range(2, n), 1, 0)


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(perm.index(a) for a in range(len(perm)))


def _g_as_v(g: Any, rank: int) -> Any:
    """`g` with as many axes as `v` (a scalar `g` normalises over every axis)."""
    return jnp.reshape(g, (1,) * rank) if g.ndim == 0 and rank else g


def _broadcasts(g: tuple[int, ...], v: tuple[int, ...]) -> bool:
    """Whether `g`'s shape is `v`'s with some axes of length 1 (or a scalar)."""
    return not g or (len(g) == len(v) and all(a in (1, b) for a, b in zip(g, v)))


def _decode(v: Any, g: Any, bias: Any, perm: tuple[int, ...]) -> Leaves:
    out = {
        "kernel": transpose(v, perm),
        "scale": transpose(_g_as_v(g, v.ndim), perm),
    }
    if bias is not None:
        out["bias"] = bias
    return out


def _encode(canonical: Leaves, perm: tuple[int, ...], g_shape: Any) -> tuple:
    """`(v, g)` in a stored layout (`perm` from it to canonical), `g` reshaped to
    `g_shape` (a scalar) unless None."""
    undo = _inverse(perm)
    v = transpose(canonical["kernel"], undo)
    g = transpose(canonical["scale"], undo)
    return v, g if g_shape is None else jnp.reshape(g, g_shape)


# --- PyTorch ----------------------------------------------------------------------


def _torch_names(leaves: Leaves) -> tuple[str, str] | None:
    for g, v in _TORCH_NAMES:
        if g in leaves and v in leaves and set(leaves) <= {g, v, "bias"}:
            return g, v
    return None


def _torch_recognise(plain: str):
    classes = {"Conv": ("Conv1d", "Conv2d", "Conv3d"), "Dense": ("Linear",)}[plain]

    def recognise(cls: Any, leaves: Leaves) -> bool:
        names = _torch_names(leaves)
        if names is None:
            return False
        g, v = (tuple(leaves[n].shape) for n in names)
        if not _broadcasts(g, v):
            return False
        bias = leaves.get("bias")
        if bias is not None and tuple(bias.shape) != v[:1]:
            return False
        if cls is not None and class_names(cls) - {"Module"}:
            return bool(class_names(cls) & set(classes))
        return len(v) == 2 if plain == "Dense" else 3 <= len(v) <= 5

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
        conv = plain == "Conv" and hasattr(module, "kernel_size")  # nn.Conv*d
        out = _torch_conv_hyper(layer) if conv else {}
        dim = _torch_dim(module)
        if dim is not None:
            out["weight_norm_dim"] = dim
        return out

    return read


_DIM = (
    "its weight norm keeps axis {dim} (the module's `dim`), but `g` has shape "
    "{g} for `v` {v}: the stored arrays do not belong to this module"
)


def _torch_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    names = _torch_names(leaves)
    assert names is not None  # recognised
    g, v = (leaves[n] for n in names)
    dim = hyper.get("weight_norm_dim")
    if dim is not None:
        want = (
            ()
            if dim == -1
            else tuple(n if a == dim else 1 for a, n in enumerate(v.shape))
        )
        if tuple(g.shape) != want:
            raise ValueError(_DIM.format(dim=dim, g=tuple(g.shape), v=tuple(v.shape)))
    return _decode(v, g, leaves.get("bias"), _to_canonical(v.ndim))


def _torch_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    names = _torch_names(like) or _TORCH_NAMES[0]
    rank = canonical["kernel"].ndim
    g_shape = tuple(like[names[0]].shape) if names[0] in like else None
    v, g = _encode(canonical, _to_canonical(rank), g_shape)
    out = {names[0]: g, names[1]: v}
    if "bias" in canonical and (not like or "bias" in like):
        out["bias"] = canonical["bias"]
    return out


# --- Flax (Linen, NNX): weight_v, weight_g, bias; axes from the forward pass -------


def _flax_recognise(plain: str):
    def recognise(cls: Any, leaves: Leaves) -> bool:
        if not set(_FLAX_NAMES) <= set(leaves) <= {*_FLAX_NAMES, "bias"}:
            return False
        g, v = (tuple(leaves[n].shape) for n in _FLAX_NAMES)
        if not _broadcasts(g, v):
            return False
        return len(v) == 2 if plain == "Dense" else 3 <= len(v) <= 5

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


# --- Equinox: eqx.nn.WeightNorm around a Conv or Linear ------------------------------


def _eqx_recognise(plain: str):
    def recognise(cls: Any, leaves: Leaves) -> bool:
        if not (isinstance(cls, type) and issubclass(cls, eqx.nn.WeightNorm)):
            return False
        if (
            not {"layer/weight", "g"}
            <= set(leaves)
            <= {"layer/weight", "layer/bias", "g"}
        ):
            return False
        rank = leaves["layer/weight"].ndim
        return rank == 2 if plain == "Dense" else 3 <= rank <= 5

    return recognise


_EQX_WRAPPED = (
    "an eqx.nn.WeightNorm around a {cls} (weight_name={name!r}): only a Conv or a "
    "Linear's `weight` is read"
)


def _eqx_hyper_of(plain: str):
    def read(module: Any) -> dict[str, Any]:
        layer = module.layer
        fits = eqx.nn.Conv if plain == "Conv" else eqx.nn.Linear
        if module.weight_name != "weight" or not isinstance(layer, fits):
            return {"wrapped": type(layer).__name__, "weight_name": module.weight_name}
        out = _eqx_hyper(layer) if plain == "Conv" else {}
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
_TORCH_LAYOUT = {"Conv": "torch OIHW", "Dense": "torch (out,in)"}


def _register(plain: str) -> tuple[Codec, ...]:
    kind = WEIGHT_NORM[plain]
    return register_codec(
        *(
            Codec(
                kind,
                framework,
                _flax_recognise(plain),
                _flax_decode,
                _flax_encode,
                layout="weight_v (out,in,..) or as the forward pass reads it",
                defaults=_DEFAULTS,
            )
            for framework in ("linen", "nnx")
        ),
        Codec(
            kind,
            "equinox",
            _eqx_recognise(plain),
            _eqx_decode,
            _eqx_encode,
            _eqx_hyper_of(plain),
            layout=f"WeightNorm, weight {_TORCH_LAYOUT[plain][6:]}",
            defaults=_DEFAULTS,
        ),
        Codec(
            kind,
            "torch",
            _torch_recognise(plain),
            _torch_decode,
            _torch_encode,
            _torch_hyper(plain),
            layout=f"{_TORCH_LAYOUT[plain]}, weight norm",
            defaults=_DEFAULTS,
        ),
    )


WEIGHT_NORM_CONV = _register("Conv")
WEIGHT_NORM_DENSE = _register("Dense")
