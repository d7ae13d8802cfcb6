"""Codecs of Haiku's layers (framework `"haiku"`), one per layer family.

Haiku names its entries generically (`w`, `b`, `scale`, `offset`) and its modules
as the user chose: a layer is recognised by its class where the Tree records one
(`bridge.from_haiku(..., example=...)`, or the class a forward pass shows: the
adapter's `called`), else by its entries (several kinds may fit: a `{scale}` alone is
a `LayerNorm` without offset or an `RMSNorm`, which the other side decides). haiku is
never imported here: a class is known by its name and module.

- `Dense` (`hk.Linear`): `w (in, out)`, `b (out,)`: Flax's `kernel`, `bias`.
- `Conv` (`hk.Conv1D/2D/3D`, `hk.ConvND`): `w (*k, in/groups, out)`, Flax's HWIO;
  `b (out,)` (`(out, 1, ..., 1)` channels first).
- `ConvTranspose` (`hk.Conv{1,2,3}DTranspose`): `w (*k, out, in)`, applied
  unflipped (`lax.conv_transpose` without `transpose_kernel`): Flax's kernel with
  its last two axes swapped. Recognised by its class only (a class-less kernel is a
  `Conv`'s: give `bridge.from_haiku` example inputs).
- `BatchNorm` (`hk.BatchNorm`): `scale`, `offset` and the moving averages
  `mean_ema/average`, `var_ema/average`, stored `(1, ..., 1, C)` by the input's
  rank: Flax's `scale`, `bias`, `mean`, `var` of shape `(C,)`. Writing them, the
  averages' `hidden` is the average and `counter` `2**30` (`decay**counter` is 0 in
  float32): Haiku's zero-debiased average reads them unchanged, and training goes on
  from them as Flax's momentum does (a counter of 0 would replace them by the first
  batch's statistics).
- `LayerNorm` (`hk.LayerNorm`), `RMSNorm` (`hk.RMSNorm`): `scale`, `offset`: Flax's
  `scale`, `bias`, read where the norm is over, and scales, the last axis.
- `Embed` (`hk.Embed`): `embeddings (vocab, D)`: Flax's `embedding`.
- `MultiHeadAttention` (`hk.MultiHeadAttention`): four `hk.Linear`s with fused heads,
  `query/w (D, H*K)`, `key`, `value`, `linear/w (H*V, D)`: Flax's per-head
  `query/kernel (D, H, K)` ... `out/kernel (H, V, D)`. Where the other side holds
  separate projections, the four are read as `Dense` layers instead.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from .._codec import Codec, Leaves, register_codec
from ._batch_norm import SETTLED_COUNTER
from ._conv import _padding, _tuple


def class_names(cls: Any) -> set[str]:
    """The names of the Haiku classes `cls` derives from."""
    return {
        c.__name__
        for c in getattr(cls, "__mro__", ())
        if c.__module__.startswith("haiku")
    }


def _by_class(*names: str, fallback):
    """`recognise`: a class of `names` (with the entries `fallback` accepts), or
    without a class the entries alone."""

    def recognise(cls: Any, leaves: Leaves) -> bool:
        if cls is not None and not class_names(cls) & set(names):
            return False
        return fallback(leaves)

    return recognise


def _has(leaves: Leaves, required: set[str], optional: set[str] = set()) -> bool:
    return required <= set(leaves) <= required | optional


def _attributes(module: Any, **names: str) -> dict[str, Any]:
    """`{key: module.<attr>}` for the attributes a module has (none without one)."""
    out = {}
    for key, attr in names.items():
        value = getattr(module, attr, None)
        if value is not None:
            out[key] = value
    return out


# --- Dense: hk.Linear ----------------------------------------------------------------


def _linear(leaves: Leaves) -> bool:
    w, b = leaves.get("w"), leaves.get("b")
    return (
        _has(leaves, {"w"}, {"b"})
        and w is not None
        and w.ndim == 2
        and (b is None or tuple(b.shape) == w.shape[1:])
    )


def _renamed(mapping: dict[str, str]):
    """`decode` and `encode` of a layer whose entries are Flax's renamed, same
    layout: `mapping` is `{haiku name: Flax name}`."""

    def decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
        return {mapping[k]: v for k, v in leaves.items()}

    def encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
        return {k: canonical[mapping[k]] for k in like}

    return decode, encode


_DENSE = _renamed({"w": "kernel", "b": "bias"})

DENSE_HAIKU = register_codec(
    Codec(
        "Dense",
        "haiku",
        _by_class("Linear", fallback=_linear),
        *_DENSE,
        lambda m: _attributes(m, use_bias="with_bias"),
        layout="w (in,out)",
        names=("Linear",),
        defaults={"bias": 0.0},
    )
)


# --- Conv, ConvTranspose: hk.ConvND, hk.ConvNDTranspose ------------------------------


def _conv(leaves: Leaves) -> bool:
    w, b = leaves.get("w"), leaves.get("b")
    return (
        _has(leaves, {"w"}, {"b"})
        and w is not None
        and 3 <= w.ndim <= 5
        and (b is None or b.shape[0] == w.shape[-1])
    )


def _conv_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    out = {"kernel": leaves["w"]}
    if "b" in leaves:
        out["bias"] = jnp.reshape(leaves["b"], (-1,))
    return out


def _conv_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    out = {"w": canonical["kernel"]}
    if "b" in like:
        out["b"] = jnp.reshape(canonical["bias"], like["b"].shape)
    return out


def _swapped(decode, encode):
    """A transposed convolution's codec: `w (*k, out, in)` <-> Flax's `(*k, in,
    out)`."""

    def dec(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
        out = decode(leaves, hyper)
        out["kernel"] = jnp.swapaxes(out["kernel"], -1, -2)
        return out

    def enc(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
        kernel = jnp.swapaxes(canonical["kernel"], -1, -2)
        return encode({**canonical, "kernel": kernel}, like, hyper)

    return dec, enc


def _conv_hyper(module: Any) -> dict[str, Any]:
    if getattr(module, "kernel_shape", None) is None:
        return {}
    kernel = tuple(module.kernel_shape)
    n = len(kernel)
    strides, rate = _tuple(module.stride, n), _tuple(module.kernel_dilation, n)
    out: dict[str, Any] = {
        "strides": strides,
        "dilation": rate,
        "groups": module.feature_group_count,
        "use_bias": module.with_bias,
    }
    if isinstance(module.padding, str):  # else pairs made by `hk.pad` functions
        out["padding"] = _padding(module.padding, kernel, rate, strides)
    return out


def _transpose_hyper(module: Any) -> dict[str, Any]:
    if getattr(module, "kernel_shape", None) is None:
        return {}
    n = len(tuple(module.kernel_shape))
    return {"strides": _tuple(module.stride, n), "use_bias": module.with_bias}


_CONVS = ("ConvND", "Conv1D", "Conv2D", "Conv3D")
_TRANSPOSES = (
    "ConvNDTranspose",
    "Conv1DTranspose",
    "Conv2DTranspose",
    "Conv3DTranspose",
)

CONV_HAIKU = register_codec(
    Codec(
        "Conv",
        "haiku",
        _by_class(*_CONVS, fallback=_conv),
        _conv_decode,
        _conv_encode,
        _conv_hyper,
        layout="w HWIO",
        names=_CONVS,
        defaults={"bias": 0.0},
    )
)


def _transpose(cls: Any, leaves: Leaves) -> bool:
    """A transposed convolution only by its class: its `w (*k, out, in)` looks like
    a convolution's `(*k, in, out)` (class-less, a kernel is read as a `Conv`)."""
    return cls is not None and _by_class(*_TRANSPOSES, fallback=_conv)(cls, leaves)


