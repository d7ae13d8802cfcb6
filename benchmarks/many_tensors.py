"""Time per tensor of the paths that see every tensor of a checkpoint, at 10k and 100k
tensors (a mixture-of-experts checkpoint has ~90k): linear means the same µs per
tensor at both sizes.

- `from_torch (numpy)`: `bridge.from_torch` of a state dict of numpy arrays (tie
  detection included: every array is checked against the ones before it);
- `from_torch (torch)`: the same with `torch.Tensor`s (skipped without torch);
- `load (one file)`: `bridge.load` of one PyTorch-layout safetensors file
  (`save_pretrained`'s names, no bridge metadata);
- `load (sharded)`: `bridge.load` of a Hugging Face sharded folder of the same
  tensors in 100 shards with its `model.safetensors.index.json`.

Each tensor is a 4-element float32 vector, so the time is bridge's own per-tensor
work, not reading bytes, in CPU time of the process. The floor is JAX's own:
`jax.device_put` of the same numpy arrays in one call (every load ends with a JAX
array per tensor). Medians of
`--rounds` runs. `--json`: the growth of each path's µs per tensor from the smaller
size to the larger (goal <= 1.3: linear), and each load's µs per tensor at the larger
size over the floor's (goal <= 3).

Measured (2 shared cores, 2026-12-02 08:04, load 7.5-9, 1 round, CPU µs per tensor
at 10k / 100k tensors): jax.device_put 89 / 106; from_torch (numpy) 24 / 50;
from_torch (torch) 81 / 63; load (one file) 237 / 294 (2.8x the floor at 100k);
load (sharded) 314 / 348 (3.3x).

    python benchmarks/many_tensors.py              # 10k and 100k, 3 rounds
    python benchmarks/many_tensors.py --quick      # 2k and 20k, 2 rounds
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import safetensors.numpy

import bridge


FLOOR = "jax.device_put (floor)"
GOAL_GROWTH = 1.3  # µs per tensor at the larger size / at the smaller: linear
GOAL_FLOOR = 3.0  # a load's µs per tensor / jax.device_put's


def state_dict(n: int) -> dict[str, np.ndarray]:
    """`n` tensors named as a model's (`model.layers.{i}.mlp.experts.{e}.w.weight`)."""
    experts = 64
    return {
        f"model.layers.{i // experts}.mlp.experts.{i % experts}.w.weight": np.full(
            4, i, np.float32
        )
        for i in range(n)
    }


def write_sharded(folder: Path, sd: dict[str, np.ndarray], shards: int = 100) -> Path:
    names = list(sd)
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        part = names[s * per : (s + 1) * per]
        if not part:
            break
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        safetensors.numpy.save_file({k: sd[k] for k in part}, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def timed(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.process_time()  # this process's CPU time: less noise from others
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def measure(n: int, rounds: int) -> dict[str, float]:
    sd = state_dict(n)
    arrays = list(sd.values())
    out = {FLOOR: timed(lambda: jax.device_put(arrays), rounds) / n}
    out["from_torch (numpy)"] = timed(lambda: bridge.from_torch(sd), rounds) / n
    if importlib.util.find_spec("torch") is not None:
        import torch

        tensors = {k: torch.from_numpy(v) for k, v in sd.items()}
        out["from_torch (torch)"] = (
            timed(lambda: bridge.from_torch(tensors), rounds) / n
        )
    with tempfile.TemporaryDirectory() as directory:
        one = Path(directory) / "model.safetensors"
        safetensors.numpy.save_file(sd, one)
        out["load (one file)"] = timed(lambda: bridge.load(one), rounds) / n
        folder = Path(directory) / "sharded"
        folder.mkdir()
        index = write_sharded(folder, sd)
        out["load (sharded)"] = timed(lambda: bridge.load(index), rounds) / n
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="also a JSON line")
    args = parser.parse_args()
    sizes = (2_000, 20_000) if args.quick else (10_000, 100_000)
    rounds = 2 if args.quick else args.rounds
    results = {n: measure(n, rounds) for n in sizes}
    print(f"{'path':22s}" + "".join(f"{n:>14,d}" for n in sizes) + "   (µs/tensor)")
    for path in results[sizes[0]]:
        cells = "".join(f"{results[n][path] * 1e6:14.1f}" for n in sizes)
        print(f"{path:22s}{cells}")
    if args.json:
        small, large = sizes
        measures = []
        for path in results[small]:
            if path == FLOOR:
                continue
            growth = results[large][path] / results[small][path]
            measures.append(
                {
                    "measure": f"{path}: µs/tensor at {large:,} / at {small:,}",
                    "now": growth,
                    "goal": GOAL_GROWTH,
                }
            )
            if path.startswith("load"):
                measures.append(
                    {
                        "measure": f"{path} at {large:,} / {FLOOR}",
                        "now": results[large][path] / results[large][FLOOR],
                        "goal": GOAL_FLOOR,
                    }
                )
        print(json.dumps({"benchmark": "many_tensors", "measures": measures}))


if __name__ == "__main__":
    main()
