"""Codec: `BatchNorm`, parameters and running statistics.

Canonical (Flax): `scale`, `bias` (params) and `mean`, `var` (batch_stats), shape
`(features,)`. Equinox keeps the statistics in `eqx.nn.State`; `bridge.from_equinox`
places them where their `StateIndex` sits, so the codec reads and writes:

- `mode="batch"`: `batch_state_index/0` and `/1` hold *hidden* statistics that
  inference divides by `1 - momentum**batch_counter` (1 when the counter is 0).
  Decoding divides the same way. Encoding stores the Flax statistics as they are and
  sets the counter to `2**30`, where `momentum**counter` is 0 in float32: inference
  uses the statistics unchanged, and further training updates them as Flax's
  exponential moving average would.
- `mode="ema"`: `ema_state_index/0` and `/1` are the statistics themselves;
  encoding sets `ema_first_time_index` to `False` so the next training step averages
  into them instead of replacing them.

PyTorch: `weight`, `bias`, `running_mean`, `running_var` -> `scale`, `bias`, `mean`,
`var` (`num_batches_tracked` is a counter, never ported; PyTorch's `momentum` 0.1 is
Flax's 0.9).
"""

from __future__ import annotations

import inspect
from typing import Any

import equinox as eqx
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
from ._torch import (
    SCALE_OF,
    WEIGHT_OF,
    by_class,
    has_entries,
    module_of,
    register_torch,
)


SETTLED_COUNTER = 2**30
"""`batch_counter` given to ported statistics: `momentum**2**30` is 0 in float32."""

_NO_STATE = """\
This Equinox BatchNorm has no running statistics in the Tree (found {found}). They live
in an eqx.nn.State: pass the model together with its state, `(model, state)`, as made by
`model, state = eqx.nn.make_with_state(Model)(...)`."""


_OLD_EQUINOX = """\
Porting an Equinox BatchNorm needs equinox >= 0.13.0 (BatchNorm(mode=...), with its
batch_state_index / ema_state_index statistics); the installed equinox is {installed}.
Upgrade equinox (pip install "equinox>=0.13.0"); every other layer ports with it."""


def check_equinox() -> None:
    """Raise `ImportError` if the installed equinox's BatchNorm has no `mode`."""
    if "mode" not in inspect.signature(eqx.nn.BatchNorm).parameters:
        raise ImportError(_OLD_EQUINOX.format(installed=eqx.__version__))


def _linen(cls, leaves: Leaves) -> bool:
    return {"mean", "var"} <= set(leaves) <= {"scale", "bias", "mean", "var"}


def _eqx_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    check_equinox()
    out = (
        {"scale": leaves["weight"], "bias": leaves["bias"]}
        if "weight" in leaves
        else {}
    )
    if "batch_state_index/0" in leaves:
        counter = leaves["batch_counter"]
        debias = jnp.where(counter == 0, 1, 1 - hyper["momentum"] ** counter)
        out["mean"] = leaves["batch_state_index/0"] / debias
        out["var"] = leaves["batch_state_index/1"] / debias
    elif "ema_state_index/0" in leaves:
        out["mean"] = leaves["ema_state_index/0"]
        out["var"] = leaves["ema_state_index/1"]
    else:
        raise ValueError(_NO_STATE.format(found=sorted(leaves)))
    return out


def _eqx_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    check_equinox()
    out = {}
    if "weight" in like:
        out["weight"], out["bias"] = canonical["scale"], canonical["bias"]
    if "batch_state_index/0" in like:
        settled = SETTLED_COUNTER if hyper["momentum"] < 1 else 0
        out["batch_counter"] = jnp.full_like(like["batch_counter"], settled)
        out["batch_state_index/0"] = canonical["mean"]
        out["batch_state_index/1"] = canonical["var"]
    elif "ema_state_index/0" in like:
        out["ema_first_time_index"] = jnp.zeros_like(like["ema_first_time_index"])
        out["ema_state_index/0"] = canonical["mean"]
        out["ema_state_index/1"] = canonical["var"]
    else:
        raise ValueError(_NO_STATE.format(found=sorted(like)))
    return out


def _eqx_hyper(module: Any) -> dict[str, Any]:
    return {
        "epsilon": module.eps,
        "momentum": module.momentum,
        "use_scale": module.channelwise_affine,
        "use_bias": module.channelwise_affine,
    }


def _eqx_build(canonical: Leaves, options) -> tuple[eqx.nn.BatchNorm, eqx.nn.State]:
    """An Equinox `BatchNorm` and its `State` (`options["batch_norm_mode"]`: `"batch"`,
    the default, or `"ema"`), with Flax's momentum 0.99."""
    check_equinox()
    mean = canonical["mean"]
    affine = "scale" in canonical or "bias" in canonical
    return eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        mean.shape[0],
        "batch",
        channelwise_affine=affine,
        momentum=0.99,
        mode=options.get("batch_norm_mode", "batch"),
        dtype=canonical.get("scale", mean).dtype,
    )


_DEFAULTS = {"bias": 0.0, "scale": 1.0}

BATCH_NORM_LINEN = register_codec(
    Codec(
        "BatchNorm",
        "linen",
        _linen,
        same,
        same_as_like,
        names=("BatchNorm",),
        defaults=_DEFAULTS,
    )
)
BATCH_NORM_NNX = register_codec(
    Codec(
        "BatchNorm",
        "nnx",
        of_class(nnx.BatchNorm),
        same,
        same_as_like,
        attributes(
            epsilon="epsilon",
            momentum="momentum",
            use_scale="use_scale",
            use_bias="use_bias",
        ),
        defaults=_DEFAULTS,
    )
)
BATCH_NORM_EQUINOX = register_codec(
    Codec(
        "BatchNorm",
        "equinox",
        of_class(eqx.nn.BatchNorm),
        _eqx_decode,
        _eqx_encode,
        _eqx_hyper,
        layout="stats in State",
        defaults=_DEFAULTS,
        build=_eqx_build,
    )
)

# --- PyTorch: nn.BatchNorm{1,2,3}d, nn.SyncBatchNorm ---------------------------------


_STATS = {"running_mean": "mean", "running_var": "var"}


@by_class("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm")
def _torch_batch_norm(leaves: Leaves) -> bool:
    return has_entries(
        leaves, {"running_mean", "running_var"}, {"weight", "bias"}
    ) and all(len(x.shape) == 1 for x in leaves.values())


def _torch_hyper(layer: Any) -> dict[str, Any]:
    module = module_of(layer)
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


def _torch_decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    out = {SCALE_OF[k]: v for k, v in leaves.items() if k in SCALE_OF}
    out.update({_STATS[k]: v for k, v in leaves.items() if k in _STATS})
    return out


def _torch_encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    out = {WEIGHT_OF[k]: v for k, v in canonical.items() if k in WEIGHT_OF}
    out.update({k: canonical[v] for k, v in _STATS.items()})
    return {k: v for k, v in out.items() if not like or k in like}


BATCH_NORM_TORCH = register_torch(
    "BatchNorm",
    _torch_batch_norm,
    _torch_decode,
    _torch_encode,
    _torch_hyper,
    "torch running_mean/var",
    {"scale": 1.0, "bias": 0.0},
)
