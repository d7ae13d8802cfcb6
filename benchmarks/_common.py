"""What the benchmarks share: interleaved timing and the process's memory figures.

Not a benchmark itself (running it does nothing): `convert.py`, `step.py` and
`port.py` import it from this folder.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Mapping


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
