"""What `bridge.load(..., progress=True)` costs: a ~200 MB sharded Hugging Face folder
loaded into an abstract NNX model, with the display off, on (as shipped: it draws
itself once the load has taken `DELAY` = 1 s) and drawn from the start (`DELAY` = 0),
interleaved in one process; medians and ratios against off.

stderr is a pseudo-terminal that the benchmark drains, so the display really draws
(rich redraws it from a thread, 10 times a second); the counting (one call per array
read) runs in every "on" load. The file is in the page cache after the first load:
the figures are the CPU's, where an overhead would show.

    python benchmarks/progress.py              # ~200 MB, 11 rounds
    python benchmarks/progress.py --size-mb 50 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from flax import nnx

import bridge
from bridge import _progress


LAYERS, WIDTH = 8, 2048


class MLP(nnx.Module):
    def __init__(self, rows: int, rngs: nnx.Rngs):
        self.layers = nnx.List(
            [nnx.Linear(WIDTH, rows, rngs=rngs) for _ in range(LAYERS)]
        )


def _terminal_stderr() -> None:
    """fd 2 and `sys.stderr` a pseudo-terminal, its output read and dropped."""
    master, slave = os.openpty()
    os.dup2(slave, 2)
    sys.stderr = os.fdopen(os.dup(slave), "w", buffering=1)

    def drain() -> None:
        while True:
            try:
                os.read(master, 1 << 16)
            except OSError:
                return

    threading.Thread(target=drain, daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    rows = max(1, args.size_mb * 2**20 // (LAYERS * WIDTH * 4))
    out = sys.stdout
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        bridge.save_pretrained(folder, MLP(rows, nnx.Rngs(0)), max_shard_size="50MB")
        shards = len(list(folder.glob("*.safetensors")))
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        abstract = nnx.eval_shape(lambda: MLP(rows, nnx.Rngs(0)))
        _terminal_stderr()
        assert sys.stderr.isatty()

        def load(progress: bool, delay: float) -> tuple[float, float]:
            _progress.DELAY = delay
            start, cpu = time.perf_counter(), time.process_time()
            bridge.load(folder, like=abstract, progress=progress)
            return time.perf_counter() - start, time.process_time() - cpu

        variants = {
            "off": (False, 1.0),
            "on (draws after 1 s)": (True, 1.0),
            "on, drawn from the start": (True, 0.0),
        }
        load(False, 1.0)  # compiled, page cache warm
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(args.rounds):
            for name in names[r % 3 :] + names[: r % 3]:  # each order in turn
                times[name].append(load(*variants[name]))
    print(
        f"{size / 2**20:.0f} MiB in {shards} shards, {2 * LAYERS} arrays, "
        f"{args.rounds} interleaved rounds; medians (CPU: all the process's threads)",
        file=out,
    )
    base = [statistics.median(t[i] for t in times["off"]) for i in (0, 1)]
    for name, ts in times.items():
        wall, cpu = (statistics.median(t[i] for t in ts) for i in (0, 1))
        print(
            f"  {name:26} wall {wall:.3f} s {wall / base[0]:.3f}x   "
            f"CPU {cpu:.3f} s {cpu / base[1]:.3f}x",
            file=out,
        )


if __name__ == "__main__":
    main()
