"""What the benchmarks share: interleaved timing and the process's memory figures.

Not a benchmark itself (running it does nothing): the benchmarks of this folder
import it. One copy of each: the memory sampler (`sampled`, `anonymous`), the peak
resident set (`rss`, `reset_peak`), XLA's footprint of a compiled computation
(`compiled_bytes`) and the backend the figures come from (`backend`).
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Generic, NamedTuple, TypeVar


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
    maps land there), from `/proc/self/status` (Linux; where it lacks them, as
    under gVisor, the whole resident set `VmRSS`)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    if "RssAnon" not in fields:  # gVisor (the TPU machines) gives VmRSS alone
        return int(fields["VmRSS"].split()[0]) * 1024
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


def backend() -> str:
    """Where JAX runs, for the tables: `"tpu (TPU v5 lite)"`, `"cpu (cpu)"`."""
    import jax

    device = jax.devices()[0]
    return f"{device.platform} ({device.device_kind})"


def compiled_bytes(lowered: Any) -> int:
    """XLA's footprint of a lowered computation (`jax.jit(f).lower(...)`): arguments
    + outputs + temporaries, donated arguments that outputs alias counted once, from
    `compile().memory_analysis()`. On an accelerator a process's memory (RSS) does
    not hold the arrays, and `memory_stats()["peak_bytes_in_use"]` counts buffers,
    not a program's temporaries: this counts both, the same way on every backend."""
    m = lowered.compile().memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
