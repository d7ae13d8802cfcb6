"""A `DenseGeneral` layer seen as a `Dense` one: per-head kernels pair with fused ones.

`nnx.LinearGeneral(D, (H, hd))`, Linen `DenseGeneral` and Einsum kernels keep heads
apart (`(D, H, hd)`, an output projection `(H, hd, D)`, Gemma's `(H, D, hd)`);
PyTorch's `nn.Linear`, Equinox's `Linear` and Flax's `Dense` fuse them (`(D, H * hd)`
in Flax's layout). Both compute the same product once the kernel is transposed to
(input axes, output axes) and reshaped to `(prod(inputs), prod(outputs))`, so such a
layer is also a candidate of kind `Dense` whose codec does that (a `Reading`).

Which axes meet the input (the reading), in this order of evidence:

1. the forward pass on example inputs (`_trace.Contraction`): the axes the
   `dot_general` contracts, in the input's order, the others in the result's;
2. the module: `nnx.LinearGeneral`'s `in_features`, a `DenseGeneral` (NNX's class,
   a Linen auto-name): input axes first, as many as the bias leaves (it spans the
   outputs) or as the paired side's shapes allow;
3. otherwise (an `nn.Einsum`, a kernel whose module is not known) any axes can be
   the inputs: the readings whose fused shapes the other side has.

Where several readings remain (a kernel `(H, D, hd)` with `H = D`, `(D, H, hd)` with
`D = H * hd` and no module to say which is the input), the layer is `undecided` and a
port that uses the view is refused (`_errors.AXES`): example inputs decide.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp

from .._paths import Path
from ._codec import Codec, Leaves, same, same_as_like


class Reading(NamedTuple):
    """Which axes of a kernel are its inputs and outputs, each in the order the
    fused `(in, out)` kernel has them."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    def fused(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The `(in, out)` shape of a kernel of `shape` read this way."""
        return (
            math.prod(shape[a] for a in self.inputs),
            math.prod(shape[a] for a in self.outputs),
        )

    def words(self) -> str:
        return f"inputs {self.inputs}, outputs {self.outputs}"


_VIEWS: dict[tuple[str, Any], Codec] = {}


def _bias_order(outputs: tuple[int, ...]) -> tuple[int, ...]:
    """The bias spans the output axes in stored order: its axes in `outputs`' order."""
    ranked = sorted(outputs)
    return tuple(ranked.index(a) for a in outputs)


def embed_view(framework: str) -> Codec:
    """The `Embed` codec of a loose table of `framework` found by the computation
    (`_product.lookups`): `embedding (rows, features)`, as stored."""
    key = (framework, "Embed")
    if key not in _VIEWS:
        _VIEWS[key] = Codec(
            "Embed", framework, lambda cls, leaves: False, same, same_as_like
        )
    return _VIEWS[key]


def dense_view(framework: str, reading: Reading) -> Codec:
    """The `Dense` view of a per-head layer of `framework` read as `reading`:
    kernel transposed to `(*inputs, *outputs)` <-> `(prod(in), prod(out))`, bias
    `(*out)` <-> `(prod(out),)`."""
    key = (framework, reading)
    if key not in _VIEWS:
        order = reading.inputs + reading.outputs
        plain = order == tuple(range(len(order)))
        bias_order = _bias_order(reading.outputs)
        plain_bias = bias_order == tuple(range(len(bias_order)))
        undo = tuple(order.index(a) for a in range(len(order)))
        undo_bias = tuple(bias_order.index(a) for a in range(len(bias_order)))

        def decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
            kernel = leaves["kernel"]
            rows = math.prod(kernel.shape[a] for a in reading.inputs)
            if not plain:
                kernel = jnp.transpose(kernel, order)
            out = {"kernel": jnp.reshape(kernel, (rows, -1))}
            if "bias" in leaves:
                bias = leaves["bias"]
                if not plain_bias:
                    bias = jnp.transpose(bias, bias_order)
                out["bias"] = jnp.reshape(bias, (-1,))
            return out

        def encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
            shape = tuple(like["kernel"].shape)
            kernel = jnp.reshape(canonical["kernel"], tuple(shape[a] for a in order))
            out = {"kernel": kernel if plain else jnp.transpose(kernel, undo)}
            if "bias" in like and "bias" in canonical:
                bias_shape = tuple(like["bias"].shape)
                bias = jnp.reshape(
                    canonical["bias"], tuple(bias_shape[a] for a in bias_order)
                )
                out["bias"] = bias if plain_bias else jnp.transpose(bias, undo_bias)
            return out

        _VIEWS[key] = Codec(
            "Dense",
            framework,
            lambda cls, leaves: False,  # offered by `with_views`, never recognised
            decode,
            encode,
            layout=f"per-head kernel ({reading.words()}), fused",
            defaults={"bias": 0.0},
        )
    return _VIEWS[key]


