"""Walk `bridge.load`'s `like` (and `bridge.port`'s `source`) through the code: which
modules one call visits, and how often it climbs back up the import layers.

Every Python call made inside one `bridge.load(path, like=...)` (or one
`bridge.port(source, target)`) is recorded with `sys.setprofile`, on the calling
thread. A call into a `bridge` module is attributed to the nearest `bridge` frame
below it on the stack (a callback that `jax.tree_util` or `jax.make_jaxpr` makes
counts as a call from the `bridge` code that called jax). Then:

- rooms: the `bridge` modules visited;
- stays: the walk as a sequence of rooms (each call's caller's room, then its
  callee's, with consecutive repeats merged): how many times the walk moves in;
- climbs: calls from a module of a lower import layer into one of a higher layer
  (the layers of `tests/test_imports.py`: `_io` calling a plug-in registered from
  `_quant`, `_port` reading an array whose reader `_quant` made). Shown as the
  number of such calls and the distinct `caller -> callee` functions that make them.

Each scenario runs once untraced (compiles, caches) and once traced, on tiny models:
the figures do not grow with a model's size except where a climb is made per array
(listed with its count).

    PYTHONPATH=$PWD python scripts/walk_layers.py            # the table
    PYTHONPATH=$PWD python scripts/walk_layers.py --climbs   # and every climb
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx


ROOT = Path(__file__).resolve().parent.parent


def _layers(table: Path) -> Callable[[str], int | None]:
    """`tests/test_imports.py`'s layer of a module name (one table, not a copy)."""
    spec = importlib.util.spec_from_file_location("_test_imports", table)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._layer


class Walk(NamedTuple):
    rooms: set[str]
    stays: list[str]
    climbs: collections.Counter  # (caller function, callee function) -> calls


def _where(frame: Any) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name == "bridge" or name.startswith("bridge.") else None


def walk(run: Callable[[], Any], layer: Callable[[str], int | None]) -> Walk:
    """Trace `run()` (see the module's note)."""
    rooms: set[str] = set()
    stays: list[str] = []
    climbs: collections.Counter = collections.Counter()

    def enter(room: str) -> None:
        rooms.add(room)
        if not stays or stays[-1] != room:
            stays.append(room)

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = _where(frame)
        if callee is None:
            return
        caller_frame = frame.f_back
        while caller_frame is not None and _where(caller_frame) is None:
            caller_frame = caller_frame.f_back
        if caller_frame is None:  # the call from this script
            enter(callee)
            return
        caller = _where(caller_frame)
        assert caller is not None
        enter(caller)
        enter(callee)
        here, there = layer(caller), layer(callee)
        if here is not None and there is not None and there > here:
            what = (
                f"{caller}.{caller_frame.f_code.co_name}",
                f"{callee}.{frame.f_code.co_name}",
            )
            climbs[what] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return Walk(rooms, stays, climbs)


# --- the scenarios: tiny models, named as transformers names a Llama's MLP ----------
D, HIDDEN = 128, 256


class Node(nnx.Module):
    def __init__(self, **children: Any) -> None:
        for name, child in children.items():
            setattr(self, name, child)


def nnx_model(seed: int = 0) -> Node:
    rngs = nnx.Rngs(seed)
    linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
    mlp = Node(gate_proj=linear(D, HIDDEN), down_proj=linear(HIDDEN, D))
    return Node(model=Node(layers=nnx.List([Node(mlp=mlp)])))


def eqx_model() -> Any:
    import equinox as eqx

    class MLP(eqx.Module):
        gate_proj: eqx.nn.Linear
        down_proj: eqx.nn.Linear

    class Layer(eqx.Module):
        mlp: MLP

    class Layers(eqx.Module):
        layers: list

    class Model(eqx.Module):
        model: Layers

    k1, k2 = jax.random.split(jax.random.key(0))
    mlp = MLP(
        eqx.nn.Linear(D, HIDDEN, use_bias=False, key=k1),
        eqx.nn.Linear(HIDDEN, D, use_bias=False, key=k2),
    )
    return Model(Layers([Layer(mlp)]))


def scenarios(folder: Path) -> dict[str, Callable[[], Any]]:
    import bridge

    plain, fp8 = folder / "nnx.safetensors", folder / "fp8"
    fp8.mkdir()
    bridge.save(plain, nnx_model())
    bridge.save(
        fp8 / "model.safetensors", nnx_model(), layout="torch", quantize="fp8-block"
    )
    abstract = lambda: nnx.eval_shape(lambda: nnx_model(1))  # noqa: E731
    source, target = nnx_model(), eqx_model()
    return {
        "load, same framework": lambda: bridge.load(plain, like=abstract()),
        "load, ported (NNX file -> Equinox)": lambda: bridge.load(
            plain, like=eqx_model()
        ),
        "load, FP8 dequantized": lambda: bridge.load(
            fp8, like=abstract(), dtype=jnp.float32
        ),
        "load, FP8 kept quantized": lambda: bridge.load(
            fp8, like=abstract(), keep_quantized=True
        ),
        "load, no like": lambda: bridge.load(plain),
        "port (NNX -> Equinox)": lambda: bridge.port(source, target),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--climbs", action="store_true", help="list every climb")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--layers",
        default=ROOT / "tests" / "test_imports.py",
        type=Path,
        help="the test file whose LAYERS decide (to walk older code with today's)",
    )
    args = parser.parse_args()
    layer = _layers(args.layers)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in scenarios(Path(tmp)).items():
            run()  # compile and fill caches untraced
            found = walk(run, layer)
            rows[name] = found
    print(f"{'walk':40} {'rooms':>5} {'stays':>5} {'climbs':>6} {'places':>6}")
    for name, w in rows.items():
        calls = sum(w.climbs.values())
        print(
            f"{name:40} {len(w.rooms):5} {len(w.stays):5} {calls:6} {len(w.climbs):6}"
        )
        if args.climbs:
            for (caller, callee), n in sorted(w.climbs.items()):
                print(f"    {caller} -> {callee}  x{n}")
    if args.json:
        figures = {
            name: {
                "rooms": sorted(w.rooms),
                "stays": len(w.stays),
                "climbs": sum(w.climbs.values()),
                "places": [
                    f"{a} -> {b} x{n}" for (a, b), n in sorted(w.climbs.items())
                ],
            }
            for name, w in rows.items()
        }
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
