"""A `DenseGeneral` layer seen as a `Dense` one: per-head kernels pair with fused ones.

`nnx.LinearGeneral(D, (H, hd))`, Linen `DenseGeneral` and Einsum-style kernels keep
heads apart (`(D, H, hd)`, an output projection `(H, hd, D)`); PyTorch's `nn.Linear`,
Equinox's `Linear` and Flax's `Dense` fuse them (`(D, H * hd)` in Flax's layout).
Both compute the same product once the kernel is reshaped to `(prod(in axes),
prod(out axes))`, so a DenseGeneral layer is also a candidate of kind `Dense` whose
codec reshapes (a view: no copy). Which axes are the inputs: the module's
`in_features` (NNX), else the bias (it spans the output axes), else Flax's default
`axis=-1` (one input axis); a wrong split gives shapes that differ from the paired
layer's, which the plan refuses.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

from ._codec import Codec, Leaves


_VIEWS: dict[tuple[str, int], Codec] = {}


def dense_view(framework: str, inputs: int) -> Codec:
    """The `Dense` view of a `DenseGeneral` layer of `framework` whose kernel has
    `inputs` leading input axes: kernel `(*in, *out)` <-> `(prod(in), prod(out))`,
    bias `(*out)` <-> `(prod(out),)`."""
    key = (framework, inputs)
    if key not in _VIEWS:

        def decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
            kernel = leaves["kernel"]
            rows = math.prod(kernel.shape[:inputs])
            out = {"kernel": jnp.reshape(kernel, (rows, -1))}
            if "bias" in leaves:
                out["bias"] = jnp.reshape(leaves["bias"], (-1,))
            return out

        def encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
            return {
                k: jnp.reshape(canonical[k], like[k].shape)
                for k in ("kernel", "bias")
                if k in like and k in canonical
            }

        _VIEWS[key] = Codec(
            "Dense",
            framework,
            lambda cls, leaves: False,  # offered by `with_views`, never recognised
            decode,
            encode,
            layout=f"per-head kernel, {inputs} input axis(es), fused",
            defaults={"bias": 0.0},
        )
    return _VIEWS[key]


def view_inputs(codec: Codec) -> int | None:
    """The input axes a `Dense` view assumes (None: `codec` is not a view)."""
    for (_, inputs), view in _VIEWS.items():
        if view is codec:
            return inputs
    return None


def with_views(codecs: tuple[Codec, ...], leaves: Leaves, module: Any) -> tuple:
    """`codecs` with the `Dense` view of a `DenseGeneral` candidate whose kernel has
    three axes or more (where no `Dense` candidate is there already)."""
    kinds = {c.kind for c in codecs}
    kernel = leaves.get("kernel")
    if "DenseGeneral" not in kinds or "Dense" in kinds or kernel is None:
        return codecs
    if len(kernel.shape) < 3:
        return codecs
    features = getattr(module, "in_features", None)
    bias = leaves.get("bias")
    if isinstance(features, tuple):
        inputs = len(features)
    elif bias is not None:
        inputs = len(kernel.shape) - len(bias.shape)
    else:
        inputs = 1
    framework = next(c.framework for c in codecs if c.kind == "DenseGeneral")
    return codecs + (dense_view(framework, inputs),)
