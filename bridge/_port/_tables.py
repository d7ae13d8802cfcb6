"""Arrays one side computes among a port's unpaired layers, told by their values:
stored sinusoidal position tables (`bridge._families._sinusoid`), alone or in a
stack of layers; and loose arrays holding what a model computes from its config
(`bridge._families._computed`: rotary inverse frequencies, position ids, a causal
mask).

A table is one 2-D float array whose values are one of the variants (finite: an
array holding NaN or inf is none). In a stack
(`nn.scan`, a layer axis), it is read per slice: a stack's layer (`Layer.index`)
holds its slice; a loose array of the module a stack's layers are in
(`.blocks.positions` beside `.blocks.proj[i]`, `(layers, positions, dim)`) is a
table only where that stack's layer axis and length are one (several stacks
disagreeing decide nothing) and every slice along it is one, of one variant
(`"halves, each of 3 layers"`). A slice that is not (a table trained in one
layer) leaves the array unexpected or missing: a
learned table is never dropped. Only concrete arrays are read (a file's are);
placeholders (`jax.ShapeDtypeStruct`) are none.
"""

from __future__ import annotations

from typing import Any

import jax

from .._families._computed import computed
from .._families._sinusoid import sinusoid
from .._lazy import materialise
from ._layer import ARRAY, Layer


def tables(lone: list[Layer], side: list[Layer]) -> dict[int, tuple[Layer, str]]:
    """`{id(layer): (layer, variant)}` for the unpaired layers `lone` (of one side,
    whose layers are `side`: its stacks' layer axes) that hold a stored sinusoidal
    position table."""
    axes = {(x.stack[0], x.axis, x.stack[1]) for x in side if x.stack is not None}
    out = {}
    for x in lone:
        if len(x.leaves) != 1:
            continue
        variant = _variant(x, axes)
        if variant is not None:
            out[id(x)] = (x, variant)
    return out


def _variant(x: Layer, axes: set[tuple[Any, int, int]]) -> str | None:
    if x.index is not None:  # one layer of a stack: its slice
        if x.arrays is None or any(_abstract(v) for v in x.arrays.values()):
            return None
        (leaf,) = x.own_leaves().values()
    else:
        (leaf,) = x.leaves.values()
    if _abstract(leaf):
        return None
    ndim = getattr(leaf, "ndim", None)
    if ndim == 2 or x.index is not None:
        found = sinusoid(materialise(leaf))
        return None if found is None else f"sinusoidal position table ({found})"
    if x.kinds == (ARRAY,) and x.index is None:
        found = computed(materialise(leaf))
        if found is not None:
            return found
    module = x.path[:-1]  # a loose array beside a stack's layers: per layer
    found = {(a, n) for path, a, n in axes if path[: len(module)] == module}
    if ndim != 3 or x.kinds != (ARRAY,) or len(found) != 1:
        return None
    ((axis, length),) = found
    if leaf.shape[axis] != length:
        return None
    stacked = materialise(leaf)
    found = {
        sinusoid(stacked[(slice(None),) * axis + (i,)])
        for i in range(stacked.shape[axis])
    }
    if len(found) != 1 or None in found:
        return None
    table = found.pop()
    return f"sinusoidal position table ({table}, each of {stacked.shape[axis]} layers)"


def _abstract(leaf: Any) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct)
