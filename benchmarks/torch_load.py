"""Load a ~1 GiB sharded Hugging Face-layout checkpoint into an abstract NNX model:
`bridge.load(folder, like=nnx.eval_shape(...))` against `safetensors.numpy.load_file`
of the same shards (the floor: the bytes read into numpy, no layout change).

The checkpoint is generated with numpy: LAYERS `nn.Linear(WIDTH, WIDTH)` state-dict
entries (`layers.{i}.weight` `(out, in)` and `bias`) in shards of SHARD_LAYERS layers,
with a `model.safetensors.index.json`, as `save_pretrained(max_shard_size=...)` writes
them. bridge reads each array when its layer is ported (shard by shard), transposes it
to Flax's `(in, out)` and places it in the model.

Times are interleaved (bridge, floor, ...) medians; the ratio is bridge / floor.
Peak memory is measured in a fresh subprocess per side: the peak anonymous resident
memory above the process's just before the operation; the goal for bridge is at most
model + largest shard + 10%.

Measured (2 shared cores, 05:54 UTC 2026-12-01, 1 round): 1 GiB in 4 shards of
256 MiB: bridge.load 7.40 s vs load_file 1.78 s (ratio 4.16: the transposes and the
per-layer plan); peak 1,096 MiB = 1.07x the model (budget 1,408 MiB).

    python benchmarks/torch_load.py            # ~1 GiB, 2 rounds
    python benchmarks/torch_load.py --quick    # ~64 MiB (a smoke run)
    python benchmarks/torch_load.py --json     # + the JSON line of benchmarks/table.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import safetensors.numpy
from _common import sampled
from flax import nnx

import bridge


LAYERS, SHARD_LAYERS = 16, 4


def width(size_mb: int) -> int:
    return int((size_mb * 2**20 / LAYERS / 4) ** 0.5)


def write_checkpoint(folder: Path, size_mb: int) -> tuple[int, int]:
    """The sharded checkpoint; returns (total bytes, largest shard's bytes)."""
    n = width(size_mb)
    rng = np.random.default_rng(0)
    weight_map, largest, total = {}, 0, 0
    for s in range(0, LAYERS, SHARD_LAYERS):
        shard = {}
        for i in range(s, s + SHARD_LAYERS):
            shard[f"layers.{i}.weight"] = rng.standard_normal((n, n), "float32")
            shard[f"layers.{i}.bias"] = rng.standard_normal(n, "float32")
        file = f"model-{s // SHARD_LAYERS + 1:05d}.safetensors"
        safetensors.numpy.save_file(shard, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        nbytes = sum(a.nbytes for a in shard.values())
        largest, total = max(largest, nbytes), total + nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total, largest


class Model(nnx.Module):
    def __init__(self, n: int):
        self.layers = nnx.List(
            [nnx.Linear(n, n, rngs=nnx.Rngs(i)) for i in range(LAYERS)]
        )


def bridge_load(folder: Path, n: int):
    abstract = nnx.eval_shape(lambda: Model(n))
    model = bridge.load(folder, like=abstract)
    model.layers[-1].kernel[...].block_until_ready()
    return model


def floor_load(folder: Path):
    return [safetensors.numpy.load_file(f) for f in sorted(folder.glob("model-*"))]


def child(side: int, size_mb: int, folder: Path) -> None:
    n = width(size_mb)
    if side == 0:
        run = lambda: bridge_load(folder, n)  # noqa: E731
    else:
        run = lambda: floor_load(folder)  # noqa: E731
    jax.numpy.zeros(1).block_until_ready()  # the JAX backend, up before measuring
    print(json.dumps({"extra": sampled(run).extra}))


def peak_extra(side: int, size_mb: int, folder: Path) -> int:
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(side), "--size-mb", str(size_mb)]
        + ["--dir", str(folder)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["extra"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 64 MiB checkpoint")
    parser.add_argument("--size-mb", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="also a JSON line")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size_mb = args.size_mb or (64 if args.quick else 1024)
    if args.child is not None:
        child(args.child, size_mb, Path(args.dir))
        return
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        folder = Path(tmp)
        total, largest = write_checkpoint(folder, size_mb)
        n = width(size_mb)
        ours, theirs = [], []
        for _ in range(args.rounds):
            for run, record in (
                (lambda: bridge_load(folder, n), ours),
                (lambda: floor_load(folder), theirs),
            ):
                start = time.perf_counter()
                run()
                record.append(time.perf_counter() - start)
        a, b = statistics.median(ours), statistics.median(theirs)
        print(
            f"checkpoint: {LAYERS} nn.Linear({n}, {n}) in {LAYERS // SHARD_LAYERS} "
            f"shards, {total / 2**20:,.0f} MiB (largest shard "
            f"{largest / 2**20:,.0f} MiB); {args.rounds} interleaved rounds, medians"
        )
        print(
            f"bridge.load(like=abstract NNX) {a:6.2f}s  "
            f"safetensors.numpy.load_file {b:6.2f}s  ratio {a / b:4.2f}"
        )
        ours_peak, floor_peak = (peak_extra(side, size_mb, folder) for side in (0, 1))
        budget = (total + largest) * 1.1
        print(
            f"peak anonymous RSS above start: bridge {ours_peak / 2**20:,.0f} MiB "
            f"({ours_peak / total:4.2f}x model; budget model + largest shard + 10% = "
            f"{budget / 2**20:,.0f} MiB: {'within' if ours_peak <= budget else 'OVER'})"
            f", floor {floor_peak / 2**20:,.0f} MiB"
        )
        if args.json:
            what = f"{LAYERS} Linear sharded folder -> abstract NNX"
            measures = [
                {"measure": f"{what}, time / load_file", "now": a / b, "goal": 1.5},
                {
                    "measure": f"{what}, peak / model (goal: + largest shard + 10%)",
                    "now": ours_peak / total,
                    "goal": budget / total,
                },
            ]
            print(json.dumps({"benchmark": "torch_load", "measures": measures}))


if __name__ == "__main__":
    main()
