"""Codecs: every layer family in PyTorch layout (framework `"torch"`).

torch is never imported here: a layer is recognised by its class's name when the
Tree came from a `torch.nn.Module` (`nn.Linear`, `nn.Conv2d`, Hugging Face's
`Conv1D`, subclasses too), else (a state dict, a file) by its entries' names and
shapes, possibly as several candidate kinds that pairing narrows. `hyperparameters`
receive a `TorchNode` (`.module` or None, `.cls`, `.name`).

Layouts (canonical = Flax):

- `Dense`: `nn.Linear` weight `(out, in)` (transposed); Hugging Face `Conv1D`
  weight `(in, out)` (canonical already).
- `Conv`: `nn.Conv{1,2,3}d` weight `(O, I/groups, *k)` (OIHW), bias `(O,)`.
- `ConvTranspose`: `nn.ConvTranspose{1,2,3}d` weight `(I, O/groups, *k)`, applied
  flipped: canonical `kernel = flip(weight, k axes)` moved to `(*k, I, O)` (Flax's
  `ConvTranspose` with `transpose_kernel=False`; groups 1 only, as Flax's).
- `Embed`: `weight (num, dim)`; `LayerNorm`, `RMSNorm`, `GroupNorm`: `weight` ->
  `scale`; `BatchNorm`: `weight`, `bias`, `running_mean`, `running_var` -> `scale`,
  `bias`, `mean`, `var` (`num_batches_tracked` is a counter, never ported; PyTorch's
  `momentum` 0.1 is Flax's 0.9).
- `MultiHeadAttention`: `nn.MultiheadAttention` `in_proj_weight (3E, E)` (or
  `q_proj_weight`, `k_proj_weight`, `v_proj_weight` when `kdim`/`vdim` differ),
  `in_proj_bias (3E,)`, `out_proj.weight (E, E)`: heads split as Flax's
  `(in, heads, head_dim)`. A state dict does not record the number of heads: it is
  taken from the paired layer.
"""

from __future__ import annotations

import re
from typing import Any

import jax.numpy as jnp

from ..._families._gpt2 import CONV1D_NAMES
from .._codec import Codec, Leaves, register_codec
from ._attention import (
    _eqx_decode as _attention_eqx_decode,
    _eqx_encode as _attention_eqx_encode,
)
from ._conv import _padding


def _names(cls: Any) -> set[str]:
    """The names of the PyTorch (or Hugging Face) classes `cls` derives from."""
    return {
        c.__name__
        for c in getattr(cls, "__mro__", ())
        if c.__module__.startswith(("torch.nn", "transformers"))
    }


def _by_class(*names: str):
    """`recognise`: the class is (derives from) one of `names`; without a class,
    `fallback` decides by the entries."""

    def wrap(fallback):
        def recognise(cls: Any, leaves: Leaves) -> bool:
            if cls is not None:
                return bool(_names(cls) & set(names))
            return fallback(leaves)

        return recognise

    return wrap


def _shape(leaves: Leaves, name: str) -> tuple[int, ...] | None:
    x = leaves.get(name)
    return None if x is None else tuple(x.shape)


def _entries(leaves: Leaves, required: set[str], optional: set[str]) -> bool:
    return required <= set(leaves) <= required | optional


def _module(layer: Any) -> Any:
    return getattr(layer, "module", None)


def _read(**names: str):
    """`hyperparameters` reading module attributes (those present and not None)."""

    def read(layer: Any) -> dict[str, Any]:
        module = _module(layer)
        out = {}
        for key, attr in names.items():
            value = getattr(module, attr, None)
            if value is not None:
                out[key] = value
        return out

    return read


def _bias_flag(layer: Any, out: dict[str, Any]) -> dict[str, Any]:
    module = _module(layer)
    if module is not None and hasattr(module, "bias"):
        out["use_bias"] = module.bias is not None
    return out


# --- Dense: nn.Linear and Hugging Face Conv1D ------------------------------------


@_by_class("Linear", "Conv1D")
def _dense(leaves: Leaves) -> bool:
    w, b = _shape(leaves, "weight"), _shape(leaves, "bias")
    return (
        _entries(leaves, {"weight"}, {"bias"})
        and w is not None
        and len(w) == 2
        and (b is None or b in ((w[0],), (w[1],)))
    )


def _dense_hyper(layer: Any) -> dict[str, Any]:
    cls = getattr(layer, "cls", None)
    name = getattr(layer, "name", "")
    if cls is not None:
        conv1d = "Conv1D" in _names(cls)
    else:
        conv1d = name.rsplit(".", 1)[-1] in CONV1D_NAMES
    return _bias_flag(layer, {"conv1d": conv1d})


