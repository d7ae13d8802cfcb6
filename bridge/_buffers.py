"""Host memory that bridge's reads fill, and its one move into a JAX array.

On the CPU, `jax.device_put` of a C-contiguous numpy array whose data is 64-byte
aligned makes no copy: the JAX array uses the numpy memory and keeps it alive (and
a later write into that memory would change the "immutable" JAX array). So:

- Reads of a file go into memory bridge owns (`owned`): `aligned` (fresh, 64-byte
  aligned) or a `Pool`'s page-aligned buffers. A read of a weight whose layout is
  kept becomes the model's array with no second copy (`to_jax`).
- A `Pool` hands out buffers of at least `Pool.least` bytes and takes each back only
  when the last reference to it (the array read, its views, a JAX array made from
  it) is gone: a weight transposed into a new JAX array gives its buffer back for a
  later read, so its pages are written again instead of a fresh mapping faulted in
  and unmapped per weight (XLA lets go of a host array it copied only at its next
  call, so a buffer comes back one read late: the pool keeps `Pool.keep` idle
  buffers, the oldest unmapped first, all dropped when the pool is closed with its
  checkpoint, at the end of `bridge.load`). Measured (758 MiB HF Llama folder ->
  abstract NNX, `benchmarks/hf_load.py`, 3 interleaved rounds, peak / model, load
  3-4): `keep` 4: 1.118 (idle buffers held at the peak), 2: 1.033, 1: 1.024, in
  2.01 s, 1.81 s, 2.00 s (noise); 0: 1.009 but ~10% slower (a fresh mapping
  faulted in per read). A new buffer
  is a private anonymous mapping advised to use huge pages where the system allows
  (Linux THP in `madvise` mode): measured, reading 11 MiB into one costs 5.8 ms of
  CPU against 12.2 ms with 4 KiB pages, and 2.2 ms into a reused buffer.
- `to_jax` of any other numpy array (the caller's: a state dict given to
  `bridge.from_torch`) copies it once: the JAX array never shares the caller's
  memory.
- `Placing` runs the copies that change a layout (XLA's transposing host copy of a
  PyTorch `(out, in)` weight into `(in, out)`: most of a Hugging Face folder's load
  into Flax) in threads, while the port goes on: XLA lets go of the GIL for the copy.
  Measured, numpy's cache-blocked copies (16 or 8 rows, 8 x 512 tiles) into a
  fresh or pre-faulted destination take 1.2-1.5x the CPU time of XLA's
  `jax.device_put` of the transposed view, so XLA copies.
"""

from __future__ import annotations

import collections
import concurrent.futures
import mmap
import threading
import weakref
from typing import Any

import jax
import numpy as np


ALIGN = 64  # bytes: what XLA's CPU client needs to use host memory as it is
SMALL = 4096  # bytes: smaller arrays are not aligned

# the arrays owning memory bridge allocated, by id (an entry goes with its array)
_owned: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()


def _own(base: np.ndarray) -> None:
    _owned[id(base)] = base


def owned(x: Any) -> bool:
    """Whether numpy array `x` is (a view of) memory bridge allocated for a read."""
    while isinstance(x, np.ndarray):
        if _owned.get(id(x)) is x:
            return True
        x = x.base
    return False


def aligned(nbytes: int) -> np.ndarray:
    """`nbytes` fresh bytes (uint8), owned by bridge; 64-byte aligned from `SMALL`
    bytes on (XLA copies a smaller array anyway: its alignment is not worth the
    microseconds of finding it)."""
    if nbytes < SMALL:
        raw = np.empty(nbytes, np.uint8)
        _own(raw)
        return raw
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    _own(raw)
    return raw[start : start + nbytes]


def to_jax(x: np.ndarray) -> jax.Array:
    """`x` as a JAX array on the default device, with at most one copy: none for
    memory bridge read into (`owned`, contiguous and aligned), one otherwise (a
    transposed view is copied by XLA's host transpose; the caller's memory is
    copied so that the JAX array never shares it)."""
    if owned(x) or not x.flags.c_contiguous:
        return jax.device_put(x)
    copy = aligned(x.nbytes).view(x.dtype).reshape(x.shape)
    np.copyto(copy, x)
    return jax.device_put(copy)


class Pool:
    """Page-aligned host buffers, reused once their arrays are gone (see the
    module's docstring). Safe from several threads."""

    least = 1 << 20  # bytes: smaller reads take `aligned` memory
    keep = 1  # idle buffers kept (more raise the peak: the module's docstring)
    spare = 16 << 20  # bytes a buffer may have beyond twice what a read needs

    def __init__(self) -> None:
        self._idle: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self, nbytes: int) -> np.ndarray:
        """`nbytes` bytes (uint8), page-aligned when at least `least`."""
        if nbytes < self.least:
            return aligned(nbytes)
        most = max(2 * nbytes, nbytes + self.spare)  # a weight kept whole may waste
        with self._lock:  # the rest for as long as the model lives
            fits = [m for m in self._idle if nbytes <= len(m) <= most]
            memory = min(fits, key=len, default=None)
            if memory is not None:
                self._idle.remove(memory)
        if memory is None:
            memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: 2 MiB pages, 512x fewer faults
                memory.madvise(mmap.MADV_HUGEPAGE)
        base = np.frombuffer(memory, np.uint8)
        _own(base)
        weakref.finalize(base, self._give_back, memory)
        return base[:nbytes]

    def _give_back(self, memory: mmap.mmap) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(memory)
                del self._idle[: max(0, len(self._idle) - self.keep)]  # the oldest go

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._idle.clear()


def _jax_state() -> Any:
    """What makes `jax.device_put(x)` differ between threads (JAX's thread-local
    settings: default device, x64, transfer guards ...); None when this JAX does
    not tell."""
    try:
        from jax._src import config

        return config.trace_context(), config.transfer_guard_host_to_device.value
    except (ImportError, AttributeError):
        return None


class Placing:
    """`to_jax` of host arrays whose layout changes (not C-contiguous: XLA copies
    them) in `threads` threads, at most `budget` bytes of them waiting or under way
    (more waits for the oldest: their host memory is the peak's excess), the others
    now. `put(x)` gives `to_jax(x)` or a `Future` of it; `result(value)` the array.
    Only when this thread's JAX settings are a fresh thread's (else every array is
    moved now, as this thread would; asked at the first copy: a port of JAX arrays
    starts no thread). A `with` block waits for every copy on leaving.
    """

    threads = 2

    def __init__(self, budget: int):
        self._budget = budget
        self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, "bridge-place")
        self._threads: bool | None = None  # whether copies go to the threads
        self._waiting: collections.deque[tuple[concurrent.futures.Future, int]] = (
            collections.deque()
        )

    def put(self, x: np.ndarray) -> jax.Array | concurrent.futures.Future:
        if x.flags.c_contiguous:
            return to_jax(x)
        if self._threads is None:
            here = _jax_state()
            there = None if here is None else self._pool.submit(_jax_state).result()
            self._threads = here is not None and there == here
        if not self._threads:
            return to_jax(x)
        while self._waiting and (
            self._waiting[0][0].done()
            or sum(n for _, n in self._waiting) + x.nbytes > self._budget
        ):
            self._waiting.popleft()[0].result()  # an error raises here
        future = self._pool.submit(to_jax, x)
        self._waiting.append((future, x.nbytes))
        return future

    @staticmethod
    def result(value: Any) -> Any:
        if isinstance(value, concurrent.futures.Future):
            return value.result()
        return value

    def __enter__(self) -> Placing:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)
