"""Loose arrays one side holds that the other side's model computes at build and
keeps out of its state, told by their values.

transformers' Gemma 3 multiplies its embedding lookup by `embed_scale`
(`sqrt(hidden)`), a non-persistent buffer: no state dict holds it, so it fills no
array and takes none. bonsai's Gemma 3 keeps the same constant as a plain array
beside its embedding (`embed_tokens.embed_scale`). Where the other side's model is
at hand (a `torch.nn.Module`, not a file), its adapter lists such constants with
their values (`Adapter.constants`). An unpaired loose array is such a constant when
the other side holds one of the same name, in the module (or a module around the
layer) that a layer of the array's module is paired with, and of equal value (shape
and every element): then both computations use the same number, and the array
needs no source (the target keeps it) and goes nowhere (not written). A value that
differs, a name found nowhere, or several candidates leave the array `missing` or
`unexpected`, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .._lazy import materialise
from .._paths import Path
from ._layer import ARRAY, Layer
from ._pairing import Pair
from ._side import Side


def constants(
    pairs: list[Pair], lone: tuple[list[Layer], list[Layer]], sides: tuple[Side, Side]
) -> dict[int, Layer]:
    """`{id(layer): layer}` for the unpaired loose arrays of either side (`lone`:
    source's, target's) that are a constant the other side's model holds outside
    its state, with the same value.

    Example: bonsai's `.embed_tokens.embed_scale` `()` = 4.0 beside its paired
    `.embed_tokens.weight`, whose source layer `model.embed_tokens` holds the
    buffer `embed_scale` = 4.0."""
    out: dict[int, Layer] = {}
    for side in (0, 1):
        if not lone[side] or not any(x.kinds == (ARRAY,) for x in lone[side]):
            continue
        held = sides[1 - side].constants
        if not held:
            continue
        for x in lone[side]:
            if _is_constant(x, pairs, side, held):
                out[id(x)] = x
    return out


def _is_constant(
    x: Layer, pairs: list[Pair], side: int, held: Mapping[Path, Any]
) -> bool:
    if x.kinds != (ARRAY,) or x.index is not None or len(x.path) < 2:
        return False
    (leaf,) = x.leaves.values()
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return False
    module, name = x.path[:-1], x.path[-1]
    # the other side's layers paired with a layer in `module`
    across = [
        (p.source, p.target)[1 - side].path
        for p in pairs
        if (p.source, p.target)[side].path[: len(module)] == module
    ]
    found = {
        path
        for path in held
        if path[-1] == name
        and len(path) > 1
        and any(c[: len(path) - 1] == path[:-1] for c in across)
    }
    if len(found) != 1:
        return False
    (path,) = found
    value = np.asarray(materialise(leaf))
    other = held[path]
    if value.shape != other.shape:
        return False
    if np.issubdtype(value.dtype, np.floating) or value.dtype.kind == "V":
        value = value.astype(np.float64)
    return bool(np.array_equal(value, other))