def _is_conv1d(leaves: Leaves, hyper: dict[str, Any]) -> bool:
    """`Conv1D` when the class (or, in a state dict, the name) says so, or when only
    its layout fits the bias."""
    w, b = _shape(leaves, "weight"), _shape(leaves, "bias")
    assert w is not None
    if b is not None and w[0] != w[1]:
        return b == (w[1],)
    return bool(hyper.get("conv1d"))


def _dense_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    w = leaves["weight"]
    out = {"kernel": w if _is_conv1d(leaves, hyper) else jnp.transpose(w)}
    if "bias" in leaves:
        out["bias"] = leaves["bias"]
    return out


def _dense_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    kernel = canonical["kernel"]
    conv1d = _is_conv1d(like, hyper) if like else bool(hyper.get("conv1d"))
    out = {"weight": kernel if conv1d else jnp.transpose(kernel)}
    if "bias" in canonical and (not like or "bias" in like):
        out["bias"] = canonical["bias"]
    return out


# --- Conv and ConvTranspose ------------------------------------------------------


@_by_class("Conv1d", "Conv2d", "Conv3d")
def _conv(leaves: Leaves) -> bool:
    w, b = _shape(leaves, "weight"), _shape(leaves, "bias")
    return (
        _entries(leaves, {"weight"}, {"bias"})
        and w is not None
        and 3 <= len(w) <= 5
        and (b is None or b == w[:1])
    )


@_by_class("ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d")
def _conv_transpose(leaves: Leaves) -> bool:
    w, b = _shape(leaves, "weight"), _shape(leaves, "bias")
    return (
        _entries(leaves, {"weight"}, {"bias"})
        and w is not None
        and 3 <= len(w) <= 5
        and (b is None or b == w[1:2])
    )


def _conv_hyper(layer: Any) -> dict[str, Any]:
    module = _module(layer)
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
    return _bias_flag(layer, out)


def _conv_transpose_hyper(layer: Any) -> dict[str, Any]:
    module = _module(layer)
    if module is None:
        return {}
    out = {"strides": tuple(module.stride)}
    if module.groups != 1:
        out["groups"] = module.groups
    return _bias_flag(layer, out)


def _conv_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    w = leaves["weight"]
    spatial = tuple(range(2, w.ndim))
    out = {"kernel": jnp.transpose(w, (*spatial, 1, 0))}
    if "bias" in leaves:
        out["bias"] = leaves["bias"]
    return out


def _conv_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    kernel = canonical["kernel"]
    n = kernel.ndim - 2
    out = {"weight": jnp.transpose(kernel, (n + 1, n, *range(n)))}
    if "bias" in canonical and (not like or "bias" in like):
        out["bias"] = canonical["bias"]
    return out


_GROUPED_TRANSPOSE = (
    "a grouped ConvTranspose (groups={groups}) has no Flax counterpart (Flax's "
    "ConvTranspose has no feature groups)"
)


def _conv_transpose_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    if hyper.get("groups", 1) != 1:
        raise ValueError(_GROUPED_TRANSPOSE.format(groups=hyper["groups"]))
    w = leaves["weight"]
    spatial = tuple(range(2, w.ndim))
    flipped = jnp.flip(w, spatial)
    out = {"kernel": jnp.transpose(flipped, (*spatial, 0, 1))}
    if "bias" in leaves:
        out["bias"] = leaves["bias"]
    return out


def _conv_transpose_encode(
    canonical: Leaves, like: Leaves, hyper: dict[str, Any]
) -> Leaves:
    kernel = canonical["kernel"]
    n = kernel.ndim - 2
    weight = jnp.transpose(kernel, (n, n + 1, *range(n)))
    out = {"weight": jnp.flip(weight, tuple(range(2, weight.ndim)))}
    if "bias" in canonical and (not like or "bias" in like):
        out["bias"] = canonical["bias"]
    return out


# --- Embedding and the norms -------------------------------------------------------


@_by_class("Embedding")
def _embed(leaves: Leaves) -> bool:
    w = _shape(leaves, "weight")
    return set(leaves) == {"weight"} and w is not None and len(w) == 2


def _affine(leaves: Leaves) -> bool:
    w, b = _shape(leaves, "weight"), _shape(leaves, "bias")
    return (
        _entries(leaves, set(), {"weight", "bias"})
        and bool(leaves)
        and all(s is None or len(s) == 1 for s in (w, b))
    )


_group_norm = _by_class("GroupNorm")(_affine)


