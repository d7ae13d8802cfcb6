"""`compare`: the largest output difference of two models of any frameworks, as a
`Comparison` (a float) that also tells, when looked at, the difference layer by layer
along the model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._adapters._native import check_model, infer, says_channel_first
from .._arguments import check_bool, check_mapping, check_pair
from .._display._compare import (
    comparison_html,
    comparison_text,
    comparison_treescope,
)
from ._layerwise import difference, layer_outputs
from ._planning import port_plan


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
) -> Comparison:
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

    A `bridge.Comparison`: a python float, `max |a(*inputs) - b(*inputs)|` over
    every output array, which also says layer by layer where the two models part
    when looked at (its `layers`, its repr in a terminal, its HTML in Jupyter).

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
    run = _Run(a, b, inputs, channel_first, per_side, dict(call_kwargs))
    return Comparison(largest_difference(leaves_a, leaves_b), run)


class _Run(NamedTuple):
    """What `compare` ran, kept for the differences layer by layer (computed when
    first asked)."""

    a: Any
    b: Any
    inputs: tuple[Any, ...]
    channel_first: tuple[bool, bool] | None
    per_side: tuple[Mapping[str, Any], Mapping[str, Any]] | None
    kwargs: dict[str, Any]


class Layer(NamedTuple):
    """One pair of layers of a `Comparison`: their paths in `a` and `b` and the
    largest difference of their outputs (None where their layouts cannot be
    compared: a fused layer against its parts)."""

    a: str
    b: str
    difference: float | None


class Comparison(float):
    """The largest absolute difference of two models' outputs (`bridge.compare`'s):
    a float, compared and formatted as one, which also tells where the two models
    part.

    **Attributes:**

    - `layers`: tuple of `Layer(a, b, difference)`, one per pair of layers (paired
      as `bridge.port_plan(a, b, example=inputs)` pairs them, else by path), in the
      order model `a`'s forward pass computes them: the first large difference is
      the first layer where the two ports part. Computed when first read (the
      forward passes traced and run again: a second or so); empty where a model
      cannot be traced by JAX (a PyTorch module), and `why` says so.
    - `why`: why `layers` is empty, or "".

    `repr` shows the largest difference, a sparkline of the differences along the
    model and the first layer above `tolerance` (one screen); in Jupyter, a table
    and a plot; `float(c)` is the number.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, bridge
    >>> from flax import nnx
    >>> rngs = nnx.Rngs(0)
    >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs))
    >>> c = bridge.compare(model, model, jnp.ones((4, 2)))
    >>> c == 0.0, [layer.difference for layer in c.layers]
    (True, [0.0, 0.0])

    ```
    """

    _run: _Run | None
    _layers: tuple[tuple[Layer, ...], str] | None

    def __new__(cls, value: float, run: _Run | None = None) -> Comparison:
        self = super().__new__(cls, value)
        self._run, self._layers = run, None
        return self

    @property
    def layers(self) -> tuple[Layer, ...]:
        return self._by_layer()[0]

    @property
    def why(self) -> str:
        return self._by_layer()[1]

    def _by_layer(self) -> tuple[tuple[Layer, ...], str]:
        if self._layers is None:
            self._layers = (), "not run" if self._run is None else ""
            if self._run is not None:
                self._layers = by_layer(self._run)
        return self._layers

    def __reduce__(self) -> Any:
        return (float, (float(self),))

    __str__ = float.__repr__

    def __repr__(self) -> str:
        return comparison_text(self)

    _repr_html_ = comparison_html
    __treescope_repr__ = comparison_treescope


_UNTRACED = (
    "layer by layer needs both forward passes traced by JAX ({error}); the outputs "
    "alone were compared"
)


def by_layer(run: _Run) -> tuple[tuple[Layer, ...], str]:
    """Each pair of layers of `run`'s two models with the largest difference of
    their outputs, in the order model `a` computes them; or none and why."""
    firsts = run.channel_first or (
        says_channel_first(run.a),
        says_channel_first(run.b),
    )
    sides = run.per_side or ({}, {})
    found = []
    for model, kwargs, first in zip((run.a, run.b), sides, firsts, strict=True):
        merged = {**run.kwargs, **kwargs}

        def call(native: Any, xs: list[Any], merged=merged, first=first) -> Any:
            return infer(native, tuple(xs), merged, first)

        try:
            found.append(layer_outputs(model, call, run.inputs))
        except Exception as error:  # a framework JAX does not trace (PyTorch)
            return (), _UNTRACED.format(error=f"{type(error).__name__}: {error}"[:200])
    outs_a, outs_b = found
    pairs = _pairs(run, outs_a, outs_b)
    layers = tuple(
        Layer(la, lb, difference(outs_a[la].value, outs_b[lb].value))
        for la, lb in pairs
    )
    return layers, ""


def _pairs(run: _Run, outs_a: Mapping[str, Any], outs_b: Mapping[str, Any]) -> list:
    """The pairs of layers of `a` and `b` whose outputs both passes kept, in `a`'s
    order: as the port plan pairs them, else by path."""
    try:
        plan = port_plan(run.a, run.b, example=run.inputs)
        by_source = {s.source: s.target for s in plan.steps}
    except Exception:  # models the plan cannot pair: by path alone
        by_source = {}
    return [
        (la, by_source.get(la, la)) for la in outs_a if by_source.get(la, la) in outs_b
    ]


def outputs(
    a: Any,
    b: Any,
    inputs: tuple[Any, ...],
    channel_first: tuple[bool, bool] | None,
    per_side: tuple[Mapping[str, Any], Mapping[str, Any]] | None,
    call_kwargs: Mapping[str, Any],
    matched: bool = False,
) -> tuple[list[Any], list[Any]]:
    """Both models' output arrays on `inputs`, checked to have the same shapes.
    With `matched`, outputs of other structures are compared where they agree:
    each array of the side with fewer is matched with the first one left of the
    other side of its shape (a transformers `ModelOutput`'s `last_hidden_state`
    beside its `pooler_output`, against a model returning the hidden states)."""
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
    if shapes_a != shapes_b and matched:
        leaves_a, leaves_b = _matched(leaves_a, leaves_b)
    elif shapes_a != shapes_b:
        raise ValueError(_OUTPUTS_DIFFER.format(a=shapes_a, b=shapes_b))
    return leaves_a, leaves_b


def _matched(a: list[Any], b: list[Any]) -> tuple[list[Any], list[Any]]:
    """`(a, b)` cut to pairs of one shape (see `outputs`); `ValueError` where an
    array of the side with fewer has none of its shape left on the other."""
    few, many = (a, b) if len(a) <= len(b) else (b, a)
    left = list(many)
    picked = []
    for x in few:
        shape = tuple(jnp.shape(x))
        y = next((y for y in left if tuple(jnp.shape(y)) == shape), None)
        if y is None:
            shapes = [tuple(jnp.shape(v)) for v in many]
            raise ValueError(_OUTPUTS_DIFFER.format(a=[shape], b=shapes))
        left.remove(y)
        picked.append(y)
    return (few, picked) if few is a else (picked, few)


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
