"""Walk `bridge.load`'s `like` (and `bridge.port`'s `source`) through the code: the
modules it passes through, and how often the walk climbs back up the import layers.

Every Python call made inside one `bridge.load(path, like=...)` (or one
`bridge.port(source, target)`) is recorded with `sys.setprofile`, on the calling
thread. The walk follows the object: a call into a `bridge` function carries it when
one of its arguments is the object, or holds it one level down (a tuple, a named
tuple such as a request record, a list, a dict's values), or is a form of it an
earlier call that carried it returned (a `bridge.Tree`: `to_neutral(like)`; an object
of its type: `placeholders(like)`). Then:

- rooms: the `bridge` modules the walk visits, above the floor every module stands on
  (layers 0 and 1: `_tree`, `_paths`, `_lazy`, ...; a Tree's accessor is no room);
- stays: the walk as the sequence of the rooms of the calls that carry the object,
  consecutive repeats merged;
- climbs: the steps of that sequence from a module of a lower import layer to one of
  a higher layer (the layers of `tests/test_imports.py`), whether the higher one is
  called or returned to: `_io -> _quant -> _adapters -> _port` climbs twice;
- calls up: apart from the walk, every call from a `bridge` module of a lower layer
  into a higher one (a call is attributed to the nearest `bridge` frame below it, so
  a callback `jax.tree_util` makes counts as made by the `bridge` code that called
  jax), with the distinct `caller -> callee` functions that make them (`--climbs`).

Each scenario runs once untraced (compiles, caches) and once traced, on tiny models.

    PYTHONPATH=$PWD python scripts/walk_layers.py            # the table
    PYTHONPATH=$PWD python scripts/walk_layers.py --climbs   # and where
    # older code, today's layers:
    PYTHONPATH=OLD python scripts/walk_layers.py --layers tests/test_imports.py
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
    stays: list[str]  # the modules of the calls that carry the object, merged
    climbs: list[tuple[str, str]]  # the steps up of `stays`
    calls_up: collections.Counter  # (caller function, callee function) -> calls


def _where(frame: Any) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name == "bridge" or name.startswith("bridge.") else None


def _arguments(frame: Any) -> list[Any]:
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    n += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)  # *args, **kwargs
    values = frame.f_locals
    return [values[k] for k in code.co_varnames[:n] if k in values]


def _held(value: Any) -> list[Any]:
    """`value` and what it holds one level down."""
    if isinstance(value, tuple | list):
        return [value, *value]
    if isinstance(value, dict):
        return [value, *value.values()]
    return [value]


# the layers every room stands on (`_tree`, `_paths`, `_lazy`, ...): a call into them
# (a Tree's accessor, a path helper) is no stay of the walk
FLOOR = 1


def walk(
    run: Callable[[], Any], carried: Any, layer: Callable[[str], int | None]
) -> Walk:
    """Trace `run()`, following `carried` (see the module's note)."""
    from bridge import Tree

    tracked: dict[int, Any] = {id(carried): carried}  # kept alive: ids stay unique
    carrying: set[int] = set()  # frames of the calls that carry it
    rooms: set[str] = set()
    stays: list[str] = []
    calls_up: collections.Counter = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        callee = _where(frame)
        if callee is None:
            return
        if event == "return":
            if id(frame) in carrying:
                carrying.discard(id(frame))
                for value in _held(arg):
                    if isinstance(value, Tree | type(carried)):
                        tracked.setdefault(id(value), value)
            return
        if event != "call":
            return
        values = [v for a in _arguments(frame) for v in _held(a)]
        if any(id(v) in tracked for v in values):
            carrying.add(id(frame))
            floor = layer(callee)
            if floor is not None and floor > FLOOR:
                rooms.add(callee)
                if not stays or stays[-1] != callee:
                    stays.append(callee)
        caller_frame = frame.f_back
        while caller_frame is not None and _where(caller_frame) is None:
            caller_frame = caller_frame.f_back
        caller = None if caller_frame is None else _where(caller_frame)
        if caller_frame is None or caller is None:
            return
        here, there = layer(caller), layer(callee)
        if here is not None and there is not None and there > here:
            what = (
                f"{caller}.{caller_frame.f_code.co_name}",
                f"{callee}.{frame.f_code.co_name}",
            )
            calls_up[what] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    climbs = []
    for a, b in zip(stays, stays[1:]):
        low, high = layer(a), layer(b)
        if low is not None and high is not None and high > low:
            climbs.append((a, b))
    return Walk(rooms, stays, climbs, calls_up)


# --- the scenarios: tiny models, named as transformers names a Llama's MLP ----------
D, HIDDEN = 128, 256


class Node(nnx.Module):
    def __init__(self, **children: Any) -> None:
        self.names = tuple(children)
        for name, child in children.items():
            setattr(self, name, child)

    def __call__(self, x: Any) -> Any:  # the children in turn, a list's items too
        for name in self.names:
            child = getattr(self, name)
            for module in child if isinstance(child, nnx.List) else [child]:
                x = module(x)
        return x


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

        def __call__(self, x: Any) -> Any:
            return self.down_proj(self.gate_proj(x))

    class Layer(eqx.Module):
        mlp: MLP

        def __call__(self, x: Any) -> Any:
            return self.mlp(x)

    class Layers(eqx.Module):
        layers: list

        def __call__(self, x: Any) -> Any:
            for layer in self.layers:
                x = layer(x)
            return x

    class Model(eqx.Module):
        model: Layers

        def __call__(self, x: Any) -> Any:
            return self.model(x)

    k1, k2 = jax.random.split(jax.random.key(0))
    mlp = MLP(
        eqx.nn.Linear(D, HIDDEN, use_bias=False, key=k1),
        eqx.nn.Linear(HIDDEN, D, use_bias=False, key=k2),
    )
    return Model(Layers([Layer(mlp)]))


def scenarios(folder: Path) -> dict[str, tuple[Callable[[], Any], Any]]:
    """`{name: (run, the object its walk follows)}`."""
    import bridge

    plain, fp8 = folder / "nnx.safetensors", folder / "fp8"
    fp8.mkdir()
    bridge.save(plain, nnx_model())
    bridge.save_quantized(fp8 / "model.safetensors", nnx_model(), "fp8-block")
    abstract = nnx.eval_shape(lambda: nnx_model(1))
    equinox, source, target = eqx_model(), nnx_model(), eqx_model()
    f32 = jnp.float32
    x = jnp.ones((2, D), f32)
    return {
        "load, same framework": (lambda: bridge.load(plain, like=abstract), abstract),
        "load, ported (NNX file -> Equinox)": (
            lambda: bridge.load(plain, like=equinox),
            equinox,
        ),
        "load, FP8 dequantized": (
            lambda: bridge.load(fp8, like=abstract, dtype=f32),
            abstract,
        ),
        "load, FP8 kept quantized": (
            lambda: bridge.load(fp8, like=abstract, keep_quantized=True),
            abstract,
        ),
        "port (NNX -> Equinox)": (lambda: bridge.port(source, target), source),
        "port, traced (example=)": (
            lambda: bridge.port(source, target, example=(x,)),
            source,
        ),
        "port_plan, traced (example=)": (
            lambda: bridge.port_plan(source, target, example=(x,)),
            source,
        ),
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
        for name, (run, carried) in scenarios(Path(tmp)).items():
            run()  # compile and fill caches untraced
            rows[name] = walk(run, carried, layer)
    head = f"{'walk':36} {'rooms':>5} {'stays':>5} {'climbs':>6} {'calls up':>8}"
    print(head)
    for name, w in rows.items():
        up = sum(w.calls_up.values())
        print(f"{name:36} {len(w.rooms):5} {len(w.stays):5} {len(w.climbs):6} {up:8}")
        if args.climbs:
            print("    walk: " + " > ".join(_short(r) for r in w.stays))
            for (caller, callee), n in sorted(w.calls_up.items()):
                print(f"    call up: {caller} -> {callee}  x{n}")
    if args.json:
        figures = {
            name: {
                "rooms": sorted(w.rooms),
                "stays": w.stays,
                "climbs": [f"{a} -> {b}" for a, b in w.climbs],
                "calls_up": {f"{a} -> {b}": n for (a, b), n in w.calls_up.items()},
            }
            for name, w in rows.items()
        }
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


def _short(module: str) -> str:
    return module.removeprefix("bridge.")


if __name__ == "__main__":
    main()