def _norm_class(cls: Any, suffix: str) -> bool:
    """A norm written the Hugging Face way: a class (of any library) whose name ends
    in `suffix` (`LlamaRMSNorm`, `Qwen2RMSNorm`); Gemma's norms, which compute
    `x * (1 + weight)`, are not Flax's and are left to a codec of their own."""
    return any(
        c.__name__.endswith(suffix) and not c.__name__.startswith("Gemma")
        for c in getattr(cls, "__mro__", ())
    )


def _layer_norm(cls: Any, leaves: Leaves) -> bool:
    if cls is not None and not _norm_class(cls, "LayerNorm"):
        return False
    return _affine(leaves)


def _rms_norm(cls: Any, leaves: Leaves) -> bool:
    if cls is not None and not _norm_class(cls, "RMSNorm"):
        return False
    w = _shape(leaves, "weight")
    return set(leaves) == {"weight"} and w is not None and len(w) == 1


_RENAME = {"weight": "scale", "bias": "bias"}
_BACK = {"scale": "weight", "bias": "bias"}


def _norm_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    return {_RENAME[k]: v for k, v in leaves.items()}


def _norm_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    out = {_BACK[k]: v for k, v in canonical.items() if k in _BACK}
    return {k: v for k, v in out.items() if not like or k in like}


def _norm_hyper(**extra: str):
    read = _read(epsilon="eps", **extra)
    hf = _read(epsilon="variance_epsilon")  # Hugging Face's RMSNorm classes

    def hyper(layer: Any) -> dict[str, Any]:
        out = {**hf(layer), **read(layer)}
        module = _module(layer)
        if module is not None and hasattr(module, "elementwise_affine"):
            affine = module.elementwise_affine
            out["use_scale"] = affine
            out["use_bias"] = affine and getattr(module, "bias", None) is not None
        if module is not None and hasattr(module, "affine"):
            out["use_scale"] = out["use_bias"] = module.affine
        return out

    return hyper


# --- BatchNorm ---------------------------------------------------------------------


_STATS = {"running_mean": "mean", "running_var": "var"}


@_by_class("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm")
def _batch_norm(leaves: Leaves) -> bool:
    return _entries(
        leaves, {"running_mean", "running_var"}, {"weight", "bias"}
    ) and all(len(x.shape) == 1 for x in leaves.values())


def _batch_norm_hyper(layer: Any) -> dict[str, Any]:
    module = _module(layer)
    if module is None:
        return {}
    out: dict[str, Any] = {
        "epsilon": module.eps,
        "use_scale": module.affine,
        "use_bias": module.affine,
    }
    if module.momentum is not None:  # PyTorch's new-value weight; Flax's old-value
        out["momentum"] = round(1 - module.momentum, 12)
    return out


def _batch_norm_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    out = {_RENAME[k]: v for k, v in leaves.items() if k in _RENAME}
    out.update({_STATS[k]: v for k, v in leaves.items() if k in _STATS})
    return out


def _batch_norm_encode(
    canonical: Leaves, like: Leaves, hyper: dict[str, Any]
) -> Leaves:
    out = {_BACK[k]: v for k, v in canonical.items() if k in _BACK}
    out.update({k: canonical[v] for k, v in _STATS.items()})
    return {k: v for k, v in out.items() if not like or k in like}


# --- MultiheadAttention --------------------------------------------------------------


_SEPARATE = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
_MHA_OPTIONAL = {"in_proj_bias", "out_proj/bias"}


@_by_class("MultiheadAttention")
def _attention(leaves: Leaves) -> bool:
    fused = {"in_proj_weight", "out_proj/weight"}
    separate = {*_SEPARATE, "out_proj/weight"}
    return _entries(leaves, fused, _MHA_OPTIONAL) or _entries(
        leaves, separate, _MHA_OPTIONAL
    )


def _attention_hyper(layer: Any) -> dict[str, Any]:
    module = _module(layer)
    if module is None:
        return {}
    return {"heads": module.num_heads, "use_bias": module.in_proj_bias is not None}


_FUSED = ("query_proj", "key_proj", "value_proj")  # Equinox's names, fused heads


def _attention_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    # without the number of heads (a state dict), one head stands in for reading
    # shapes; the plan takes the paired layer's before any array moves. The layout
    # is Equinox's with q, k, v in one array: its codec splits the heads.
    if "in_proj_weight" in leaves:
        weights = jnp.split(leaves["in_proj_weight"], 3)
    else:
        weights = [leaves[name] for name in _SEPARATE]
    fused: Leaves = {f"{p}/weight": w for p, w in zip(_FUSED, weights)}
    if "in_proj_bias" in leaves:
        biases = jnp.split(leaves["in_proj_bias"], 3)
        fused.update({f"{p}/bias": b for p, b in zip(_FUSED, biases)})
    for entry in ("weight", "bias"):
        if f"out_proj/{entry}" in leaves:
            fused[f"output_proj/{entry}"] = leaves[f"out_proj/{entry}"]
    return _attention_eqx_decode(fused, {"heads": hyper.get("heads", 1)})


