"""`compare`: the largest output difference of two models of any frameworks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._adapters._native import check_model, infer, says_channel_first
from .._arguments import check_bool, check_mapping, check_pair


_OUTPUTS_DIFFER = """\
The two models' outputs do not have the same structure: {a} and {b}. Compare models
that compute the same function (and mind channel order: see `channel_first`)."""

_FAILED = """\
bridge.compare ran model `{side}` on inputs of shapes {shapes} and it failed (above).
Both models get the same batched, channel-last inputs, as Flax takes them.{hint}
If the models take different arguments, give each its own: per_side=({{...}}, {{...}})
for keyword arguments."""

_NO_INPUTS = """\
bridge.compare(a, b, *inputs) runs both models on the same inputs, and none were
given: pass them after the two models, batched and channel-last as Flax takes them,
e.g. bridge.compare(a, b, x), or as keyword arguments (bridge.compare(a, b,
input_ids=ids))."""

_CHANNELS = """
If model `{side}` takes channels first (an Equinox or PyTorch-style convolution, `(C,
H, W)` per example), say so: channel_first={pair}, or a class attribute
`channel_first = True` on the model."""


def compare(
    a: Any,
    b: Any,
    *inputs: Any,
    channel_first: tuple[bool, bool] | None = None,
    per_side: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None,
    **call_kwargs: Any,
) -> float:
    """The largest absolute difference between two models' outputs on the same inputs,
    whatever their frameworks: the check to run after `bridge.port`.

    Each model runs as its framework runs it for inference:

    - Linen `(module, variables)` or a bound module: `module.apply(variables, *inputs,
      **kwargs)` (pass its flags as keyword arguments: `train=False`);
    - NNX: a clone of the module in `.eval()` mode (BatchNorm uses its running
      statistics, Dropout is off), called on the batch;
    - Equinox `model` or `(model, state)`: `eqx.nn.inference_mode(model)`, vmapped over
      the leading (batch) axis of every input, called as `model(*x)` or
      `model(*x, state)[0]`;
    - a `bridge.Tree`: its native model, as above.

    Inputs are batched and channel-last, as Flax takes them. A model (such as an
    Equinox model of convolutions) that says `channel_first = True` (a class
    attribute or field), or whose entry in `channel_first` is True, gets each input
    of rank >= 3 with its last axis moved to axis 1 (`(N, H, W, C)` -> `(N, C, H, W)`,
    so each example is `(C, H, W)`), and its outputs of rank >= 3 moved back.

    **Arguments:**

    - `a`, `b`: the two models.
    - `*inputs`: the batched inputs, passed to both.
    - `channel_first`: optional `(for a, for b)`, overriding the models' own
      `channel_first` attribute.
    - `per_side`: optional `(keyword arguments for a, for b)`, for models whose
      call signatures differ (`({"train": False}, {})`).
    - `**call_kwargs`: keyword arguments passed to both (`train=False`).

    **Returns:**

    A python float: `max |a(*inputs) - b(*inputs)|` over every output array.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, equinox as eqx, bridge
    >>> from flax import nnx
    >>> source = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> target = bridge.port(source, eqx.nn.Linear(2, 3, key=jax.random.key(1)))
    >>> bridge.compare(source, target, jnp.ones((4, 2))) < 1e-6
    True

    ```
    """
    check_model(a, "a")
    check_model(b, "b")
    check_pair(channel_first, "channel_first", "a pair (for a, for b)", check_bool)
    check_pair(per_side, "per_side", "a pair of dicts (for a, for b)", check_mapping)
    if not inputs and not call_kwargs and not any(per_side or ()):
        raise TypeError(_NO_INPUTS)
    leaves_a, leaves_b = outputs(a, b, inputs, channel_first, per_side, call_kwargs)
    return largest_difference(leaves_a, leaves_b)


def outputs(
    a: Any,
    b: Any,
    inputs: tuple[Any, ...],
    channel_first: tuple[bool, bool] | None,
    per_side: tuple[Mapping[str, Any], Mapping[str, Any]] | None,
    call_kwargs: Mapping[str, Any],
) -> tuple[list[Any], list[Any]]:
    """Both models' output arrays on `inputs`, checked to have the same shapes."""
    if channel_first is None:
        channel_first = (
            says_channel_first(a),
            says_channel_first(b),
        )
    sides = per_side or ({}, {})
    out_a, out_b = (
        _run(side, model, inputs, {**call_kwargs, **kwargs}, first, channel_first)
        for side, model, kwargs, first in zip(
            "ab", (a, b), sides, channel_first, strict=True
        )
    )
    leaves_a, leaves_b = (
        jax.tree_util.tree_leaves(out_a),
        jax.tree_util.tree_leaves(out_b),
    )
    shapes_a = [tuple(jnp.shape(x)) for x in leaves_a]
    shapes_b = [tuple(jnp.shape(x)) for x in leaves_b]
    if shapes_a != shapes_b:
        raise ValueError(_OUTPUTS_DIFFER.format(a=shapes_a, b=shapes_b))
    return leaves_a, leaves_b


def _run(
    side: str,
    model: Any,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    first: bool,
    channel_first: tuple[bool, bool],
) -> Any:
    """`forward` for one side of `compare`, its shape errors told what to try."""
    try:
        return infer(model, inputs, kwargs, first)
    except (TypeError, ValueError) as error:
        if "shape" not in str(error).lower() and "dimension" not in str(error).lower():
            raise
        hint = ""
        if any(jnp.ndim(x) >= 3 for x in inputs):
            flipped = list(channel_first)
            flipped["ab".index(side)] = not first
            hint = _CHANNELS.format(side=side, pair=tuple(flipped))
        shapes = [tuple(jnp.shape(x)) for x in inputs]
        error.add_note(_FAILED.format(side=side, shapes=shapes, hint=hint))
        raise


def largest_difference(leaves_a: list[Any], leaves_b: list[Any]) -> float:
    return max(
        (
            float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
            for x, y in zip(leaves_a, leaves_b)
            if np.size(x)
        ),
        default=0.0,
    )


_TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def tolerance(leaves: list[Any]) -> tuple[float, str]:
    """The difference allowed between two models' outputs `leaves` (one side's),
    for their least precise floating dtype, relative to their largest magnitude
    (at least 1): `(tolerance, dtype name)`."""
    names = [str(jnp.result_type(x)) for x in leaves]
    floats = [n for n in names if n in _TOLERANCE] or ["float32"]
    dtype = max(floats, key=lambda n: _TOLERANCE[n])
    scale = max(
        (
            float(np.max(np.abs(np.asarray(x, np.float64))))
            for x in leaves
            if np.size(x)
        ),
        default=1.0,
    )
    return _TOLERANCE[dtype] * max(1.0, scale), dtype
