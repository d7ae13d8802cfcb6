"""Codec: `MultiHeadAttention` (Linen `nn.MultiHeadDotProductAttention`, NNX
`nnx.MultiHeadAttention`, Equinox `eqx.nn.MultiheadAttention`).

Canonical (Flax): `query/kernel`, `key/kernel`, `value/kernel` shape
`(in, heads, head_dim)` with biases `(heads, head_dim)`; `out/kernel` shape
`(heads, head_dim, out)` with bias `(out,)`. Equinox fuses the heads:
`query_proj/weight` shape `(heads * head_dim, in)`, bias `(heads * head_dim,)`,
`output_proj/weight` shape `(out, heads * head_dim)`. PyTorch's
`nn.MultiheadAttention`: `in_proj_weight (3E, E)` (or `q_proj_weight`,
`k_proj_weight`, `v_proj_weight` when `kdim`/`vdim` differ), `in_proj_bias (3E,)`,
`out_proj.weight (E, E)`, read through the Equinox layout; a state dict does not
record the number of heads: it is taken from the paired layer.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from flax import nnx

from .._codec import Codec, Leaves, of_class, register_codec, same, same_as_like
from ._torch import by_class, has_entries, module_of, register_torch


_PROJ = {"query": "query_proj", "key": "key_proj", "value": "value_proj"}
_DEFAULTS = {f"{p}/bias": 0.0 for p in ("query", "key", "value", "out")}


def _linen(cls, leaves: Leaves) -> bool:
    kernels = {f"{p}/kernel" for p in ("query", "key", "value", "out")}
    return kernels <= set(leaves) <= kernels | set(_DEFAULTS)


def _eqx_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    heads = hyper["heads"]
    out: Leaves = {}
    for flax_name, eqx_name in _PROJ.items():
        weight = leaves[f"{eqx_name}/weight"]
        out[f"{flax_name}/kernel"] = jnp.reshape(weight.T, (weight.shape[1], heads, -1))
        if f"{eqx_name}/bias" in leaves:
            out[f"{flax_name}/bias"] = jnp.reshape(
                leaves[f"{eqx_name}/bias"], (heads, -1)
            )
    weight = leaves["output_proj/weight"]
    out["out/kernel"] = jnp.reshape(weight.T, (heads, -1, weight.shape[0]))
    if "output_proj/bias" in leaves:
        out["out/bias"] = leaves["output_proj/bias"]
    return out


def _eqx_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    out: Leaves = {}
    for flax_name, eqx_name in _PROJ.items():
        kernel = canonical[f"{flax_name}/kernel"]
        out[f"{eqx_name}/weight"] = jnp.reshape(kernel, (kernel.shape[0], -1)).T
        if f"{eqx_name}/bias" in like:
            out[f"{eqx_name}/bias"] = jnp.reshape(canonical[f"{flax_name}/bias"], -1)
    kernel = canonical["out/kernel"]
    out["output_proj/weight"] = jnp.reshape(kernel, (-1, kernel.shape[-1])).T
    if "output_proj/bias" in like:
        out["output_proj/bias"] = canonical["out/bias"]
    return out


def _nnx_hyper(module: Any) -> dict[str, Any]:
    return {"heads": module.num_heads, "use_bias": module.use_bias}


def _eqx_hyper(module: Any) -> dict[str, Any]:
    flags = {
        module.use_query_bias,
        module.use_key_bias,
        module.use_value_bias,
        module.use_output_bias,
    }
    hyper: dict[str, Any] = {"heads": module.num_heads}
    if len(flags) == 1:
        hyper["use_bias"] = flags.pop()
    return hyper


def _eqx_build(canonical: Leaves, options) -> eqx.nn.MultiheadAttention:
    query, value = canonical["query/kernel"], canonical["value/kernel"]
    return eqx.nn.MultiheadAttention(
        num_heads=query.shape[1],
        query_size=query.shape[0],
        key_size=canonical["key/kernel"].shape[0],
        value_size=value.shape[0],
        output_size=canonical["out/kernel"].shape[-1],
        qk_size=query.shape[2],
        vo_size=value.shape[2],
        use_query_bias="query/bias" in canonical,
        use_key_bias="key/bias" in canonical,
        use_value_bias="value/bias" in canonical,
        use_output_bias="out/bias" in canonical,
        dtype=query.dtype,
        key=jax.random.key(0),
    )


MHA_LINEN = register_codec(
    Codec(
        "MultiHeadAttention",
        "linen",
        _linen,
        same,
        same_as_like,
        names=("MultiHeadDotProductAttention", "MultiHeadAttention", "SelfAttention"),
        defaults=_DEFAULTS,
    )
)
MHA_NNX = register_codec(
    Codec(
        "MultiHeadAttention",
        "nnx",
        of_class(nnx.MultiHeadAttention),
        same,
        same_as_like,
        _nnx_hyper,
        defaults=_DEFAULTS,
    )
)
MHA_EQUINOX = register_codec(
    Codec(
        "MultiHeadAttention",
        "equinox",
        of_class(eqx.nn.MultiheadAttention),
        _eqx_decode,
        _eqx_encode,
        _eqx_hyper,
        layout="fused heads (H*D, in)",
        defaults=_DEFAULTS,
        build=_eqx_build,
    )
)

# --- PyTorch: nn.MultiheadAttention --------------------------------------------------


_SEPARATE = ("q_proj_weight", "k_proj_weight", "v_proj_weight")
_MHA_OPTIONAL = {"in_proj_bias", "out_proj/bias"}


@by_class("MultiheadAttention")
def _torch_attention(leaves: Leaves) -> bool:
    fused = {"in_proj_weight", "out_proj/weight"}
    separate = {*_SEPARATE, "out_proj/weight"}
    return has_entries(leaves, fused, _MHA_OPTIONAL) or has_entries(
        leaves, separate, _MHA_OPTIONAL
    )


def _torch_hyper(layer: Any) -> dict[str, Any]:
    module = module_of(layer)
    if module is None:
        return {}
    return {"heads": module.num_heads, "use_bias": module.in_proj_bias is not None}


_FUSED = ("query_proj", "key_proj", "value_proj")  # Equinox's names, fused heads


def _torch_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
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
    return _eqx_decode(fused, {"heads": hyper.get("heads", 1)})


def _torch_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    biases = {f"{p}/bias": None for p in _FUSED if "query/bias" in canonical}
    if "out/bias" in canonical:
        biases["output_proj/bias"] = None
    fused = _eqx_encode(canonical, biases, hyper)
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


MHA_TORCH = register_torch(
    "MultiHeadAttention",
    _torch_attention,
    _torch_decode,
    _torch_encode,
    _torch_hyper,
    "torch fused in_proj (3E,E)",
    {f"{p}/bias": 0.0 for p in ("query", "key", "value", "out")},
)
