"""Codecs: `LayerNorm`, `RMSNorm` and `GroupNorm`.

Canonical (Flax): `scale` and `bias`, shape `(features,)`; Equinox calls them
`weight` and `bias`. Equinox's `RMSNorm` has a `bias` Flax's has not: it is 0 when
coming from Flax, and porting to Flax refuses a non-zero one. Either side may lack
`scale` (1) or `bias` (0): a missing one is filled with that neutral value, a dropped
one must hold it. PyTorch (`nn.LayerNorm`, `nn.RMSNorm`, `nn.GroupNorm`, and
Hugging Face's `...LayerNorm`/`...RMSNorm` classes except those computing `x * (1 +
weight)`, Gemma's and its kin's): `weight` -> `scale`.

A norm over several axes (PyTorch's `nn.LayerNorm((a, b))`, Equinox's
`LayerNorm(shape=(a, b))`, Linen's `LayerNorm(reduction_axes=(-2, -1),
feature_axes=(-2, -1))`) has a canonical `scale`/`bias` of shape `(a, b)`: it
normalises over, and scales, the last `scale.ndim` axes, as PyTorch's and Equinox's
do by construction. A Flax norm is read only where its `reduction_axes` and
`feature_axes` are those axes: NNX's module says them; a Linen compact submodule
says them to the forward pass on example inputs (`Trace.modules`), and without one a
Linen `scale` of several axes is refused (one axis: Linen's defaults, `-1`).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
from flax import nnx

from ..._families._offset_norms import one_plus_weight, subtracts_no_mean
from .._codec import (
    WRITTEN,
    Codec,
    Leaves,
    attributes,
    of_class,
    register_codec,
    same,
    same_as_like,
)
from ._torch import (
    by_class,
    has_entries,
    module_of,
    read_attributes,
    register_torch,
    shape_of,
)


_DEFAULTS = {"scale": 1.0, "bias": 0.0}
_RENAME = {"weight": "scale", "scale": "scale", "bias": "bias"}
_BACK = {"scale": "weight", "bias": "bias"}


def _axes(value: Any) -> tuple[int, ...]:
    return (value,) if isinstance(value, int) else tuple(value)


_FLAX_AXES = attributes(reduction_axes="reduction_axes", feature_axes="feature_axes")
_OTHER_AXES = (
    "normalises over axes {reduction} and scales over axes {features} (`scale`/"
    "`bias` of shape {shape}): only a norm over, and scaling, its last {n} axes "
    "{want} is read, as PyTorch's nn.LayerNorm/nn.RMSNorm{shape} and Equinox's "
    "norms of shape {shape} compute (axes written from the end)"
)


def _over_features(decode):
    """`decode` of a Flax norm, read only where it normalises over, and scales,
    its last `scale.ndim` axes (`hyper["reduction_axes"]`, `["feature_axes"]`: the
    module's). A `scale` of several axes without them is a setting to be told
    (`KeyError`: the forward pass tells, `_computed`)."""

    def run(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
        ref = next(iter(leaves.values()), None)
        shape = tuple(getattr(ref, "shape", ()))
        if "reduction_axes" not in hyper:
            if len(shape) > 1:
                raise KeyError("reduction_axes")
            return decode(leaves, hyper)
        reduction = _axes(hyper["reduction_axes"])
        features = _axes(hyper.get("feature_axes", -1))
        want = tuple(range(-len(shape), 0))
        if sorted(reduction) != list(want) or sorted(features) != list(want):
            raise ValueError(
                _OTHER_AXES.format(
                    reduction=reduction,
                    features=features,
                    shape=shape,
                    n=len(shape),
                    want=want,
                )
            )
        return decode(leaves, hyper)

    return run


def _linen_affine(cls, leaves: Leaves) -> bool:
    return bool(leaves) and set(leaves) <= {"scale", "bias"}


def _linen_rms(cls, leaves: Leaves) -> bool:
    return set(leaves) == {"scale"}


def _eqx_decode(leaves: Leaves, hyper) -> Leaves:
    return {_RENAME[k]: v for k, v in leaves.items()}


def _eqx_encode(canonical: Leaves, like: Leaves, hyper) -> Leaves:
    return {k: canonical[_RENAME[k]] for k in like}


def _eqx_groups(module: Any) -> dict[str, Any]:
    return {
        "epsilon": module.eps,
        "groups": module.groups,
        "use_scale": module.channelwise_affine,
        "use_bias": module.channelwise_affine,
    }


def _flax(kind: str, framework: str, recognise, hyper=None, names=()) -> Codec:
    return register_codec(
        Codec(
            kind,
            framework,
            recognise,
            _over_features(same) if kind == "LayerNorm" else same,
            same_as_like,
            hyper or (lambda module: {}),
            names=names,
            defaults=_DEFAULTS,
        )
    )


def _reference(canonical: Leaves) -> Any:
    """The `scale`, else the `bias`: either shows the features and the dtype."""
    return canonical["scale"] if "scale" in canonical else canonical["bias"]


def _affine(canonical: Leaves) -> tuple[dict[str, Any], Any]:
    ref = _reference(canonical)
    flags = dict(use_weight="scale" in canonical, use_bias="bias" in canonical)
    return dict(flags, dtype=ref.dtype), ref


# Equinox layers for `--to-layout equinox`, with Flax's defaults for what the arrays
# do not show (epsilon 1e-6; 32 groups when they divide the channels)
def _build_layer_norm(canonical: Leaves, options) -> eqx.nn.LayerNorm:
    args, ref = _affine(canonical)
    return eqx.nn.LayerNorm(ref.shape, eps=1e-6, **args)


def _build_rms_norm(canonical: Leaves, options) -> eqx.nn.RMSNorm:
    args, ref = _affine(canonical)
    return eqx.nn.RMSNorm(ref.shape, eps=1e-6, **args)


def _build_group_norm(canonical: Leaves, options) -> eqx.nn.GroupNorm:
    ref = _reference(canonical)
    (channels,) = ref.shape
    groups = 32 if channels % 32 == 0 else 1
    return eqx.nn.GroupNorm(
        groups, channels, eps=1e-6, channelwise_affine=bool(canonical), dtype=ref.dtype
    )


def _equinox(kind: str, cls: type, hyper, build) -> Codec:
    return register_codec(
        Codec(
            kind,
            "equinox",
            of_class(cls),
            _eqx_decode,
            _eqx_encode,
            hyper,
            layout="weight",
            defaults=_DEFAULTS,
            build=build,
        )
    )


_NNX_NORM = attributes(
    epsilon="epsilon",
    use_scale="use_scale",
    use_bias="use_bias",
    reduction_axes="reduction_axes",
    feature_axes="feature_axes",
)
_EQX_NORM = attributes(epsilon="eps", use_scale="use_weight", use_bias="use_bias")

LAYER_NORM_LINEN = _flax(
    "LayerNorm", "linen", _linen_affine, _FLAX_AXES, names=("LayerNorm",)
)
LAYER_NORM_NNX = _flax("LayerNorm", "nnx", of_class(nnx.LayerNorm), _NNX_NORM)
LAYER_NORM_EQUINOX = _equinox(
    "LayerNorm", eqx.nn.LayerNorm, _EQX_NORM, _build_layer_norm
)


# --- norms written by hand: one 1-D array, by what their `__call__` computes ------


def _single(leaves: Leaves, names: tuple[str, ...]) -> bool:
    return len(leaves) == 1 and all(
        k in names and len(getattr(v, "shape", ())) == 1 for k, v in leaves.items()
    )


def _written(test):
    """`recognise`: a module written by hand (not flax's or equinox's own) holding
    one 1-D `weight` or `scale`, whose `__call__` computes what `test(cls)` says
    (transformers' Flax `FlaxLlamaRMSNorm`, bonsai's `T5LayerNorm`, `Gemma3RMSNorm`,
    Mamba2's `RMSNorm`). A Linen module records no class: a `weight` alone is a
    candidate of each kind, which its forward pass's class or the other side
    decides."""

    def recognise(cls: Any, leaves: Leaves) -> bool:
        if cls is None:
            return _single(leaves, ("weight",))
        own = getattr(cls, "__module__", "").startswith(("flax.", "equinox."))
        return not own and _single(leaves, ("weight", "scale")) and test(cls)

    return recognise


def _one_decode(leaves: Leaves, hyper) -> Leaves:
    return {"scale": next(iter(leaves.values()))}


def _one_encode(canonical: Leaves, like: Leaves, hyper) -> Leaves:
    return {next(iter(like), "weight"): canonical["scale"]}


def _rms(cls: Any) -> bool:
    return subtracts_no_mean(cls) and not one_plus_weight(cls)


def _named_like(canonical: Leaves, like: Leaves, hyper) -> Leaves:
    """Flax's names, or those of `like` (a norm written by hand: `weight`)."""
    return _eqx_encode(canonical, like, hyper) if like else dict(canonical)


def _either(first, second):
    def recognise(cls: Any, leaves: Leaves) -> bool:
        return first(cls, leaves) or second(cls, leaves)

    return recognise


_written_rms = _written(_rms)

RMS_NORM_LINEN = register_codec(
    Codec(
        "RMSNorm",
        "linen",
        _either(_linen_rms, _written_rms),
        _over_features(_eqx_decode),
        _named_like,
        _FLAX_AXES,
        names=("RMSNorm",),
        defaults=_DEFAULTS,
    )
)
RMS_NORM_NNX = register_codec(
    Codec(
        "RMSNorm",
        "nnx",
        _either(of_class(nnx.RMSNorm), _written_rms),
        _over_features(_eqx_decode),
        _named_like,
        attributes(
            epsilon="epsilon",
            reduction_axes="reduction_axes",
            feature_axes="feature_axes",
        ),
        defaults=_DEFAULTS,
    )
)
RMS_NORM_EQUINOX = register_codec(
    Codec(
        "RMSNorm",
        "equinox",
        _either(of_class(eqx.nn.RMSNorm), _written_rms),
        _eqx_decode,
        _eqx_encode,
        attributes(epsilon="eps"),
        layout="weight",
        defaults=_DEFAULTS,
        build=_build_rms_norm,
    )
)
"""Flax's and Equinox's RMSNorms, and norms written by hand that compute one
(`_written`): a `weight` of theirs is Flax's `scale`."""

GEMMA_RMS_NORMS = tuple(
    register_codec(
        Codec(
            "GemmaRMSNorm",
            fw,
            _written(one_plus_weight),
            _one_decode,
            _one_encode,
            layout=WRITTEN,
            defaults={},  # its neutral weight is 0, not Flax's scale 1
        )
    )
    for fw in ("linen", "nnx", "equinox")
)
"""Norms written by hand that compute `x * (1 + weight)` (transformers' Flax
`FlaxGemmaRMSNorm`, bonsai's `Gemma3RMSNorm`): they pair with Hugging Face's Gemma
norms (`GEMMA_RMS_NORM_TORCH`). `bridge.Codec.same_layout("GemmaRMSNorm", ...)`
replaces the one of its framework."""

GROUP_NORM_LINEN = _flax("GroupNorm", "linen", _linen_affine, names=("GroupNorm",))
GROUP_NORM_NNX = _flax(
    "GroupNorm",
    "nnx",
    of_class(nnx.GroupNorm),
    attributes(epsilon="epsilon", groups="num_groups"),
)
GROUP_NORM_EQUINOX = _equinox(
    "GroupNorm", eqx.nn.GroupNorm, _eqx_groups, _build_group_norm
)

# --- PyTorch: nn.LayerNorm, nn.RMSNorm, nn.GroupNorm and Hugging Face's norms --------


def _torch_affine(leaves: Leaves, axes: int = 1) -> bool:
    """A `weight` and/or `bias` of `axes` axes (of one shape where both are)."""
    w, b = shape_of(leaves, "weight"), shape_of(leaves, "bias")
    return (
        has_entries(leaves, set(), {"weight", "bias"})
        and bool(leaves)
        and all(s is None or len(s) == axes for s in (w, b))
        and (w is None or b is None or w == b)
    )


def _normalized_shape(cls: Any, leaves: Leaves) -> int:
    """How many axes a norm's arrays may have: those of its `normalized_shape`
    where it is PyTorch's own `nn.LayerNorm`/`nn.RMSNorm` (which normalises over
    them all), else 1."""
    own = any(
        c.__name__ in ("LayerNorm", "RMSNorm") and c.__module__.startswith("torch.")
        for c in getattr(cls, "__mro__", ())
    )
    shape = next((tuple(v.shape) for v in leaves.values()), ())
    return max(len(shape), 1) if own else 1


_torch_group_norm = by_class("GroupNorm")(_torch_affine)


def _norm_class(cls: Any, suffix: str) -> bool:
    """A norm written the Hugging Face way: a class (of any library) whose name ends
    in `suffix` (`LlamaRMSNorm`, `Qwen2RMSNorm`); norms that compute `x * (1 +
    weight)` (Gemma's, Qwen3-Next's: `one_plus_weight`) are not Flax's and are left
    to a codec of their own."""
    named = any(c.__name__.endswith(suffix) for c in getattr(cls, "__mro__", ()))
    return named and not one_plus_weight(cls)  # a class's source read for norms only


def _torch_layer_norm(cls: Any, leaves: Leaves) -> bool:
    if cls is not None and not _norm_class(cls, "LayerNorm"):
        return False
    if cls is not None and subtracts_no_mean(cls):  # T5LayerNorm: an RMS norm
        return False
    return _torch_affine(leaves, _normalized_shape(cls, leaves))


def _torch_rms_norm(cls: Any, leaves: Leaves) -> bool:
    rms = cls is not None and _norm_class(cls, "LayerNorm") and subtracts_no_mean(cls)
    if cls is not None and not (rms or _norm_class(cls, "RMSNorm")):
        return False
    w = shape_of(leaves, "weight")
    axes = _normalized_shape(cls, leaves)
    return set(leaves) == {"weight"} and w is not None and len(w) == axes


def _torch_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    return {_RENAME[k]: v for k, v in leaves.items()}


def _torch_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    out = {_BACK[k]: v for k, v in canonical.items() if k in _BACK}
    return {k: v for k, v in out.items() if not like or k in like}


def _torch_hyper(**extra: str):
    read = read_attributes(epsilon="eps", **extra)
    hf = read_attributes(epsilon="variance_epsilon")  # Hugging Face's RMSNorm classes

    def hyper(layer: Any) -> dict[str, Any]:
        out = {**hf(layer), **read(layer)}
        module = module_of(layer)
        if module is not None and hasattr(module, "elementwise_affine"):
            affine = module.elementwise_affine
            out["use_scale"] = affine
            out["use_bias"] = affine and getattr(module, "bias", None) is not None
        if module is not None and hasattr(module, "affine"):
            out["use_scale"] = out["use_bias"] = module.affine
        return out

    return hyper


def _torch_one_plus_weight(cls: Any, leaves: Leaves) -> bool:
    """A norm computing `x * (1 + weight)` (Gemma's): from a module by its class (a
    layer of a Hugging Face folder whose `config.json` names such a family has one);
    without a class, a 1-D `weight` alone may be one (the other side decides)."""
    if cls is not None and not one_plus_weight(cls):
        return False
    w = shape_of(leaves, "weight")
    return set(leaves) == {"weight"} and w is not None and len(w) == 1


# registered first: the last of a class-less weight's candidate kinds
GEMMA_RMS_NORM_TORCH = register_torch(
    "GemmaRMSNorm",
    _torch_one_plus_weight,
    _torch_decode,
    _torch_encode,
    _torch_hyper(),
    "torch weight",
    {},  # no entry is optional: its neutral weight is 0, not Flax's scale 1
)
LAYER_NORM_TORCH = register_torch(
    "LayerNorm",
    _torch_layer_norm,
    _torch_decode,
    _torch_encode,
    _torch_hyper(),
    "torch weight",
    _DEFAULTS,
)
RMS_NORM_TORCH = register_torch(
    "RMSNorm",
    _torch_rms_norm,
    _torch_decode,
    _torch_encode,
    _torch_hyper(),
    "torch weight",
    _DEFAULTS,
)


GROUP_NORM_TORCH = register_torch(
    "GroupNorm",
    _torch_group_norm,
    _torch_decode,
    _torch_encode,
    _torch_hyper(groups="num_groups"),
    "torch weight",
    _DEFAULTS,
)
