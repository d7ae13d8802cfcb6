"""Conversion cost: bridge's adapters against a plain pytree flatten + unflatten.

For each framework, one model with N array leaves (N/2 layers of a kernel and a bias).
Timed, each against `jax.tree_util.tree_flatten(model)` + `tree_unflatten` of the same
model (the floor: any conversion must at least walk every leaf once): the first
conversion `from_*(model)` (a structure never converted before: the Linen adapter's
cache of recent structures and the cache of natural sort keys emptied first), and
`to_*(tree)`. For Linen, a conversion of a known structure ("from, known"), and for
NNX `nnx.split` + `nnx.merge` (the NNX idiom) are shown too. Runs are interleaved
(ABAB...), medians of CPU time with the garbage collector off; the goal (issue 28) is
a first conversion under 3x the floor at 100k leaves. `--json` prints the six ratios
at the largest size as one JSON line, in `benchmarks/table.py`'s format.

    python benchmarks/convert.py            # 10k and 100k leaves (minutes: NNX
                                            # builds 50k modules)
    python benchmarks/convert.py --quick    # 200 and 2k leaves
    python benchmarks/convert.py --json     # and the JSON line

Measured (2 cores shared with other jobs; ratios move by +-20% with the load), one
full run each, x the floor at 10k / 100k leaves:

| direction    | 0dfcc81, load 7-8 | linen3, load 5-8 | linen4, load 4-5 |
|--------------|-------------------|------------------|------------------|
| from_linen   | 7.86 / 6.28       | 4.55 / 4.37      | 3.36 / 2.69      |
| from, known  | 2.46 / 2.17       | 2.23 / 2.22      | 2.11 / 2.09      |
| to_linen     | 2.67 / 2.16       | 2.82 / 2.40      | 3.17 / 2.08      |
| from_nnx     | 4.19 / -          | 3.73 / -         | 1.51 / -         |
| to_nnx       | 1.63 / -          | 1.57 / -         | 1.43 / -         |
| from_equinox | 2.62 / -          | 2.46 / -         | 2.63 / -         |
| to_equinox   | 0.79 / -          | 0.78 / -         | 0.69 / -         |

Linen's first conversion (linen3, linen4): one walk over the variables
(`_linen_walk._walk`), a node of leaves and a node of alike layers in C-level passes;
each leaf's position among JAX's leaves computed from the structure (JAX lists a
dict's children in sorted key order) and checked by identity in one C pass; the
Tree's treedef made from its children's (`PyTreeDef.from_node_data_and_children`:
alike layers share one); natural and sorted order of many numbered names in C
(`_paths._numbered`); the cache key's walk reads alike layers in C, checked
against JAX's count of inner nodes. Interleaved processes (18df13d / linen4, 3
each, load 4-5), medians: 100k leaves 3.81x -> 2.74x (904 -> 489 ms), 10k 4.09x
-> 2.80x (70 -> 39 ms); from, known 1.96x -> 1.98x (462 -> 371 ms); to_linen
unchanged in ms (505-532 -> 474-509 ms at 100k, 46 -> 43 ms at 10k). The floor
itself ran 15-25% faster in the linen4 processes (less garbage?), which lifts
every ratio of that column: to_linen's 10k ratio 3.17 is 41.7 ms, as before.
to_linen of plain dicts makes alike layers' dicts in C-level passes (linen4, after
the table): 100k leaves 2.35x -> 1.6x (interleaved, 2 processes each, load 4-5).
from_nnx reads the NNX graph in its own walk (`_nnx_walk.py`, nnxwalk).
On the quiet machine (dd4b596, one full run, load 0.2 -> 1.0), x floor at 100k
leaves: from_linen 2.66, to_linen 1.23, from, known 2.00, from_nnx 1.46, to_nnx
1.64, from_equinox 2.69, to_equinox 0.75: every first conversion within 3x.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from _common import interleaved
from flax import nnx

import bridge
from bridge import _paths
from bridge._adapters import _linen_walk


WIDTH = 4


def _arrays(layers: int) -> tuple[list[jax.Array], list[jax.Array]]:
    # one transfer of many host arrays (indexing a JAX array is one dispatch each)
    kernels = jax.device_put(list(np.ones((layers, WIDTH, WIDTH), np.float32)))
    biases = jax.device_put(list(np.zeros((layers, WIDTH), np.float32)))
    return kernels, biases


def linen_variables(layers: int) -> dict:
    kernels, biases = _arrays(layers)
    return {
        "params": {
            f"Dense_{i}": {"kernel": k, "bias": b}
            for i, (k, b) in enumerate(zip(kernels, biases))
        }
    }


class NNXLayer(nnx.Module):
    def __init__(self, kernel, bias):
        self.kernel = nnx.Param(kernel)
        self.bias = nnx.Param(bias)


class NNXStack(nnx.Module):
    def __init__(self, layers: int):
        kernels, biases = _arrays(layers)
        self.layers = nnx.List([NNXLayer(k, b) for k, b in zip(kernels, biases)])


class EquinoxStack(eqx.Module):
    layers: tuple[eqx.nn.Linear, ...]

    def __init__(self, layers: int):
        kernels, biases = _arrays(layers)
        one = eqx.nn.Linear(WIDTH, WIDTH, key=jax.random.key(0))
        treedef = jtu.tree_structure(one)
        self.layers = tuple(
            jtu.tree_unflatten(treedef, [k, b]) for k, b in zip(kernels, biases)
        )


def flatten_unflatten(obj):
    """The floor: `jax.tree_util` flatten + unflatten of the model (any conversion
    must at least walk every leaf once)."""
    leaves, treedef = jtu.tree_flatten(obj)
    return jtu.tree_unflatten(treedef, leaves)


def nnx_split_merge(module):
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, state)


def first_time(convert: Callable[[], object]) -> Callable[[], object]:
    """`convert` as for a structure never converted before: the Linen adapter's
    cache of recent structures and the cache of natural sort keys emptied first."""

    def run():
        _linen_walk._KNOWN.clear()
        _paths._NATURAL.clear()
        return convert()

    return run


def cases(leaves: int) -> dict[str, dict[str, Callable[[], object]]]:
    layers = leaves // 2
    variables = linen_variables(layers)
    module = NNXStack(layers)
    model = EquinoxStack(layers)
    linen_tree = bridge.from_linen(variables)
    nnx_tree = bridge.from_nnx(module)
    equinox_tree = bridge.from_equinox(model)
    return {
        "linen": {
            "floor": lambda: flatten_unflatten(variables),
            "from": first_time(lambda: bridge.from_linen(variables)),
            "to": lambda: bridge.to_linen(linen_tree),
            "from, known": lambda: bridge.from_linen(variables),
        },
        "nnx": {
            "floor": lambda: flatten_unflatten(module),
            "from": first_time(lambda: bridge.from_nnx(module)),
            "to": lambda: bridge.to_nnx(nnx_tree),
            "nnx.split+merge": lambda: nnx_split_merge(module),
        },
        "equinox": {
            "floor": lambda: flatten_unflatten(model),
            "from": first_time(lambda: bridge.from_equinox(model)),
            "to": lambda: bridge.to_equinox(equinox_tree),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument(
        "--json",
        action="store_true",
        help="also print the six ratios at the largest size as one JSON line",
    )
    args = parser.parse_args()
    sizes = [200, 2_000] if args.quick else [10_000, 100_000]
    repeats = 3 if args.quick else 5
    medians: dict[tuple[str, int], dict[str, float]] = {}
    print(f"median of {repeats} interleaved runs (CPU time, garbage collector off)")
    print(f"{'framework':<9} {'leaves':>7} {'what':<16} {'ms':>9} {'x floor':>8}")
    for leaves in sizes:
        for framework, fns in cases(leaves).items():
            result = interleaved(fns, repeats, clock=time.process_time, collect=False)
            medians[(framework, leaves)] = result
            floor = result["floor"]
            for name, seconds in result.items():
                what = f"{name}_{framework}" if name in ("from", "to") else name
                print(
                    f"{framework:<9} {leaves:>7} {what:<16} {seconds * 1e3:>9.2f} "
                    f"{seconds / floor:>7.2f}x"
                )
    small, large = sizes
    print(f"\ngrowth {small} -> {large} leaves (linear: {large / small:.0f}x)")
    for framework in ("linen", "nnx", "equinox"):
        a, b = medians[(framework, small)], medians[(framework, large)]
        print(
            f"{framework:<9} from {b['from'] / a['from']:5.1f}x   "
            f"floor {b['floor'] / a['floor']:5.1f}x"
        )
    print(
        f"\nfirst conversion / flatten+unflatten at {large} leaves "
        f"(goal <= {GOAL:.0f}x)"
    )
    ratios = {}
    for framework in ("linen", "nnx", "equinox"):
        r = medians[(framework, large)]
        for direction in ("from", "to"):
            name = f"{direction}_{framework}"
            ratios[name] = round(r[direction] / r["floor"], 2)
            print(f"{name:<13} {ratios[name]:5.2f}x")
    if args.json:  # benchmarks/table.py's format
        measures = [
            {
                "measure": f"{name} / flatten+unflatten, {large} leaves",
                "now": r,
                "goal": GOAL,
            }
            for name, r in ratios.items()
        ]
        print(json.dumps({"benchmark": "convert", "measures": measures}))


GOAL = 3.0  # issue 28: first conversion <= 3x a flatten+unflatten at 100k leaves


if __name__ == "__main__":
    main()
