"""An array read from a file only when it is used: the source side of a port from a
PyTorch-layout checkpoint, so that memory holds the model being filled plus one shard
of the file, never the whole file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np


class LazyArray:
    """Shape and dtype now, values on `read()` (or `np.asarray`).

    `load()` returns the array (typically a view of a memory-mapped file); `order`
    ranks it for reading (its shard's position), so that a port reads one shard at a
    time. `read_runs`, when the file allows it, reads only some elements:
    `read_runs([(start, count), ...])` gives the elements `start ... start + count -
    1` of each run (C order), one after the other, as a 1-D array.
    """

    __slots__ = ("shape", "dtype", "order", "_load", "read_runs")

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: Any,
        order: int,
        load: Callable,
        read_runs: Callable[[list[tuple[int, int]]], np.ndarray] | None = None,
    ):
        self.shape = tuple(shape)
        self.dtype = jnp.dtype(dtype)
        self.order = order
        self._load = load
        self.read_runs = read_runs

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def read(self) -> np.ndarray:
        return self._load()

    def __array__(self, dtype=None, copy=None):
        array = self.read()
        return array if dtype is None else array.astype(dtype)

    def __repr__(self) -> str:
        return f"LazyArray({self.dtype}{list(self.shape)})"


def materialise(x: Any) -> Any:
    """`x` read, if it is a `LazyArray`."""
    return x.read() if isinstance(x, LazyArray) else x
