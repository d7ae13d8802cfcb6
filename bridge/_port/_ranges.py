"""Each process reads only what its devices hold: a layer read from a file (a
`LazyArray` that reads element runs) into a target whose arrays are sharded over the
devices of several processes (`jax.distributed`) is converted without reading the
whole layer.

Which source elements each target element comes from is found by converting the
element *numbers* instead of the values (codecs only move elements: transposes,
reshapes, splits, concatenations), and checked by converting them again shifted:
a codec that computes with its values (a sum, a scale, a filled default) shifts
otherwise, and the layer is then read whole as before. Each process then reads the
runs of elements that its devices' blocks need, each run once, as byte ranges of the
file (a block along a later axis of the stored array: one range per row), and builds
its shards from them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from .._lazy import LazyArray
from .._placement import sharding_of


_FIRST = 2  # element numbers start here: a filled default (0, 1) is no element
_SHIFT = 1 << 20  # the second numbering's offset


def converted_by_ranges(
    leaves: Mapping[str, Any],
    convert: Callable[[dict[str, Any]], dict[str, Any]],
    targets: Mapping[str, Any],
    where: Callable[[str], str],
) -> dict[str, jax.Array] | None:
    """The converted target arrays of one layer, each process reading only the
    elements its devices hold; None where this does not apply (the layer is then read
    whole): a source array not read by runs, a target array not sharded over several
    processes, a conversion that is not an element move.

    **Arguments:**

    - `leaves`: the layer's source arrays, `LazyArray`s.
    - `convert`: `convert(arrays) -> {entry: array}`, the layer's conversion.
    - `targets`: the target's leaves by entry (their shardings are asked for).
    - `where`: the path of an entry, for messages.
    """
    if not leaves or not all(
        isinstance(v, LazyArray) and v.read_runs is not None for v in leaves.values()
    ):
        return None
    shardings: dict[str, Sharding] = {}
    for k, v in targets.items():
        sharding = sharding_of(v, where(k))
        if sharding is None or sharding.is_fully_addressable:
            return None
        shardings[k] = sharding
    total = _FIRST + sum(v.size for v in leaves.values()) + _SHIFT
    if total >= 2**31:
        return None
    try:
        abstract = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in leaves.items()
        }
        shapes = jax.eval_shape(convert, abstract)
        numbers = _numbers(leaves, 0)
        moved = {k: np.asarray(v) for k, v in convert(numbers).items()}
        shifted = {
            k: np.asarray(v) for k, v in convert(_numbers(leaves, _SHIFT)).items()
        }
    except jax.errors.JAXTypeError:  # a codec that needs concrete values
        return None
    if set(moved) != set(shardings):
        return None
    for k, index in moved.items():
        if (
            index.shape != shapes[k].shape
            or not np.array_equal(shifted[k], index + _SHIFT)
            or np.any(index < _FIRST)
        ):
            return None
    bounds = np.cumsum([_FIRST] + [v.size for v in leaves.values()])
    out = {}
    for k, sharding in shardings.items():
        index = moved[k].astype(np.int64)
        blocks = sharding.addressable_devices_indices_map(index.shape)
        wanted = np.unique(np.concatenate([index[i].ravel() for i in blocks.values()]))
        values = _read(wanted, bounds, list(leaves.values()))
        dtype = shapes[k].dtype
        arrays = [
            jax.device_put(values[np.searchsorted(wanted, index[i])].astype(dtype), d)
            for d, i in blocks.items()
        ]
        out[k] = jax.make_array_from_single_device_arrays(index.shape, sharding, arrays)
    return out


def _numbers(leaves: Mapping[str, Any], shift: int) -> dict[str, Any]:
    """Each source element's number (from `_FIRST + shift`, entry after entry)."""
    out, start = {}, _FIRST + shift
    for k, v in leaves.items():
        out[k] = jnp.arange(start, start + v.size, dtype=jnp.int32).reshape(v.shape)
        start += v.size
    return out


def _read(wanted: np.ndarray, bounds: np.ndarray, leaves: list[LazyArray]) -> Any:
    """The elements numbered `wanted` (sorted, unique), read as runs of consecutive
    elements of each source array."""
    pieces = []
    for j, leaf in enumerate(leaves):
        lo, hi = np.searchsorted(wanted, [bounds[j], bounds[j + 1]])
        local = wanted[lo:hi] - bounds[j]
        if not local.size:
            continue
        breaks = np.flatnonzero(np.diff(local) != 1) + 1
        starts = np.concatenate([[0], breaks])
        ends = np.concatenate([breaks, [local.size]])
        runs = [(int(local[a]), int(b - a)) for a, b in zip(starts, ends)]
        assert leaf.read_runs is not None
        pieces.append(leaf.read_runs(runs))
    return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
