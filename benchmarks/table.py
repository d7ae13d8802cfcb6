"""One table of every benchmark's ratios against their goals (`nox -s bench`), so that
a regression is visible at a glance.

Each `benchmarks/*.py` runs in its quick form (`--quick`, one after the other: never
two at once on a shared machine); those in BENCHMARKS take `--json` and print, as
their last line, one JSON object:

    {"benchmark": "hf_load", "measures": [
        {"measure": "...", "now": 1.31, "goal": 1.5},                    # now <= goal
        {"measure": "...", "now": 0.8, "goal": 0.5, "better": "higher"}  # now >= goal
    ]}

The table prints `measure | platform | now | goal | ok` for each (the platform:
where JAX ran, `cpu (cpu)` or `tpu (TPU v5 lite)`, as `_common.backend` says), a
row for a benchmark that failed or printed no such line, and one for each benchmark
that reports no ratios yet (it ran: a smoke run). Quick forms use small models,
whose fixed costs weigh more than at full size: a quick ratio over its goal is a
prompt to run the full benchmark (each script's docstring gives its full-size
figures), not a verdict.
Exits 1 if any measure misses its goal or any benchmark failed.

    python benchmarks/table.py                   # every benchmark, quick forms
    python benchmarks/table.py hf_load many_tensors
    python benchmarks/table.py --full hf_load    # full-size forms (minutes each)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


HERE = Path(__file__).parent
# the benchmarks that print a `--json` line, in the order the table shows them; the
# others run too (a smoke run: a row says whether they ran) until they print one
BENCHMARKS = (
    "hf_load",
    "torch_load",
    "checkpoint",
    "many_tensors",
    "convert",
    "port",
    "quantized",
)
# what a benchmark runs with for its --json line, beyond --json and --quick
ARGS = {"quantized": ["--keep"]}  # kept weights on the backend: forward, LoRA step


def everything() -> list[str]:
    others = sorted(p.stem for p in HERE.glob("[!_]*.py") if p.stem != "table")
    return list(BENCHMARKS) + [n for n in others if n not in BENCHMARKS]


def platform() -> str:
    """Where JAX runs for the benchmarks (`benchmarks/_common.py`'s `backend`)."""
    done = subprocess.run(
        [sys.executable, "-c", "from _common import backend; print(backend())"],
        capture_output=True,
        text=True,
        cwd=HERE,
    )
    return done.stdout.strip() or "unknown"


def run(name: str, full: bool) -> tuple[list[dict], str | None, float]:
    """`(measures, the failure or None, seconds)` of one benchmark's run; each
    measure with the `platform` it ran on when the benchmark says so."""
    reports = name in BENCHMARKS
    command = [sys.executable, str(HERE / f"{name}.py")]
    command += ["--json", *ARGS.get(name, [])] if reports else []
    if not full:
        command.append("--quick")
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return [], f"exit {done.returncode}: {tail[:100]}", seconds
    if not reports:
        return [], None, seconds
    lines = done.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1])
        said = {"platform": report["platform"]} if "platform" in report else {}
        return [{**said, **m} for m in report["measures"]], None, seconds
    except (IndexError, ValueError, KeyError, TypeError):
        return [], "no --json line", seconds


def ok(measure: dict) -> bool:
    if measure.get("better", "lower") == "higher":
        return measure["now"] >= measure["goal"]
    return measure["now"] <= measure["goal"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="benchmarks (default: all)")
    parser.add_argument("--full", action="store_true", help="full-size forms")
    args = parser.parse_args()
    names = args.names or everything()
    load = os.getloadavg()[0]
    where = platform()
    rows: list[tuple[str, str, str, str, str]] = []
    failed = False
    for name in names:
        measures, failure, seconds = run(name, args.full)
        print(f"{name}: {seconds:.0f} s", file=sys.stderr)
        if failure is not None:
            rows.append((f"{name}: {failure}", where, "-", "-", "FAILED"))
            failed = True
        elif not measures:
            rows.append(
                (f"{name}: ran (prints no --json ratios yet)", where, "-", "-", "-")
            )
        for m in measures:
            sign = ">=" if m.get("better", "lower") == "higher" else "<="
            good = ok(m)
            failed |= not good
            rows.append(
                (
                    f"{name}: {m['measure']}",
                    m.get("platform", where),
                    f"{m['now']:.2f}",
                    f"{sign} {m['goal']:g}",
                    "ok" if good else "MISSED",
                )
            )
    width = max([len(r[0]) for r in rows] + [7])
    at = max([len(r[1]) for r in rows] + [8])
    form = "quick" if not args.full else "full"
    after = os.getloadavg()[0]
    print(f"benchmarks ({form} forms), load average {load:.1f} -> {after:.1f}")
    print(
        f"{'measure':{width}s} | {'platform':{at}s} | {'now':>6s} | {'goal':>8s} | ok"
    )
    print(f"{'-' * width}-|-{'-' * at}-|-{'-' * 6}-|-{'-' * 8}-|-------")
    for measure, where, now, goal, good in rows:
        print(f"{measure:{width}s} | {where:{at}s} | {now:>6s} | {goal:>8s} | {good}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
