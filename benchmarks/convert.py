"""Conversion cost: bridge's adapters against a plain pytree flatten + unflatten.

For each framework, one model with N array leaves (N/2 layers of a kernel and a bias),
and one round trip `to_*(from_*(model))` timed against
`jax.tree_util.tree_flatten_with_path(model)` + `tree_unflatten` of the same model
(the floor: any conversion must at least walk every leaf once). For NNX the module is
a pytree in flax 0.12, and `nnx.split` + `nnx.merge` (the NNX idiom) is shown too.
The Linen adapter remembers the last few structures it converted, so converting the
variables again (the usual case: the same model after some training steps) skips most
Python work; "1st time" is a structure never seen before. (The NNX adapter kept such a
cache too; it saved under 3% of a conversion, whose cost is NNX's own graph walk,
so it was removed.) Runs are interleaved (ABAB...),
medians and ratios are printed; the goal is a ratio under 3x. Conversion must grow
linearly with the leaves: 1k and 10k are both shown.

    python benchmarks/convert.py            # 1k and 10k leaves
    python benchmarks/convert.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from _common import interleaved
from flax import nnx

import bridge
from bridge._adapters import _linen
from bridge._adapters._build import Recent


WIDTH = 4


def _arrays(layers: int) -> tuple[list[jax.Array], list[jax.Array]]:
    kernels = list(jnp.ones((layers, WIDTH, WIDTH)))
    biases = list(jnp.zeros((layers, WIDTH)))
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


def pytree_round_trip(obj):
    flat, treedef = jtu.tree_flatten_with_path(obj)
    return jtu.tree_unflatten(treedef, [leaf for _, leaf in flat])


def nnx_split_merge(module):
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, state)


def first_time(convert: Callable[[], object], cache: Recent) -> Callable[[], object]:
    """`convert` as for a structure never converted before (the Linen adapter
    remembers the last few structures, so a second conversion skips most Python
    work)."""

    def run():
        cache.clear()
        return convert()

    return run


def cases(leaves: int) -> dict[str, dict[str, Callable[[], object]]]:
    layers = leaves // 2
    variables = linen_variables(layers)
    module = NNXStack(layers)
    model = EquinoxStack(layers)
    linen_trip = lambda: bridge.to_linen(bridge.from_linen(variables))  # noqa: E731
    nnx_trip = lambda: bridge.to_nnx(bridge.from_nnx(module))  # noqa: E731
    return {
        "linen": {
            "floor": lambda: pytree_round_trip(variables),
            "bridge": linen_trip,
            "from_linen": lambda: bridge.from_linen(variables),
            "bridge, 1st time": first_time(linen_trip, _linen._KNOWN),
        },
        "nnx": {
            "floor": lambda: pytree_round_trip(module),
            "bridge": nnx_trip,
            "from_nnx": lambda: bridge.from_nnx(module),
            "nnx.split+merge": lambda: nnx_split_merge(module),
        },
        "equinox": {
            "floor": lambda: pytree_round_trip(model),
            "bridge": lambda: bridge.to_equinox(bridge.from_equinox(model)),
            "from_equinox": lambda: bridge.from_equinox(model),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    sizes = [200, 1000] if args.quick else [1_000, 10_000]
    repeats = 3 if args.quick else 7
    medians: dict[tuple[str, int], dict[str, float]] = {}
    print(f"round trip to_*(from_*(model)), median of {repeats} interleaved runs")
    print(f"{'framework':<9} {'leaves':>7} {'what':<17} {'ms':>9} {'x floor':>8}")
    for leaves in sizes:
        for framework, fns in cases(leaves).items():
            result = interleaved(fns, repeats, clock=time.process_time, collect=False)
            medians[(framework, leaves)] = result
            floor = result["floor"]
            for name, seconds in result.items():
                print(
                    f"{framework:<9} {leaves:>7} {name:<17} {seconds * 1e3:>9.2f} "
                    f"{seconds / floor:>7.2f}x"
                )
    small, large = sizes
    print(f"\ngrowth {small} -> {large} leaves (linear: {large / small:.0f}x)")
    for framework in ("linen", "nnx", "equinox"):
        a, b = medians[(framework, small)], medians[(framework, large)]
        print(
            f"{framework:<9} bridge {b['bridge'] / a['bridge']:5.1f}x   "
            f"floor {b['floor'] / a['floor']:5.1f}x"
        )
    print("\nratio bridge round trip / floor (goal < 3x)")
    for framework in ("linen", "nnx", "equinox"):
        r = medians[(framework, large)]
        line = f"{framework:<9} {r['bridge'] / r['floor']:5.2f}x"
        if framework == "nnx":
            idiom = r["nnx.split+merge"]
            line += (
                f"   (nnx.split+merge is {idiom / r['floor']:.2f}x the floor; "
                f"bridge is {r['bridge'] / idiom:.2f}x nnx.split+merge)"
            )
        print(line)


if __name__ == "__main__":
    main()
