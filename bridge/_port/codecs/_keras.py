"""Codecs of Keras 3's and KerasHub's layers (framework `"keras"`), one per family.

A Keras Tree records every layer's class; a layer is recognised by its class's name
(keras is never imported here). Keras's names and layouts are mostly Flax's:

- `Dense` (`keras.layers.Dense`): `kernel (in, out)`, `bias (out,)`: Flax's.
- `Dense` (`keras.layers.EinsumDense`, the per-head projections of Keras's and
  KerasHub's attention): its `equation` is the contraction. The kernel's letters
  the input shares and the output lacks are its inputs (in the input's order), the
  letters the output shares its outputs (in the output's order): the kernel moved to
  `(*inputs, *outputs)` and reshaped to `(prod(inputs), prod(outputs))` is Flax's
  `Dense` kernel; so `(D, H, hd)` queries, `(H, hd, D)` output projections and
  Gemma's heads-first `(H, D, hd)` queries all read right. The bias must span the
  outputs. A kernel letter the input and output both keep (a product per head) is
  no `Dense`: refused, naming it.
- `Conv` (`Conv1D/2D/3D`): `kernel (*k, in/groups, out)`: Flax's HWIO.
- `BatchNorm` (`BatchNormalization`): `gamma`, `beta`, `moving_mean`,
  `moving_variance`: Flax's `scale`, `bias`, `mean`, `var` (Keras's `momentum` is
  Flax's: the old value's weight).
- `LayerNorm` (`LayerNormalization`): `gamma`, `beta`; with `rms_scaling` an
  `RMSNorm` (`gamma` alone). `RMSNorm` (`keras.layers.RMSNormalization`): `scale`.
  KerasHub's own norms (`LlamaLayerNorm`, Mistral's, Qwen's, ...: `scale`) by what
  their `call` computes: an RMS norm times `scale` is `RMSNorm`; times `(1 +
  scale)` (Gemma's `RMSNormalization`) is `GemmaRMSNorm`.
- `Embed` (`Embedding`, KerasHub's `PositionEmbedding`, a `ReversibleEmbedding`
  with tied weights): `embeddings (vocab, D)`: Flax's `embedding`.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import jax.numpy as jnp

from ..._families._offset_norms import MEAN, RMS
from .._codec import Codec, Leaves, register_codec
from ._conv import _padding, _tuple


def class_names(cls: Any) -> set[str]:
    """The names of the Keras (and KerasHub) classes `cls` derives from."""
    return {
        c.__name__
        for c in getattr(cls, "__mro__", ())
        if c.__module__.startswith(("keras", "keras_hub"))
    }


def _of(*names: str, entries: frozenset[str], optional: frozenset[str] = frozenset()):
    """`recognise`: a Keras class of `names` holding `entries` (and `optional`)."""

    def recognise(cls: Any, leaves: Leaves) -> bool:
        return bool(class_names(cls) & set(names)) and (
            entries <= set(leaves) <= entries | optional
        )

    return recognise


def _renamed(mapping: dict[str, str]):
    """`decode`, `encode` of a layer whose entries are Flax's renamed, same layout:
    `mapping` is `{Keras name: Flax name}`."""

    def decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
        return {mapping[k]: v for k, v in leaves.items()}

    def encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
        return {k: canonical[mapping[k]] for k in like}

    return decode, encode


def _read(module: Any, **names: str) -> dict[str, Any]:
    """`{key: module.<attr>}` for the attributes the module has."""
    out = {}
    for key, attr in names.items():
        value = getattr(module, attr, None)
        if value is not None:
            out[key] = tuple(value) if isinstance(value, list) else value
    return out


_KERNEL = frozenset({"kernel"})
_BIAS = frozenset({"bias"})
_SAME = _renamed({"kernel": "kernel", "bias": "bias"})


# --- Dense: Dense, EinsumDense -------------------------------------------------------


class Einsum:
    """An `EinsumDense` equation read as a `Dense` product: `inputs`, `outputs` the
    kernel's axes in the fused `(in, out)` order; `bias` the bias's axes of length
    more than 1, in its own order (they must be the outputs, in theirs)."""

    def __init__(self, equation: str, bias_axes: str | None):
        terms, output = equation.replace("...", "").replace(" ", "").split("->")
        source, kernel = terms.split(",")
        shared = [c for c in kernel if c in source and c in output]
        alone = [c for c in kernel if c not in source and c not in output]
        if shared or alone:
            raise ValueError(
                _PER_HEAD.format(equation=equation, letters=shared or alone)
            )
        self.kernel = kernel
        self.inputs = tuple(kernel.index(c) for c in source if c in kernel)
        self.outputs = tuple(kernel.index(c) for c in output if c in kernel)
        self.bias = None
        if bias_axes:
            free = "".join(c for c in output if c in kernel)
            if "".join(c for c in output if c in bias_axes) != free:
                raise ValueError(
                    _PARTIAL_BIAS.format(equation=equation, bias=bias_axes)
                )
            self.bias = free


_PER_HEAD = (
    "an EinsumDense of equation {equation!r}: its kernel's letters {letters} are not "
    "contracted with the input nor all in the output (a product per head, not one "
    "Dense layer). Port it with rules, or a codec of your own (bridge.Codec)"
)
_PARTIAL_BIAS = (
    "an EinsumDense of equation {equation!r} whose bias (axes {bias!r}) does not span "
    "its outputs: not a Dense layer's bias"
)


@functools.lru_cache(maxsize=256)
def _einsum(equation: str, bias_axes: str | None) -> Einsum:
    return Einsum(equation, bias_axes)


def _dense_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    if "equation" not in hyper:  # a Dense; an EinsumDense read without its layer
        if leaves["kernel"].ndim != 2:  # cannot be read (and is no stack either)
            raise KeyError("equation")
        return dict(leaves)
    read = _einsum(hyper["equation"], hyper.get("bias_axes"))
    kernel = leaves["kernel"]
    rows = math.prod(kernel.shape[a] for a in read.inputs)
    order = read.inputs + read.outputs
    out = {"kernel": jnp.reshape(jnp.transpose(kernel, order), (rows, -1))}
    if "bias" in leaves:
        out["bias"] = jnp.reshape(leaves["bias"], (-1,))
    return out


def _dense_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    if "equation" not in hyper:  # a Dense
        return {k: canonical[k] for k in like}
    read = _einsum(hyper["equation"], hyper.get("bias_axes"))
    shape = tuple(like["kernel"].shape)
    order = read.inputs + read.outputs
    moved = jnp.reshape(canonical["kernel"], tuple(shape[a] for a in order))
    out = {
        "kernel": jnp.transpose(moved, tuple(order.index(a) for a in range(len(shape))))
    }
    if "bias" in like:
        out["bias"] = jnp.reshape(canonical["bias"], like["bias"].shape)
    return out


def _dense_hyper(module: Any) -> dict[str, Any]:
    """An `EinsumDense`'s equation (and bias axes); a `Dense`'s `use_bias`."""
    if "EinsumDense" in class_names(type(getattr(module, "module", module))):
        return _read(module, equation="equation", bias_axes="bias_axes")
    return _read(module, use_bias="use_bias")


def _dense(cls: Any, leaves: Leaves) -> bool:
    """A `Dense` (its 2-D kernel), or an `EinsumDense` of a kernel of 3 axes or more
    (one of 2 a forward pass on example inputs reads: it may be stored `(out, in)`)."""
    names = class_names(cls)
    kernel = leaves.get("kernel")
    if kernel is None or not _KERNEL <= set(leaves) <= _KERNEL | _BIAS:
        return False
    if "EinsumDense" in names:
        return kernel.ndim >= 3
    return "Dense" in names and kernel.ndim == 2


DENSE_KERAS = register_codec(
    Codec(
        "Dense",
        "keras",
        _dense,
        _dense_decode,
        _dense_encode,
        _dense_hyper,
        layout="kernel (in,out); EinsumDense's by its equation",
        defaults={"bias": 0.0},
    )
)


# --- Conv: Conv1D, Conv2D, Conv3D ----------------------------------------------------


def _conv_hyper(module: Any) -> dict[str, Any]:
    size = getattr(module, "kernel_size", None)
    if size is None:
        return {}
    kernel = tuple(size)
    n = len(kernel)
    strides = _tuple(module.strides, n)
    dilation = _tuple(module.dilation_rate, n)
    out = {
        "strides": strides,
        "dilation": dilation,
        "groups": module.groups,
        "use_bias": module.use_bias,
    }
    if module.padding != "causal":
        out["padding"] = _padding(module.padding, kernel, dilation, strides)
    return out


CONV_KERAS = register_codec(
    Codec(
        "Conv",
        "keras",
        _of("Conv1D", "Conv2D", "Conv3D", entries=_KERNEL, optional=_BIAS),
        *_SAME,
        _conv_hyper,
        defaults={"bias": 0.0},
    )
)


# --- BatchNorm: BatchNormalization ---------------------------------------------------


def _norm_settings(module: Any, **more: str) -> dict[str, Any]:
    """A Keras norm's `epsilon`, `scale`/`center` flags and the settings `more`."""
    return _read(
        module, epsilon="epsilon", use_scale="scale", use_bias="center", **more
    )