def _attention_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    biases = {f"{p}/bias": None for p in _FUSED if "query/bias" in canonical}
    if "out/bias" in canonical:
        biases["output_proj/bias"] = None
    fused = _attention_eqx_encode(canonical, biases, hyper)
    weights = [fused[f"{p}/weight"] for p in _FUSED]
    out: Leaves = {}
    if like and "q_proj_weight" in like:
        out.update(zip(_SEPARATE, weights))
    else:
        out["in_proj_weight"] = jnp.concatenate(weights, axis=0)
    if "query/bias" in canonical and (not like or "in_proj_bias" in like):
        out["in_proj_bias"] = jnp.concatenate([fused[f"{p}/bias"] for p in _FUSED])
    out["out_proj/weight"] = fused["output_proj/weight"]
    if "out/bias" in canonical and (not like or "out_proj/bias" in like):
        out["out_proj/bias"] = fused["output_proj/bias"]
    return out


# --- registration ------------------------------------------------------------------


def _register(kind, recognise, decode, encode, hyper, layout, defaults) -> Codec:
    return register_codec(
        Codec(kind, "torch", recognise, decode, encode, hyper, layout, (), defaults)
    )


_BIAS = {"bias": 0.0}
_AFFINE = {"scale": 1.0, "bias": 0.0}

DENSE_TORCH = _register(
    "Dense",
    _dense,
    _dense_decode,
    _dense_encode,
    _dense_hyper,
    "torch weight (out,in) or Conv1D (in,out)",
    _BIAS,
)
CONV_TORCH = _register(
    "Conv", _conv, _conv_decode, _conv_encode, _conv_hyper, "torch OIHW", _BIAS
)
CONV_TRANSPOSE_TORCH = _register(
    "ConvTranspose",
    _conv_transpose,
    _conv_transpose_decode,
    _conv_transpose_encode,
    _conv_transpose_hyper,
    "torch (I,O,*k) flipped",
    _BIAS,
)
EMBED_TORCH = _register(
    "Embed",
    _embed,
    lambda leaves, hyper: {"embedding": leaves["weight"]},
    lambda canonical, like, hyper: {"weight": canonical["embedding"]},
    lambda layer: {},
    "torch weight",
    {},
)
LAYER_NORM_TORCH = _register(
    "LayerNorm",
    _layer_norm,
    _norm_decode,
    _norm_encode,
    _norm_hyper(),
    "torch weight",
    _AFFINE,
)
RMS_NORM_TORCH = _register(
    "RMSNorm",
    _rms_norm,
    _norm_decode,
    _norm_encode,
    _norm_hyper(),
    "torch weight",
    _AFFINE,
)
GROUP_NORM_TORCH = _register(
    "GroupNorm",
    _group_norm,
    _norm_decode,
    _norm_encode,
    _norm_hyper(groups="num_groups"),
    "torch weight",
    _AFFINE,
)
BATCH_NORM_TORCH = _register(
    "BatchNorm",
    _batch_norm,
    _batch_norm_decode,
    _batch_norm_encode,
    _batch_norm_hyper,
    "torch running_mean/var",
    _AFFINE,
)
MHA_TORCH = _register(
    "MultiHeadAttention",
    _attention,
    _attention_decode,
    _attention_encode,
    _attention_hyper,
    "torch fused in_proj (3E,E)",
    {f"{p}/bias": 0.0 for p in ("query", "key", "value", "out")},
)


_EMBEDDING_NAME = re.compile(r"emb|^wte$|^wpe$|^shared$", re.IGNORECASE)
_TRANSPOSE_NAME = re.compile(r"transpose|deconv", re.IGNORECASE)


def kinds_by_name(name: str, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The kinds a class-less PyTorch-layout layer is read as, when several fit its
    arrays and no target decides (`bridge convert --to-layout`): a 2-D `weight`
    alone is an `Embed` when the layer's last name says so (`emb...`, `wte`, `wpe`,
    `shared`), else a `Dense`; a convolution is a `ConvTranspose` when its name
    says `transpose`/`deconv`, else a `Conv`."""
    last = name.rsplit(".", 1)[-1]
    out = list(kinds)
    if "Embed" in out and "Dense" in out:
        out.remove("Dense" if _EMBEDDING_NAME.search(last) else "Embed")
    if "Conv" in out and "ConvTranspose" in out:
        out.remove("Conv" if _TRANSPOSE_NAME.search(last) else "ConvTranspose")
    return tuple(out)
