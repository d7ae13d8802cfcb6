"""Each layer's output in a JAX model's forward pass, for `bridge.compare`'s
differences layer by layer (the first layer where two ports part is where a wrong
pairing or layout is).

The forward pass is traced (`jax.make_jaxpr`, as `_trace.first_uses` traces it)
and run again by an interpreter under one `jax.jit`, which keeps, for every array
of the model, the result of the first operation that uses it on an activation (a
kernel's product, a bias's addition, a table's lookup, a norm's scale); a layer's
output is the last of its arrays' (the bias added after the product). Calls inside
the pass (`jit`, `custom_jvp`, `checkpoint`) are entered; a loop over layers
(`scan`) is one operation, its layers not told apart.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core
import numpy as np

from .._adapters._native import to_native, to_neutral
from .._paths import Path, path_str
from .._tree import map_with_path


_CALLS = frozenset(
    {
        "pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
        "custom_vjp_call", "custom_vjp_call_jaxpr", "checkpoint", "remat",
    }
)  # fmt: skip
"""Primitives that call a computation of their own, entered by the interpreter."""


class Output(NamedTuple):
    """A layer's output: its `rank` in the forward pass and its `value`."""

    rank: int
    value: np.ndarray


def layer_outputs(model: Any, run: Any, inputs: Sequence[Any]) -> dict[str, Output]:
    """`{layer path (keystr): its Output}` of `model` (any JAX framework's) when
    `run(native model, inputs)` runs it, in the order the pass computes them.

    **Raises:**

    Whatever tracing the model raises (a PyTorch module cannot be traced by JAX).
    """
    tree = to_neutral(model)
    paths: list[Path] = []
    map_with_path(lambda p, _: paths.append(p), tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)

    def forward(leaves: list[Any], xs: list[Any]) -> Any:
        return run(to_native(jax.tree_util.tree_unflatten(treedef, leaves)), xs)

    closed = jax.make_jaxpr(forward)(leaves, list(inputs))
    ranks: dict[int, int] = {}

    def kept(leaves: list[Any], xs: list[Any]) -> dict[int, Any]:
        args = [*leaves, *jax.tree_util.tree_leaves(xs)]
        origin = {v: i for i, v in enumerate(closed.jaxpr.invars[: len(leaves)])}
        found: dict[int, Any] = {}
        _interpret(closed.jaxpr, closed.consts, args, origin, found, ranks)
        return found

    values = jax.jit(kept)(leaves, list(inputs))
    by_layer: dict[str, Output] = {}
    for i, value in values.items():
        layer = path_str(paths[i][:-1])
        rank = ranks[i]
        if layer not in by_layer or by_layer[layer].rank < rank:
            by_layer[layer] = Output(rank, np.asarray(value))
    return dict(sorted(by_layer.items(), key=lambda kv: kv[1].rank))


def _literal(v: Any) -> bool:
    return isinstance(v, jax.extend.core.Literal)


def _called(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """`(jaxpr, consts)` of the computation a call-like equation runs."""
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None:
            return getattr(sub, "jaxpr", sub), getattr(sub, "consts", ())
    return None


_clock = itertools.count()


def _interpret(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    origin: Mapping[Any, int],
    found: dict[int, Any],
    ranks: dict[int, int],
) -> list[Any]:
    """Run `jaxpr` on `args`, keeping in `found` (and its rank in `ranks`) the
    result of the first operation that uses each model array (`origin`: the
    variables computed from one array alone, by its index) with an activation."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    origin = dict(origin)

    def read(v: Any) -> Any:
        return v.val if _literal(v) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        sources = [origin.get(v) for v in eqn.invars if not _literal(v)]
        called = _called(eqn)
        if called is not None:
            inner, inner_consts = called
            passed = {
                iv: origin[ov]
                for iv, ov in zip(inner.invars, eqn.invars)
                if not _literal(ov) and ov in origin
            }
            outs = _interpret(inner, inner_consts, invals, passed, found, ranks)
        else:
            bound = eqn.primitive.get_bind_params(eqn.params)
            # jax >= 0.7: the params; before: (sub-functions, params)
            subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
            outs = eqn.primitive.bind(*subfuns, *invals, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
            arrays = [s for s in sources if s is not None]
            if arrays and len(arrays) == len(sources):  # the array alone, relaid out
                origin.update(dict.fromkeys(eqn.outvars, arrays[0]))
            elif arrays and outs:  # an array used on an activation: its layer's
                for i in arrays:
                    if i not in found:
                        found[i], ranks[i] = outs[0], next(_clock)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def difference(a: np.ndarray, b: np.ndarray) -> float | None:
    """The largest absolute difference of two layers' outputs, laid out alike, or
    by another layout of the same values (channels first or last, heads apart or
    together: `b` reshaped, or its axes permuted, to `a`'s shape, the closest
    taken); None where no layout makes them comparable."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size != b.size or a.size == 0:
        return None
    candidates = [b.reshape(a.shape)]
    if b.ndim <= 6 and sorted(a.shape) == sorted(b.shape):
        for axes in itertools.permutations(range(b.ndim)):
            if tuple(b.shape[i] for i in axes) == a.shape:
                candidates.append(np.transpose(b, axes))
    return min(float(np.max(np.abs(a - c))) for c in candidates)
