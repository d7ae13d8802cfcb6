"""Save and load a ~1 GB model: `bridge.save` / `bridge.load` against
`safetensors.numpy.save_file` / `load_file` of the same flat dict of arrays.

Times are interleaved (bridge, floor, bridge, floor, ...) in one process, with
`os.sync()` between operations (untimed) so no write-back spills into the next one;
the printed figures are medians and ratios bridge / floor (goal: <= 1.2). bridge.save
flushes the file to disk (fsync) before renaming it into place, so it is shown against
save_file with and without an fsync. bridge.load reads each array once into memory
that becomes the JAX array, so it is shown against load_file alone (which maps the
file and reads nothing), load_file followed by reading every array once, and
safetensors.flax.load_file (JAX arrays too; goal: bridge <= 1.0x).

Five rounds: the disk's write-back makes single saves vary by 2x. With 2 rounds
(2026-12-03, quiet machine) save read 2.46x and 2.80x the fsync floor, that floor once
faster than save_file without fsync (0.96 s vs 2.10 s); with 5, 0.80x (0.85 s vs 1.05
s), and load 0.5-0.6x safetensors.flax.load_file.

Peak memory is measured in a fresh subprocess per operation: the peak anonymous
resident memory (file pages of a memory map are page cache, not counted) above the
process's just before the operation, as a multiple of the model's size.

    python benchmarks/checkpoint.py            # ~1 GB, 5 rounds
    python benchmarks/checkpoint.py --quick    # ~64 MB (a smoke run)
    python benchmarks/checkpoint.py --size-mb 256
    python benchmarks/checkpoint.py --json     # + the JSON line of benchmarks/table.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from _common import sampled

import bridge


WIDTH, LAYERS = 4096, 8


def make_model(size_mb: int) -> dict:
    """Linen-style variables: LAYERS float32 kernels of shape (rows, WIDTH)."""
    rows = max(1, size_mb * 2**20 // (LAYERS * WIDTH * 4))
    params = {
        f"dense_{i}": {"kernel": jnp.full((rows, WIDTH), i + 0.5)}
        for i in range(LAYERS)
    }
    jax.block_until_ready(params)
    return {"params": params}


def flat(variables: dict) -> dict[str, np.ndarray]:
    """The same arrays as numpy (zero-copy views), keyed like bridge's file."""
    return {
        f"{name}.kernel": np.asarray(layer["kernel"])
        for name, layer in variables["params"].items()
    }


def save_fsync(arrays: dict[str, np.ndarray], path: Path) -> None:
    safetensors.numpy.save_file(arrays, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def load_copy(path: Path) -> list[np.ndarray]:
    """load_file maps the file without reading it; copying reads every byte once."""
    return [np.array(a) for a in safetensors.numpy.load_file(path).values()]


def bridge_load(path: Path) -> None:
    jax.block_until_ready(jax.tree_util.tree_leaves(bridge.load(path)))


# (name, bridge's operation, the floor's, what the floor is)
def operations(variables: dict | None, directory: Path) -> list[tuple]:
    ours, theirs = directory / "bridge.safetensors", directory / "floor.safetensors"
    return [
        (
            "save",
            lambda: bridge.save(ours, variables),
            lambda: safetensors.numpy.save_file(flat(variables), theirs),
            "safetensors.numpy.save_file (no fsync)",
        ),
        (
            "save",
            lambda: bridge.save(ours, variables),
            lambda: save_fsync(flat(variables), theirs),
            "safetensors.numpy.save_file + fsync (bridge's durability)",
        ),
        (
            "load",
            lambda: bridge_load(ours),
            lambda: load_copy(theirs),
            "safetensors.numpy.load_file + reading the arrays (one copy)",
        ),
        (
            "load",
            lambda: bridge_load(ours),
            lambda: safetensors.numpy.load_file(theirs),
            "safetensors.numpy.load_file alone (mapped, no byte read)",
        ),
        (
            "load",
            lambda: bridge_load(ours),
            lambda: flax_load(theirs),
            FLAX,
        ),
    ]


FLAX = "safetensors.flax.load_file (JAX arrays)"


def flax_load(path: Path) -> None:
    import safetensors.flax

    jax.block_until_ready(list(safetensors.flax.load_file(path).values()))


def child(index: int, side: int, size_mb: int, directory: Path) -> None:
    """One operation in this fresh process; print its peak anonymous memory above
    the start, sampled every millisecond."""
    name = operations(None, directory)[index][0]
    variables = make_model(size_mb) if name == "save" else None
    run = operations(variables, directory)[index][1 + side]
    print(json.dumps({"extra": sampled(run).extra}))


def peak_extra(index: int, side: int, size_mb: int, directory: Path) -> int:
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(index), str(side)]
        + ["--size-mb", str(size_mb)]
        + ["--dir", str(directory)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["extra"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 64 MB model")
    parser.add_argument("--size-mb", type=int, default=None, help="model size (MB)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="also a JSON line")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size_mb = args.size_mb or (64 if args.quick else 1024)
    if args.child:
        child(int(args.child[0]), int(args.child[1]), size_mb, Path(args.dir))
        return
    rounds = args.rounds or 5

    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        directory = Path(tmp)
        variables = make_model(size_mb)
        nbytes = sum(a.nbytes for a in flat(variables).values())
        ops = operations(variables, directory)
        times: list[tuple[list[float], list[float]]] = [([], []) for _ in ops]
        for _ in range(rounds):
            for (_, *pair, _), (ours, theirs) in zip(ops, times):
                for run, record in zip(pair, (ours, theirs)):  # bridge, floor, ...
                    start = time.perf_counter()
                    run()
                    record.append(time.perf_counter() - start)
                    os.sync()  # no write-back left over for the next operation

        print(
            f"model: {LAYERS} float32 arrays, {nbytes / 2**20:,.0f} MiB; "
            f"{rounds} interleaved rounds; medians"
        )
        print(f"{'':5} {'bridge':>8} {'floor':>8} {'ratio':>6}  floor")
        ratios = {}
        for (name, *_, floor), (ours, theirs) in zip(ops, times):
            a, b = statistics.median(ours), statistics.median(theirs)
            ratios[floor] = a / b
            print(f"{name:5} {a:7.3f}s {b:7.3f}s {a / b:6.2f}  {floor}")
        if args.json:
            measures = [
                {
                    "measure": "save / save_file + fsync",
                    "goal": 1.2,
                    "now": ratios[ops[1][3]],
                },
                {
                    "measure": "load (no like) / safetensors.flax.load_file",
                    "goal": 1.0,
                    "now": ratios[FLAX],
                },
            ]

        print("peak anonymous RSS above the process's before the operation / model:")
        for index in (0, 2):
            name, *_, floor = ops[index]
            ours, theirs = (
                peak_extra(index, side, size_mb, directory) for side in (0, 1)
            )
            print(
                f"  {name:5} bridge {ours / nbytes:4.2f}x ({ours / 2**20:,.0f} MiB)  "
                f"floor {theirs / nbytes:4.2f}x ({theirs / 2**20:,.0f} MiB)  {floor}"
            )
        if args.json:
            print(json.dumps({"benchmark": "checkpoint", "measures": measures}))


if __name__ == "__main__":
    main()