CONV_TRANSPOSE_HAIKU = register_codec(
    Codec(
        "ConvTranspose",
        "haiku",
        _transpose,
        *_swapped(_conv_decode, _conv_encode),
        _transpose_hyper,
        layout="w HWOI",
        names=_TRANSPOSES,
        defaults={"bias": 0.0},
    )
)


# --- BatchNorm: hk.BatchNorm ---------------------------------------------------------


_EMA = ("mean_ema", "var_ema")
_AVERAGES = {f"{ema}/average" for ema in _EMA}
_TRAINING = {f"{ema}/{entry}" for ema in _EMA for entry in ("hidden", "counter")}


def _batch_norm(leaves: Leaves) -> bool:
    return _has(leaves, _AVERAGES, {"scale", "offset"} | _TRAINING)


def _flat(x: Any) -> Any:
    return jnp.reshape(x, (-1,))


def _bn_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    out = {"mean": _flat(leaves["mean_ema/average"])}
    out["var"] = _flat(leaves["var_ema/average"])
    if "scale" in leaves:
        out["scale"] = _flat(leaves["scale"])
    if "offset" in leaves:
        out["bias"] = _flat(leaves["offset"])
    return out


def _bn_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    flax = {"scale": "scale", "offset": "bias"}
    out = {
        k: jnp.reshape(canonical[v], like[k].shape)
        for k, v in flax.items()
        if k in like
    }
    for ema, stat in zip(_EMA, ("mean", "var")):
        average = jnp.reshape(canonical[stat], like[f"{ema}/average"].shape)
        out[f"{ema}/average"] = average
        if f"{ema}/hidden" in like:  # what the zero-debiased average reads as is
            out[f"{ema}/hidden"] = average
        if f"{ema}/counter" in like:
            counter = like[f"{ema}/counter"]
            out[f"{ema}/counter"] = jnp.full(
                counter.shape, SETTLED_COUNTER, counter.dtype
            )
    return out


