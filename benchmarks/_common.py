"""What the benchmarks share: interleaved timing and the process's memory figures.

Not a benchmark itself (running it does nothing): `convert.py`, `step.py`, `port.py`,
`hf_load.py`, `torch_load.py` and `quantized.py` import it from this folder.
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from typing import Generic, NamedTuple, TypeVar


T = TypeVar("T")


def interleaved(
    fns: Mapping[str, Callable[[], object]],
    rounds: int,
    per_round: int = 1,
    *,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
    collect: bool = True,
) -> dict[str, float]:
    """Median seconds of each function, run in turn (ABAB...): `rounds` rounds of
    `per_round` calls each, after `warmup` untimed calls of each (compilation,
    caches).

    `clock` is `time.perf_counter` (wall time: a step's XLA threads count) or
    `time.process_time` (this process's CPU time: single-threaded Python work on a
    shared machine). With `collect=False` the garbage collector is off while a call
    runs (after a collection), as `timeit` does: with many live arrays a collection
    can land in any call and cost more than the call itself."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(per_round):
                if not collect:
                    gc.collect()
                    gc.disable()
                start = clock()
                fn()
                times[name].append(clock() - start)
                if not collect:
                    gc.enable()
    return {name: statistics.median(ts) for name, ts in times.items()}


def rss(field: str = "VmRSS") -> int:
    """This process's resident set size in bytes (`VmRSS`), or its peak since the
    last `reset_peak` (`VmHWM`), from `/proc/self/status` (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Reset the peak (`VmHWM`) to the current resident set size (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def anonymous() -> int:
    """This process's resident memory that is not a file's pages, in bytes: `RssAnon`
    (private anonymous) + `RssShmem` (shared anonymous: reads into shared anonymous
    maps land there), from `/proc/self/status` (Linux)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))


class Sampled(NamedTuple, Generic[T]):
    """What `sampled` measured of one call."""

    result: T  # what the call returned
    seconds: float  # its wall time
    extra: int  # peak `anonymous()` during it above the figure just before, bytes


def sampled(run: Callable[[], T], interval: float = 0.001) -> Sampled[T]:
    """Call `run()` while a thread samples `anonymous()` every `interval` seconds.

    The last sample is taken after the call, its result still alive (a loaded model
    counts). Start the JAX backend before (`jax.numpy.zeros(1).block_until_ready()`),
    or its start counts too."""
    before = peak = anonymous()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, anonymous())
            time.sleep(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    return Sampled(result, seconds, max(peak, anonymous()) - before)
