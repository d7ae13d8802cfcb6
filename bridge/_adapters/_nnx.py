"""Adapter: Flax NNX modules <-> `bridge.Tree`."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.tree_util as jtu
from flax import nnx
from flax.nnx import variablelib
from flax.nnx.graph import Static

from .._tree import Held, Key, Path, Recent, Tree, build, native_leaves


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
    if isinstance(node, nnx.List) or isinstance(node, (list, tuple)):
        keys: list[Key] = list(range(len(node)))
    elif isinstance(node, nnx.Pytree):  # Module, nnx.Dict, Rngs, RngStream, ...
        keys = list(vars(node))
    elif isinstance(node, Mapping):
        keys = list(node)
    else:
        keys = []  # an unknown node: keep NNX's (sorted) order
    return {k: i for i, k in enumerate(keys)}


def _child(node: Any, key: Key) -> Any:
    if isinstance(node, nnx.List) or not isinstance(node, nnx.Pytree):
        return node[key]  # pyright: ignore[reportCallIssue, reportArgumentType]
    return getattr(node, key)  # pyright: ignore[reportArgumentType]


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
    graphdef, flat = nnx.graph.flatten(module)  # as nnx.split, in sorted order
    leaves = flat.leaves
    # a module of the same structure as a recent one (equal graph definitions, and
    # the same classes and attribute order at every node, which they don't record):
    # its Tree structure is known, only the arrays are new
    summary = (type(module), graphdef.num_leaves, len(graphdef.nodes))
    held = Held(graphdef, summary)
    known = _KNOWN.get(summary)
    if known is not None:
        known_def, tree_def, order, checks = known
        # Held compares safely (a static array attribute compares elementwise)
        if known_def == held and _same_nodes(module, checks):
            return jtu.tree_unflatten(tree_def, [_value(leaves[i]) for i in order])
    paths: list[Path] = [tuple(p) for p in flat.paths]  # pyright: ignore

    kinds: dict[Path, Any] = {(): type(module)}
    orders: dict[Path, dict[Key, int]] = {}
    nodes: dict[Path, Any] = {(): module}

    def sort_key(path: Path) -> tuple[int, ...]:
        out = []
        for depth, key in enumerate(path):
            prefix = path[:depth]
            order = orders.get(prefix)
            if order is None:
                order = orders[prefix] = _child_order(nodes[prefix])
            out.append(order.get(key, len(order)))
            here = prefix + (key,)
            if depth < len(path) - 1 and here not in nodes:
                nodes[here] = _child(nodes[prefix], key)
                kinds[here] = type(nodes[here])
        return tuple(out)

    order = sorted(range(len(paths)), key=lambda i: sort_key(paths[i]))
    entries = []
    for i in order:
        role, value = _role_and_value(leaves[i])
        entries.append((paths[i], role, value, i))
    # parents before children: each node's class and attribute order (nnx.merge
    # sets attributes in sorted order: to_nnx restores the definition order)
    checks = tuple((path, kinds[path], _keys(node)) for path, node in nodes.items())
    layout = tuple((path, keys) for path, _, keys in checks)
    record = (held, _mutable_statics(graphdef), layout)
    tree = build(entries, kinds, "nnx", record)
    src = tree._info.source
    _KNOWN.put(summary, (held, src._treedef, src.order, checks))  # pyright: ignore
    return tree


# recently converted structures: summary -> (graphdef, the Tree's treedef, its leaf
# order, each node's path, class and attribute order)
_KNOWN = Recent()


def _keys(node: Any) -> tuple | None:
    attributes = _attributes(node)
    return None if attributes is None else tuple(attributes)


def _same_nodes(module: nnx.Module, checks: tuple) -> bool:
    """Whether `module`'s nodes have these classes and attribute orders."""
    nodes: dict[Path, Any] = {}
    for path, kind, keys in checks:
        node = _child(nodes[path[:-1]], path[-1]) if path else module
        if type(node) is not kind or _keys(node) != keys:
            return False
        nodes[path] = node
    return True


_ROLES: dict[type, str] = {}


def _value(leaf: Any) -> Any:
    """A Variable's array (its type is in `_ROLES` once `_role_and_value` saw it),
    or an array attribute itself."""
    return leaf.get_raw_value() if type(leaf) in _ROLES else leaf


def _role_and_value(leaf: Any) -> tuple[str, Any]:
    if not isinstance(leaf, nnx.Variable):
        return "state", leaf  # an array attribute that is not a Variable
    cls = type(leaf)
    role = _ROLES.get(cls)
    if role is None:
        role = _ROLES[cls] = role_of(cls)
    return role, leaf.get_raw_value()


def _mutable_statics(graphdef: Any) -> tuple[int, ...]:
    """Positions of static attributes holding mutable containers (a list of layer
    sizes, ...): `nnx.merge` would share them with the source module."""
    return tuple(
        i
        for i, (key, attr) in enumerate(graphdef.attributes)
        if type(attr) is Static
        and key != "_pytree__nodes"  # flax copies this one on write
        and isinstance(attr.value, (list, dict, set, bytearray))
    )


def to_nnx(tree: Tree) -> nnx.Module:
    """Rebuild the NNX module of a `bridge.Tree` made by `bridge.from_nnx`.

    The result is a new module of the same class that shares no Variable with the
    source module; its Variables hold the Tree's arrays (not copied). Shared (tied)
    submodules and Variables stay shared; attributes come in the source's definition
    order, and mutable static attributes (a list of layer sizes) are copies. Leaves
    changed with `eqx.tree_at` (values, shapes, dtypes) are taken as they are.

    **Arguments:**

    - `tree`: a `bridge.Tree` from `bridge.from_nnx`, with the same leaf paths.

    **Returns:**

    An `nnx.Module`.
    """
    src, leaves = native_leaves(tree, "nnx")
    held, mutable, layout = src.record  # pyright: ignore
    graphdef = held.value
    if mutable:  # give the new module its own copies
        attributes = list(graphdef.attributes)
        for i in mutable:
            key, attr = attributes[i]
            attributes[i] = (key, Static(copy.deepcopy(attr.value)))
        graphdef = dataclasses.replace(graphdef, attributes=attributes)
    module = nnx.merge(graphdef, leaves)
    _reorder(module, layout)
    return module


def _attributes(node: Any) -> dict | None:
    """The dict whose order is a node's child order: `vars` of a module (or other
    `nnx.Pytree`), a plain dict itself; None for sequences."""
    if isinstance(node, nnx.List):
        return None
    if isinstance(node, nnx.Pytree):
        return vars(node)
    return node if type(node) is dict else None


def _reorder(module: nnx.Module, layout: tuple) -> None:
    """Put each new node's attributes in the source's definition order (`vars`
    order: what `repr` shows, and what `bridge.from_nnx` reads the order from).
    `layout` is every node's `(path, attribute keys)`, parents before children."""
    nodes: dict[Path, Any] = {}
    for path, keys in layout:
        node = nodes[path] = _child(nodes[path[:-1]], path[-1]) if path else module
        if keys is None:
            continue
        attributes = _attributes(node)
        if attributes is not None and tuple(attributes) != keys:
            ordered = {k: attributes[k] for k in keys if k in attributes}
            ordered.update(attributes)
            attributes.clear()
            attributes.update(ordered)
