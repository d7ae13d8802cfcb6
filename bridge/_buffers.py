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
  call, so a buffer comes back one read late). Idle buffers are kept up to the
  bytes of reads still expected (`Pool.expect`: a lazily read checkpoint tells its
  arrays' total), the oldest unmapped first: every idle buffer can still serve a
  read, none is held once the reads are done (the model filled + the idle buffers
  stay under the model), all are dropped when the pool is closed with its
  checkpoint, at the end of `bridge.load`. Measured (758 MiB HF Llama folder ->
  abstract NNX, 4 interleaved rounds in fresh processes, load 5-7): 308k page
  faults and 2.47 s of CPU with one idle buffer kept, 235k and 2.32 s now (the
  floor, `safetensors.numpy.load_file`: 197k, 0.91 s), peak 1.05 / model both.
- A new buffer is a private anonymous mapping of 4 KiB pages, not advised to use
  huge pages: on the 2-core VM of the benchmarks, faulting in fresh transparent
  huge pages (`MADV_HUGEPAGE`) cost up to 3x the system time of 4 KiB pages, and
  varied 5x from run to run (the same 770 MiB: 0.23-1.3 s against 0.52-0.65 s).
  Measured: the Llama folder -> abstract Equinox, where every read is kept as the
  model's memory, took 1.79 s of CPU with huge pages and 0.80 s without (the
  floor 0.91 s); -> NNX 2.59 s and 2.47 s (one idle buffer kept).
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
    module's docstring). Safe from several threads.

    `expect(nbytes)` tells the pool that reads of `nbytes` more bytes are coming
    (each `take` of at least `least` bytes counts against them): the pool keeps
    idle buffers only up to the bytes still expected, the oldest dropped first, so
    that every idle buffer can still serve a read and none is held once the reads
    are done. Reads never expected keep no idle buffer."""

    least = 1 << 20  # bytes: smaller reads take `aligned` memory
    spare = 16 << 20  # bytes a buffer may have beyond twice what a read needs

    def __init__(self) -> None:
        self._idle: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._closed = False
        self._expected = 0  # bytes of reads still to come (`expect`)

    def expect(self, nbytes: int) -> None:
        """Reads of `nbytes` more bytes are coming (see the class's docstring)."""
        with self._lock:
            self._expected += nbytes

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
            self._expected = max(0, self._expected - nbytes)
            self._trim()
        if memory is None:
            memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # 4 KiB pages
        base = np.frombuffer(memory, np.uint8)
        _own(base)
        weakref.finalize(base, self._give_back, memory)
        return base[:nbytes]

    def _give_back(self, memory: mmap.mmap) -> None:
        # A finalizer: it may run inside this very pool's locked section (the cyclic
        # collector can free an array at any allocation there), where waiting for the
        # lock would wait forever. A busy lock drops the buffer instead of reusing it.
        if not self._lock.acquire(blocking=False):
            return
        try:
            if not self._closed:
                self._idle.append(memory)
                self._trim()
        finally:
            self._lock.release()

    def _trim(self) -> None:
        """Drop the oldest idle buffers beyond the bytes still expected."""
        idle = sum(len(m) for m in self._idle)
        while self._idle and idle > self._expected:
            idle -= len(self._idle.pop(0))

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
    (more waits for any of them to end: their host memory is the peak's excess), not
    counting one copy larger than `budget` (a 64 MiB `lm_head` does not hold up
    the next weights: measured, 758 MiB HF Llama folder -> NNX, with
    `bridge.load`'s early reads, 8 interleaved rounds, 1.34x -> 1.22x
    `safetensors.numpy.load_file`, peak 1.06 -> 1.05 / model), the others now.
    `put(x)` gives `to_jax(x)` or a `Future` of it; `result(value)` the array.
    `put(x, held=True)`: `x` is a view of memory held anyway (a PyTorch module's
    weights, a file read whole): its copy waits without counting against `budget`
    (measured, a ~450 MiB Llama module ported to Flax: the copies 0.34-0.44 s one
    at a time, 0.16-0.21 s on both threads).
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

    def put(
        self, x: np.ndarray, held: bool = False
    ) -> jax.Array | concurrent.futures.Future:
        if x.flags.c_contiguous:
            return to_jax(x)
        if self._threads is None:
            here = _jax_state()
            there = None if here is None else self._pool.submit(_jax_state).result()
            self._threads = here is not None and there == here
        if not self._threads:
            return to_jax(x)
        self._settle()
        size = 0 if held else x.nbytes
        while self._waiting and self._over(size):  # wait for any copy to end
            futures = [future for future, _ in self._waiting]
            concurrent.futures.wait(futures, return_when="FIRST_COMPLETED")
            self._settle()
        future = self._pool.submit(to_jax, x)
        self._waiting.append((future, size))
        return future

    def _settle(self) -> None:
        """Forget the copies done (an error raises here)."""
        done = [entry for entry in self._waiting if entry[0].done()]
        for future, _ in done:
            future.result()
        if done:
            ended = set(map(id, done))
            self._waiting = collections.deque(
                entry for entry in self._waiting if id(entry) not in ended
            )

    def _over(self, nbytes: int) -> bool:
        """Whether a copy of `nbytes` more would put too many bytes under way: more
        than `budget`, not counting one copy larger than it."""
        sizes = [n for _, n in self._waiting]
        largest = max(sizes, default=0)
        beside = sum(sizes) - (largest if largest > self._budget else 0)
        return beside + nbytes > self._budget

    @staticmethod
    def result(value: Any) -> Any:
        if isinstance(value, concurrent.futures.Future):
            return value.result()
        return value

    def __enter__(self) -> Placing:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True)
