"""What reading the PyTorch side's computation adds to loading a Hugging Face folder.

The folder: a Llama of ~1 GiB float32 (vocab 16384, dim 1024, 20 layers; the names,
shapes and writer of `hf_load.py`), random weights, written once, not timed.

Timed in one process, interleaved round after round (medians):

- the load: `bridge.load(folder, like=...)` into an abstract NNX Llama, and into an
  abstract Equinox one (the arrays ready when the clock stops);
- the trace: `folder_module(folder)` (the model built from `config.json` inside
  `FakeTensorMode` and `no_init_weights()`: full size, no memory) then
  `trace_module(module, token_ids)` (one forward pass under the recorder), on one
  sequence of 8 tokens.

The ratio is trace / load; goal (issue 37): at most 0.10. The first trace of a
process also imports transformers' model classes: printed apart, once.

    python benchmarks/torch_trace.py            # ~1 GiB, 5 rounds
    python benchmarks/torch_trace.py --quick    # ~40 MiB, 3 rounds (a smoke run)

Measured (f92bcf6, 2-core machine shared with other jobs, load average ~10, 5
interleaved rounds, medians):

| | time | trace / load |
|---|---|---|
| bridge.load(like=abstract NNX) | (see below) | |
| bridge.load(like=abstract Equinox) | | |
| folder_module + trace_module | | |

Run it with `PYTHONPATH=.` from a clone (the bridge of the environment is timed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import interleaved
from hf_load import QUICK, Size, eqx_llama, nnx_llama, write_folder


FULL = Size(vocab=16384, dim=1024, hidden=2816, heads=16, kv_heads=8, layers=20)
GOAL = 0.10
TOKENS = np.arange(8, dtype=np.int64).reshape(1, 8) + 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="~40 MiB, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    rounds = args.rounds or (3 if args.quick else 5)

    import jax

    import bridge
    from bridge._adapters._torch_trace import folder_module, trace_module

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        total = write_folder(folder, size)
        nnx_like, eqx_like = nnx_llama(size), eqx_llama(size)

        def load(like):
            def run():
                model = bridge.load(folder, like=like)
                jax.block_until_ready(jax.tree.leaves(model))

            return run

        def trace():
            built = folder_module(folder)
            if built.module is None:
                sys.exit(f"no model built: {built.reason}")
            return trace_module(built.module, (TOKENS,))

        start = time.perf_counter()
        uses = trace()
        first = time.perf_counter() - start
        times = interleaved(
            {
                "bridge.load(like=abstract NNX)": load(nnx_like),
                "bridge.load(like=abstract Equinox)": load(eqx_like),
                "folder_module + trace_module": trace,
            },
            rounds,
        )
    traced = times["folder_module + trace_module"]
    print(f"folder: {total / 2**30:.2f} GiB, {len(uses.positions)} arrays traced")
    print(f"first trace of the process (imports included): {first:.2f} s")
    print("| | time | trace / load |")
    print("|---|---|---|")
    worst = 0.0
    for name, t in times.items():
        ratio = traced / t if name.startswith("bridge") else None
        worst = max(worst, ratio or 0.0)
        shown = "" if ratio is None else f"{ratio:.3f}"
        print(f"| {name} | {t:.3f} s | {shown} |")
    verdict = "met" if worst <= GOAL else "NOT met"
    print(f"goal trace / load <= {GOAL}: {verdict} (worst {worst:.3f})")


if __name__ == "__main__":
    main()