_BN = {
    "gamma": "scale",
    "beta": "bias",
    "moving_mean": "mean",
    "moving_variance": "var",
}

BATCH_NORM_KERAS = register_codec(
    Codec(
        "BatchNorm",
        "keras",
        _of(
            "BatchNormalization",
            entries=frozenset({"moving_mean", "moving_variance"}),
            optional=frozenset({"gamma", "beta"}),
        ),
        *_renamed(_BN),
        lambda m: _norm_settings(m, momentum="momentum"),
        layout="gamma, beta, moving_mean/variance",
        defaults={"scale": 1.0, "bias": 0.0},
    )
)


# --- LayerNorm, RMSNorm, GemmaRMSNorm ------------------------------------------------


_LAST = (-1, (-1,))

_OTHER_AXES = (
    "normalises over axis {axis}: only a norm over the last axis is read (Keras's "
    "`axis=-1`)"
)


def _last_axis(decode):
    """`decode` of a Keras norm, read only over the last axis (`hyper["axis"]`)."""

    def run(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
        axis = hyper.get("axis", -1)
        if axis not in _LAST:
            raise ValueError(_OTHER_AXES.format(axis=axis))
        return decode(leaves, hyper)

    return run


_RMS_SCALING = (
    "a LayerNormalization with rms_scaling=True (deprecated by Keras: an RMS norm "
    "without a mean) is not read: build the model with keras.layers.RMSNormalization"
)


def _layer_norm_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    if hyper.get("rms_scaling"):
        raise ValueError(_RMS_SCALING)
    return _last_axis(_LN[0])(leaves, hyper)


_LN = _renamed({"gamma": "scale", "beta": "bias"})

LAYER_NORM_KERAS = register_codec(
    Codec(
        "LayerNorm",
        "keras",
        _of(
            "LayerNormalization",
            entries=frozenset(),
            optional=frozenset({"gamma", "beta"}),
        ),
        _layer_norm_decode,
        _LN[1],
        lambda m: _norm_settings(m, axis="axis", rms_scaling="rms_scaling"),
        layout="gamma, beta",
        defaults={"scale": 1.0, "bias": 0.0},
    )
)


@functools.cache
def _call_source(cls: Any) -> str:
    try:
        return inspect.getsource(cls.call)
    except (OSError, TypeError, AttributeError):
        return ""


def computes(cls: Any) -> str | None:
    """What a Keras norm class holding a `scale` alone computes, read from its
    `call`: `"RMSNorm"` (an RMS norm times `scale`), `"GemmaRMSNorm"` (times `(1 +
    scale)`), or None (not an RMS norm, or its source is not readable)."""
    source = _call_source(cls)
    if not RMS.search(source) or MEAN.search(source):
        return None
    plus = "(1 + scale)" in source.replace("1.0", "1") or "1 + self.scale" in source
    return "GemmaRMSNorm" if plus else "RMSNorm"


def _scale_norm(kind: str):
    def recognise(cls: Any, leaves: Leaves) -> bool:
        if set(leaves) != {"scale"} or not class_names(cls):
            return False
        if "RMSNormalization" in class_names(cls) and not kind.startswith("Gemma"):
            # Keras's own: `x * rsqrt(mean(x**2) + eps) * scale`; KerasHub's
            # Gemma `RMSNormalization` is another class of that name
            return computes(cls) in (None, "RMSNorm") and _keras_own(cls)
        return computes(cls) == kind

    return recognise


def _keras_own(cls: Any) -> bool:
    return any(
        c.__name__ == "RMSNormalization" and c.__module__.startswith("keras.")
        for c in cls.__mro__
    )


_SCALE = _renamed({"scale": "scale"})

RMS_NORM_KERAS = register_codec(
    Codec(
        "RMSNorm",
        "keras",
        _scale_norm("RMSNorm"),
        _last_axis(_SCALE[0]),
        _SCALE[1],
        lambda m: _read(m, epsilon="epsilon", axis="axis"),
        defaults={"scale": 1.0},
    )
)
GEMMA_RMS_NORM_KERAS = register_codec(
    Codec(
        "GemmaRMSNorm",
        "keras",
        _scale_norm("GemmaRMSNorm"),
        *_SCALE,
        lambda m: _read(m, epsilon="epsilon"),
        layout="scale, x * (1 + scale)",
    )
)


# --- Embed: Embedding, PositionEmbedding, ReversibleEmbedding (tied) -----------------


_EMBEDDINGS = frozenset({"embeddings"})

EMBED_KERAS = register_codec(
    Codec(
        "Embed",
        "keras",
        _of(
            "Embedding", "PositionEmbedding", "ReversibleEmbedding", entries=_EMBEDDINGS
        ),
        *_renamed({"embeddings": "embedding"}),
        layout="embeddings",
    )
)
