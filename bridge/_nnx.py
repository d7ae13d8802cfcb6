"""Adapter: Flax NNX modules <-> `bridge.Tree`."""

from __future__ import annotations

from typing import Any

import jax.tree_util as jtu
from flax import nnx
from flax.nnx import variablelib

from ._tree import Key, Path, Tree, build, key_of, native_leaves


def role_of(variable_type: type) -> str:
    """The collection flax's own bridge maps an NNX Variable type to."""
    for name, registered in variablelib.VariableTypeCache.items():
        if variable_type is registered:
            return name
    if issubclass(variable_type, nnx.RngState):
        return "rngs"
    return variable_type.__name__


def _child_order(node: Any) -> dict[Key, int]:
    """Definition order of a graph node's children (NNX state keys are sorted)."""
    if isinstance(node, nnx.Module) or not hasattr(node, "__getitem__"):
        keys = list(vars(node))
    elif hasattr(node, "keys"):
        keys = list(node.keys())
    else:
        keys = list(range(len(node)))
    return {k: i for i, k in enumerate(keys)}


def _child(node: Any, key: Key) -> Any:
    if isinstance(key, str) and not hasattr(node, "keys"):
        return getattr(node, key)
    return node[key]


def from_nnx(module: nnx.Module) -> Tree:
    """Convert a Flax NNX module to a `bridge.Tree`, without copying any array.

    The Tree reads like the module (`t.layers[-1].kernel`), its children in definition
    order. Every Variable becomes a leaf (its raw array) with the role of its type:
    `Param` -> `"params"`, `BatchStat` -> `"batch_stats"`, `RngKey`/`RngCount` ->
    `"rngs"`, ... The graph definition (static attributes, Variable metadata such as
    sharding annotations, which submodules are shared) is kept as static metadata. A
    Variable shared by several submodules (tied weights) appears once, at the path
    `nnx.state` gives it, and stays shared through `bridge.to_nnx`.

    **Arguments:**

    - `module`: an `nnx.Module`. It is not modified.

    **Returns:**

    A `bridge.Tree`.

    **Example:**

    ```python
    >>> import bridge
    >>> from flax import nnx
    >>> t = bridge.from_nnx(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> t.kernel.shape
    (2, 3)

    ```
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"bridge.from_nnx expects an nnx.Module, got {type(module).__name__}. "
            "For Linen variables use bridge.from_linen, for Equinox models "
            "bridge.from_equinox, or bridge.to_neutral for any of them."
        )
    graphdef, state = nnx.split(module)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    flat, state_def = jtu.tree_flatten_with_path(state, is_leaf=is_var)

    kinds: dict[Path, Any] = {(): type(module)}
    orders: dict[Path, dict[Key, int]] = {}
    nodes: dict[Path, Any] = {(): module}

    def sort_key(path: Path) -> tuple[int, ...]:
        out = []
        for depth, key in enumerate(path):
            prefix = path[:depth]
            if prefix not in orders:
                orders[prefix] = _child_order(nodes[prefix])
            out.append(orders[prefix].get(key, len(orders[prefix])))
            here = prefix + (key,)
            if here not in nodes and depth < len(path) - 1:
                nodes[here] = _child(nodes[prefix], key)
                kinds[here] = type(nodes[here])
        return tuple(out)

    paths = [tuple(key_of(e) for e in p) for p, _ in flat]
    order = sorted(range(len(flat)), key=lambda i: sort_key(paths[i]))
    entries = [
        (paths[i], role_of(type(v)), _value(v), i) for i, (_, v) in enumerate(flat)
    ]
    entries = [entries[i] for i in order]
    return build(entries, kinds, "nnx", (graphdef, state_def))


def _value(variable: nnx.Variable) -> Any:
    # flax >= 0.12: get_value(); before: .value (both return the stored array)
    get = getattr(variable, "get_value", None)
    return get() if get is not None else variable.value


def to_nnx(tree: Tree) -> nnx.Module:
    """Rebuild the NNX module of a `bridge.Tree` made by `bridge.from_nnx`.

    The result is a new module of the same class that shares no Variable with the
    source module; its Variables hold the Tree's arrays (not copied). Shared (tied)
    submodules and Variables stay shared. Leaves changed with `eqx.tree_at` (values,
    shapes, dtypes) are taken as they are.

    **Arguments:**

    - `tree`: a `bridge.Tree` from `bridge.from_nnx`, with the same leaf paths.

    **Returns:**

    An `nnx.Module`.
    """
    src, leaves = native_leaves(tree, "nnx")
    graphdef, state_def = src.record  # pyright: ignore[reportGeneralTypeIssues]
    state = jtu.tree_unflatten(state_def, leaves)
    return nnx.merge(graphdef, state)