def _bn_hyper(module: Any) -> dict[str, Any]:
    out = _attributes(
        module, epsilon="eps", use_scale="create_scale", use_bias="create_offset"
    )
    ema = getattr(module, "mean_ema", None)
    if ema is not None:
        out["momentum"] = ema.decay
    return out


BATCH_NORM_HAIKU = register_codec(
    Codec(
        "BatchNorm",
        "haiku",
        _by_class("BatchNorm", fallback=_batch_norm),
        _bn_decode,
        _bn_encode,
        _bn_hyper,
        layout="(1,..,1,C), stats in mean_ema/var_ema",
        names=("BatchNorm",),
        defaults={"scale": 1.0, "bias": 0.0},
    )
)


# --- LayerNorm, RMSNorm: hk.LayerNorm, hk.RMSNorm ------------------------------------


_LAST = ((-1,), -1, [-1])

_OTHER_AXES = (
    "normalises over axes {axis} and scales over axes {param}: only a norm over, and "
    "scaling, the last axis is read (Haiku's `axis=-1` with the default `param_axis`)"
)


def _norm_codecs(mapping: dict[str, str]):
    """`decode`, `encode` of a Haiku norm: Flax's entries renamed, read only where
    it normalises over, and scales, the last axis (`hyper["axis"]`, the module's)."""
    decode, encode = _renamed(mapping)

    def checked(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
        axis, param = hyper.get("axis", -1), hyper.get("param_axis", -1)
        if isinstance(axis, slice) or axis not in _LAST or param not in _LAST:
            raise ValueError(_OTHER_AXES.format(axis=axis, param=param))
        return decode(leaves, hyper)

    return checked, encode


def _norm_hyper(module: Any) -> dict[str, Any]:
    out = _attributes(
        module,
        epsilon="eps",
        use_scale="create_scale",
        use_bias="create_offset",
        axis="axis",
        param_axis="param_axis",
    )
    for key in ("axis", "param_axis"):
        if isinstance(out.get(key), (tuple, list)):
            out[key] = tuple(out[key])
    return out


def _affine(leaves: Leaves) -> bool:
    return (
        bool(leaves)
        and _has(leaves, set(), {"scale", "offset"})
        and all(x.ndim == 1 for x in leaves.values())
    )


def _scale_alone(leaves: Leaves) -> bool:
    return set(leaves) == {"scale"} and leaves["scale"].ndim == 1


_NORM = _norm_codecs({"scale": "scale", "offset": "bias"})
_NORM_HYPER = _norm_hyper

LAYER_NORM_HAIKU = register_codec(
    Codec(
        "LayerNorm",
        "haiku",
        _by_class("LayerNorm", fallback=_affine),
        *_NORM,
        _NORM_HYPER,
        layout="offset",
        names=("LayerNorm",),
        defaults={"scale": 1.0, "bias": 0.0},
    )
)
RMS_NORM_HAIKU = register_codec(
    Codec(
        "RMSNorm",
        "haiku",
        _by_class("RMSNorm", fallback=_scale_alone),
        *_NORM,
        _NORM_HYPER,
        names=("RMSNorm",),
        defaults={"scale": 1.0, "bias": 0.0},
    )
)


# --- Embed: hk.Embed -----------------------------------------------------------------


def _embed(leaves: Leaves) -> bool:
    return set(leaves) == {"embeddings"} and leaves["embeddings"].ndim == 2


EMBED_HAIKU = register_codec(
    Codec(
        "Embed",
        "haiku",
        _by_class("Embed", fallback=_embed),
        *_renamed({"embeddings": "embedding"}),
        layout="embeddings",
        names=("Embed",),
    )
)


# --- MultiHeadAttention: hk.MultiHeadAttention ---------------------------------------


_PROJECTIONS = {"query": "query", "key": "key", "value": "value", "linear": "out"}
_MHA_DEFAULTS = {f"{p}/bias": 0.0 for p in ("query", "key", "value", "out")}


def _mha(leaves: Leaves) -> bool:
    weights = {f"{p}/w" for p in _PROJECTIONS}
    return _has(leaves, weights, {f"{p}/b" for p in _PROJECTIONS})


def _mha_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    heads = hyper["heads"]
    out: Leaves = {}
    for name in ("query", "key", "value"):
        w = leaves[f"{name}/w"]
        out[f"{name}/kernel"] = jnp.reshape(w, (w.shape[0], heads, -1))
        if f"{name}/b" in leaves:
            out[f"{name}/bias"] = jnp.reshape(leaves[f"{name}/b"], (heads, -1))
    w = leaves["linear/w"]
    out["out/kernel"] = jnp.reshape(w, (heads, -1, w.shape[-1]))
    if "linear/b" in leaves:
        out["out/bias"] = leaves["linear/b"]
    return out


def _mha_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    out: Leaves = {}
    for haiku, flax in _PROJECTIONS.items():
        if f"{haiku}/w" in like:
            out[f"{haiku}/w"] = jnp.reshape(
                canonical[f"{flax}/kernel"], like[f"{haiku}/w"].shape
            )
        if f"{haiku}/b" in like:
            out[f"{haiku}/b"] = jnp.reshape(
                canonical[f"{flax}/bias"], like[f"{haiku}/b"].shape
            )
    return out


def _mha_hyper(module: Any) -> dict[str, Any]:
    return _attributes(module, heads="num_heads", use_bias="with_bias")


MHA_HAIKU = register_codec(
    Codec(
        "MultiHeadAttention",
        "haiku",
        _by_class("MultiHeadAttention", fallback=_mha),
        _mha_decode,
        _mha_encode,
        _mha_hyper,
        layout="fused heads (D, H*K), linear",
        names=("MultiHeadAttention",),
        defaults=_MHA_DEFAULTS,
    )
)
