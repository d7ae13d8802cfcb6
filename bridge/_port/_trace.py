"""Where the forward pass first uses each parameter: an order no sorting destroys.

Given example inputs, a model's forward pass is traced abstractly (`jax.make_jaxpr`
of its adapter's `infer` on `jax.ShapeDtypeStruct`s: no FLOPs, no weights
materialised). Every array of the Tree gets the position of the first operation
that reads it, as a tuple of equation indices through nested computations (`pjit`,
`scan`, `cond`, `custom_jvp`, ...). Operations that only relayout an array
(`transpose`, `reshape`, `convert_element_type`, ...) are seen through: the
position is that of the operation that computes with it. An array that enters a
`scan` as a scanned-over input (a stack of layers) gets `ITER` where the iteration
is, which a stack's layer `i` replaces by `i`: layer `i`'s query comes after layer
`i - 1`'s output projection, as in a model of separate layers.

Pairing (`_pairing.Order`) uses these positions where names do not decide: optax,
`nnx.jit`, `eval_shape`, `nnx.clone` and files all change orders of keys, none
changes the computation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.extend.core

from .._adapters._native import to_native
from .._paths import Path
from .._tree import Tree, map_with_path
from ._compare import forward, model_of


ITER = -1
"""In a position, where a scan over a stack iterates (replaced by the layer index)."""

Position = tuple[int, ...]

_SEEN_THROUGH = frozenset(
    {
        "transpose",
        "reshape",
        "convert_element_type",
        "copy",
        "copy_p",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "device_put",
    }
)
"""Primitives that only relayout one array: its first use is that of their output."""


class Example:
    """Example inputs of a port, per side: `(inputs, source's kwargs, target's kwargs)`
    with the batched inputs `compare` takes."""

    def __init__(
        self,
        inputs: Any,
        kwargs: Mapping[str, Any] | tuple[Mapping[str, Any], Mapping[str, Any]] | None,
    ):
        self.inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        if isinstance(kwargs, tuple):
            self.kwargs = (dict(kwargs[0]), dict(kwargs[1]))
        else:
            self.kwargs = (dict(kwargs or {}), dict(kwargs or {}))


def first_uses(
    tree: Tree,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    contracted: dict[Path, tuple[int, ...]] | None = None,
) -> dict[Path, Position]:
    """`{leaf path: position of its first use}` in `tree`'s forward pass on `inputs`,
    traced abstractly; leaves the pass never reads are absent. With `contracted`,
    also fills it with `{leaf path: its axes contracted}` for every leaf whose first
    use is a `dot_general` on the leaf as it is stored (a kernel's input axes: the
    layout the computation gives it).

    **Arguments:**

    - `tree`: a whole-model Tree (its adapter runs it: `bridge.compare`'s way).
    - `inputs`: batched example inputs (arrays or `jax.ShapeDtypeStruct`s).
    - `kwargs`: keyword arguments of the call (`{"train": False}`).
    - `contracted`: optional, filled as said above.

    **Raises:**

    Whatever the model's forward pass raises on these inputs.
    """
    paths: list[Path] = []
    map_with_path(lambda p, _: paths.append(p), tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    examples = [
        jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x
        for x in inputs
    ]
    arrays = [i for i, x in enumerate(examples) if isinstance(x, jax.ShapeDtypeStruct)]

    def run(leaves: list[Any], given: list[Any]) -> Any:
        xs = list(examples)
        for i, x in zip(arrays, given):
            xs[i] = x
        model = to_native(jax.tree_util.tree_unflatten(treedef, leaves))
        channel_first = bool(getattr(model_of(model), "channel_first", False))
        return forward(model, tuple(xs), kwargs, channel_first)

    closed = jax.make_jaxpr(run)(structs, [examples[i] for i in arrays])
    jaxpr = closed.jaxpr
    tracked = {v: (i, ()) for i, v in enumerate(jaxpr.invars[: len(structs)])}
    found: dict[int, Position] = {}
    axes: dict[int, tuple[int, ...]] = {}
    _visit(jaxpr, tracked, found, set(tracked), axes)
    if contracted is not None:
        contracted.update({paths[i]: a for i, a in axes.items()})
    return {paths[i]: pos for i, pos in found.items()}


_SAME_LAYOUT = frozenset({"convert_element_type", "copy", "copy_p", "device_put"})
"""Seen-through primitives that keep an array's axes as they are."""


def _visit(
    jaxpr: Any,
    tracked: dict[Any, tuple[int, Position]],
    found: dict[int, Position],
    stored: set[Any],
    axes: dict[int, tuple[int, ...]],
) -> None:
    """Record in `found` the first use of every leaf a `tracked` variable holds
    (`{var: (leaf, its prefix)}`), in equation order, entering sub-computations;
    in `axes`, the contracted axes of a leaf first used by a `dot_general` on a
    variable of `stored` (the leaf with its stored axes)."""
    for n, eqn in enumerate(jaxpr.eqns):
        used = [
            (i, tracked[v])
            for i, v in enumerate(eqn.invars)
            if not _literal(v) and v in tracked
        ]
        if not used:
            continue
        name = eqn.primitive.name
        if name in _SEEN_THROUGH and len(eqn.outvars) == 1:
            others = [v for v in eqn.invars if not _literal(v)]
            if len(others) == 1:
                tracked[eqn.outvars[0]] = used[0][1]
                if name in _SAME_LAYOUT and others[0] in stored:
                    stored.add(eqn.outvars[0])
                continue
        if name == "dot_general":
            for i, (leaf, _) in used:
                if leaf not in found and eqn.invars[i] in stored and i < 2:
                    (contracting, _batch) = eqn.params["dimension_numbers"]
                    axes.setdefault(leaf, tuple(sorted(contracting[i])))
        scanned = (
            eqn.params.get("num_consts", 0) + eqn.params.get("num_carry", 0)
            if name == "scan"
            else None
        )
        for s, sub in enumerate(_subs(eqn)):
            skip = len(eqn.invars) - len(sub.invars)
            if skip < 0:
                continue
            inner = {}
            for i, (leaf, prefix) in used:
                j = i - skip
                if j < 0:
                    continue
                where = prefix + (n, s)
                if scanned is not None and j >= scanned:
                    where += (ITER,)
                inner[sub.invars[j]] = (leaf, where)
            inner_stored = {
                sub.invars[i - skip]
                for i, v in enumerate(eqn.invars)
                if i >= skip and not _literal(v) and v in stored and scanned is None
            }
            _visit(sub, inner, found, inner_stored, axes)
        for _, (leaf, prefix) in used:
            found.setdefault(leaf, prefix + (n,))


def _subs(eqn: Any) -> list[Any]:
    """The computations an equation runs (a while loop's body, not its condition)."""
    out = []
    for key, value in eqn.params.items():
        if key == "cond_jaxpr":
            continue
        for v in value if isinstance(value, tuple | list) else (value,):
            j = getattr(v, "jaxpr", v)
            if hasattr(j, "eqns") and hasattr(j, "invars"):
                out.append(j)
    return out


def _literal(v: Any) -> bool:
    return isinstance(v, jax.extend.core.Literal)


def layer_position(
    uses: Mapping[Path, Position], leaf_paths: list[Path], index: int | None
) -> Position | None:
    """A layer's position: its first-used array's, with a stack's iteration replaced
    by the layer's `index` (appended where its arrays are not scanned over); None
    when the forward pass uses none of its arrays."""
    positions = [uses[p] for p in leaf_paths if p in uses]
    if not positions:
        return None
    first = min(positions)
    if index is None:
        return first
    if ITER in first:
        return tuple(index if x == ITER else x for x in first)
    return first + (index,)