def reading_of(codec: Codec) -> Reading | None:
    """The reading a `Dense` view makes (None: `codec` is not a view)."""
    for (_, reading), view in _VIEWS.items():
        if view is codec:
            return reading
    return None


def readings(leaves: Leaves, module: Any, inputs_first: bool) -> tuple[Reading, ...]:
    """The readings a per-head kernel allows, the likeliest first: a module's
    `in_features` says; else input axes first (`inputs_first`: a `DenseGeneral`),
    else any axes; a bias keeps those whose outputs have its shape."""
    shape = tuple(leaves["kernel"].shape)
    rank = len(shape)
    features = getattr(module, "in_features", None)
    if isinstance(features, tuple):
        k = len(features)
        return (Reading(tuple(range(k)), tuple(range(k, rank))),)
    found = [Reading(tuple(range(k)), tuple(range(k, rank))) for k in range(1, rank)]
    if not inputs_first:
        for k in range(1, rank):
            for chosen in itertools.combinations(range(rank), k):
                rest = tuple(a for a in range(rank) if a not in chosen)
                if Reading(chosen, rest) not in found:
                    found.append(Reading(chosen, rest))
    bias = leaves.get("bias")
    if bias is not None:
        found = [
            r for r in found if tuple(shape[a] for a in r.outputs) == tuple(bias.shape)
        ]
    return tuple(found)


def with_views(
    codecs: tuple[Codec, ...], leaves: Leaves, module: Any, inputs_first: bool
) -> tuple[tuple, tuple[Reading, ...]]:
    """`codecs` with the `Dense` view of a `DenseGeneral` candidate whose kernel has
    three axes or more (where no `Dense` candidate is there already), read the
    likeliest way, and every reading its shapes allow (see `readings`)."""
    kinds = {c.kind for c in codecs}
    kernel = leaves.get("kernel")
    if "DenseGeneral" not in kinds or "Dense" in kinds or kernel is None:
        return codecs, ()
    if len(kernel.shape) < 3:
        return codecs, ()
    found = readings(leaves, module, inputs_first)
    if not found:
        return codecs, ()
    framework = next(c.framework for c in codecs if c.kind == "DenseGeneral")
    return codecs + (dense_view(framework, found[0]),), found


class Choice(NamedTuple):
    """A per-head layer's reading, and where several remained, all of them."""

    reading: Reading
    undecided: tuple[Reading, ...] = ()
    traced: bool = False


def choose(
    shape: tuple[int, ...],
    found: tuple[Reading, ...],
    traced: Any,
    wanted: set[tuple[int, ...]],
    axis: int | None,
) -> Choice | None:
    """The reading of a kernel of `shape` (one layer's) allowing `found`: the
    forward pass's (`traced`, a `_trace.Contraction` of the stored array, whose
    layer axis is `axis` in a stack), else the only one, else those whose fused
    shape is among `wanted` (the other side's `Dense` kernels). None: the trace
    says the kernel is not one `Dense` product (a kernel applied per head)."""
    if traced is not None:
        if traced.batch:
            return None
        drop = (lambda a: a) if axis is None else (lambda a: a - (a > axis))
        reading = Reading(
            tuple(drop(a) for a in traced.inputs),
            tuple(drop(a) for a in traced.outputs),
        )
        if sorted(reading.inputs + reading.outputs) == list(range(len(shape))):
            return Choice(reading, traced=True)
    if len(found) == 1:
        return Choice(found[0])
    fitting = [r for r in found if r.fused(shape) in wanted] or list(found)
    distinct = {_moves(r, shape) for r in fitting}  # axes of length 1 move nothing
    return Choice(fitting[0], tuple(fitting) if len(distinct) > 1 else ())


def _moves(reading: Reading, shape: tuple[int, ...]) -> Reading:
    """`reading` without the axes of length 1 (readings equal but for them move
    the same elements)."""
    return Reading(
        tuple(a for a in reading.inputs if shape[a] != 1),
        tuple(a for a in reading.outputs if shape[a] != 1),
    )


Decide = Callable[[Path], Any]
"""The traced `Contraction` of a leaf path (None: not traced there)."""


def kernel_path(x: Any) -> Path:
    """The stored path of a layer's kernel (a stack's: its arrays' path)."""
    base = x.real if x.index is not None else x.path
    return base + x.paths.get("kernel", ("kernel",))


def wanted_shapes(layers: list[Any]) -> set[tuple[int, ...]]:
    """The `(in, out)` kernel shapes of a side's `Dense` layers."""
    out = set()
    for x in layers:
        spec: Mapping[str, Any] | None = x.specs.get("Dense")
        if spec is not None and "kernel" in spec:
            out.add(tuple(spec["kernel"].shape))
    return out
