"""An array read from a file only when it is used: the source side of a port from a
PyTorch-layout checkpoint, so that memory holds the model being filled plus one shard
of the file, never the whole file.

`ReadAhead` reads the next arrays of a port in a thread while the port converts the
current one (a read is a `preadv`, a conversion mostly XLA's host copy: both let go of
the GIL), with a bounded number of bytes read ahead. `read_early` starts reading the
first shards' arrays in a thread before the port is planned (`bridge.load` of a
lazily read file), so that the reads and the planning share the machine's cores.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._progress import advance


class LazyArray:
    """Shape and dtype now, values on `read()` (or `np.asarray`).

    `load()` returns the array (typically a view of a memory-mapped file); `order`
    ranks it for reading (its shard's position), so that a port reads one shard at a
    time. `read_runs`, when the file allows it, reads only some elements:
    `read_runs([(start, count), ...])` gives the elements `start ... start + count -
    1` of each run (C order), one after the other, as a 1-D array. `plain`: `load`
    is a file read alone (NumPy, no JAX: no thread-local JAX setting applies), so
    `ReadAhead` may run it in another thread.
    """

    __slots__ = (
        "shape",
        "dtype",
        "order",
        "_load",
        "read_runs",
        "plain",
        "_ahead",
        "size",
        "nbytes",
        "_counted",
    )

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: Any,
        order: int,
        load: Callable,
        read_runs: Callable[[list[tuple[int, int]]], np.ndarray] | None = None,
        plain: bool = False,
    ):
        self.shape = tuple(shape)
        self.dtype = jnp.dtype(dtype)
        self.order = order
        self._load = load
        self.read_runs = read_runs
        self.plain = plain
        self._ahead: concurrent.futures.Future | None = None  # `ReadAhead`'s read
        self.size = math.prod(int(n) for n in self.shape)  # asked for per row of a port
        self.nbytes = self.size * self.dtype.itemsize
        self._counted = False  # its bytes counted for a progress display

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def read(self) -> np.ndarray:
        """The array: read now, or the read `ReadAhead` started (once: a second
        `read` reads again). A `plain` array (a file's bytes) counts its bytes for a
        progress display (`bridge._progress.advance`), on its first read only."""
        ahead, self._ahead = self._ahead, None
        array = self._load() if ahead is None else ahead.result()
        if self.plain and not self._counted:
            self._counted = True
            advance(self.nbytes)
        return array

    def __array__(self, dtype=None, copy=None):
        array = self.read()
        return array if dtype is None else array.astype(dtype)

    def __repr__(self) -> str:
        return f"LazyArray({self.dtype}{list(self.shape)})"


def materialise(x: Any) -> Any:
    """`x` read, if it is a `LazyArray`."""
    return x.read() if isinstance(x, LazyArray) else x


class ReadAhead:
    """Reads the arrays of a port's rows in a thread, ahead of the row that uses
    them. `rows[i]` is what row `i` reads; before converting row `i` the port calls
    `reached(i)`, which starts the reads of the next rows while the arrays read
    ahead and not used yet stay under `budget` bytes (their memory is the peak's
    excess), and drops what a passed row read ahead and did not use. A `with` block
    waits for the reads under way on leaving (the files are closed after) and drops
    what no row used. Only `plain` arrays are read ahead."""

    def __init__(self, rows: Sequence[Sequence[LazyArray]], budget: int):
        self._rows = [[a for a in row if a.plain] for row in rows]
        self.budget = budget
        self._at = 0  # the row being converted
        self._next = 0  # the first row not read ahead
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "bridge-read-ahead")

    def reached(self, i: int) -> None:
        for row in self._rows[self._at : i]:  # passed
            for array in row:
                array._ahead = None
        self._at, self._next = i, max(self._next, i + 1)
        ahead = sum(a.nbytes for row in self._rows[i + 1 : self._next] for a in row)
        while self._next < len(self._rows):
            row = [a for a in self._rows[self._next] if a._ahead is None]
            size = sum(a.nbytes for a in row)
            if ahead + size > self.budget:
                break
            for array in row:
                array._ahead = self._pool.submit(array._load)
            ahead += size
            self._next += 1

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)
        for row in self._rows:
            for array in row:
                array._ahead = None


@contextlib.contextmanager
def read_early(arrays: Iterable[Any], budget: int) -> Iterator[None]:
    """Read the `plain` `LazyArray`s of `arrays` that come first in reading order
    (shard by shard: by `order`, then in the order given) in a thread, up to
    `budget` bytes (at least one array), while the block runs: `bridge.load` plans
    its port meanwhile, on the main thread, and the port's rows take these reads
    (`LazyArray.read`) instead of reading again. A port reads its rows shard by
    shard, so these are its first rows' (their memory is the model's or one the
    port gives back early). On leaving, the reads under way are waited for (the
    files are closed after) and the ones not used are dropped."""
    lazy = [a for a in arrays if isinstance(a, LazyArray) and a.plain]
    lazy.sort(key=lambda a: a.order)
    started: list[LazyArray] = []
    total = 0
    pool = concurrent.futures.ThreadPoolExecutor(1, "bridge-read-early")
    try:
        for array in lazy:
            if array._ahead is not None:
                continue
            if started and total + array.nbytes > budget:
                break
            array._ahead = pool.submit(array._load)
            started.append(array)
            total += array.nbytes
        yield
    finally:
        pool.shutdown(wait=True)
        for array in started:
            array._ahead = None
