"""Adapter: Flax Linen variable collections <-> `bridge.Tree`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.tree_util as jtu

from ._tree import Held, Path, Tree, build, key_of, native_leaves, path_str


_COLLISION = """\
Linen variables collide when organised by module:
{problems}
bridge.Tree merges the collections under each module path, so a name may be used by one
collection only. Rename the variable in one of the collections."""


def from_linen(variables: Mapping[str, Any], module: nn.Module | None = None) -> Tree:
    """Convert Flax Linen variables to a `bridge.Tree`, without copying any array.

    The collections (`params`, `batch_stats`, `cache`, ...) are merged by module, so
    a CNN's Tree reads `t.Conv_0.kernel`, `t.BatchNorm_0.scale`, `t.BatchNorm_0.mean`;
    each leaf's role is its collection. Boxed parameters (`nn.Partitioned`,
    `nn.LogicallyPartitioned`) become their array, the box metadata is kept; `dict`
    and `FrozenDict` containers are remembered, so `bridge.to_linen` gives back the
    very same structure.

    **Arguments:**

    - `variables`: what `module.init` returns: a mapping of collection name to nested
      mappings of arrays. It is not modified.
    - `module`: optional, the `nn.Module` the variables belong to. With it,
      `bridge.to_native` gives the module bound to the variables (callable as
      `native(x)`), and `bridge.make_step` can run it.

    **Returns:**

    A `bridge.Tree`.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, flax.linen as nn, bridge
    >>> model = nn.Dense(3)
    >>> t = bridge.from_linen(model.init(jax.random.key(0), jnp.ones((1, 2))), model)
    >>> t.kernel.shape, bridge.roles(t).kernel
    ((2, 3), 'params')

    ```
    """
    if not isinstance(variables, Mapping):
        raise TypeError(
            "bridge.from_linen expects the variables dict that `module.init` returns "
            f"(collection -> nested mapping of arrays), got {type(variables).__name__}."
            " For an NNX module use bridge.from_nnx, for Equinox bridge.from_equinox."
        )
    if module is not None and not isinstance(module, nn.Module):
        raise TypeError(
            f"`module` must be a flax.linen Module, got {type(module).__name__}."
        )
    if module is not None and module.scope is not None:
        module = module.clone(parent=None)  # a bound module: keep its definition
    orders: dict[Path, tuple] = {}
    entries = _by_module(variables, orders)
    problems = _collisions(entries)
    if problems:
        raise ValueError(_COLLISION.format(problems="\n".join(problems)))
    leaves, treedef = jtu.tree_flatten(variables)
    positions = _positions(variables, leaves, entries)
    kinds = {(): type(module)} if module is not None else {}
    return build(
        [(path, role, leaf, positions[role, *path]) for (path, role, leaf) in entries],
        kinds,
        "linen",
        (treedef, Held(module), tuple(orders.items())),
    )


def _positions(
    variables: Mapping[str, Any], leaves: list[Any], entries: list[tuple]
) -> dict[Path, int]:
    """`(collection, *path)` -> the variable's index among JAX's leaves of
    `variables` (JAX sorts dict keys: `Dense_10` comes before `Dense_2`)."""
    by_id = {id(leaf): i for i, leaf in enumerate(leaves)}
    if len(by_id) == len(leaves) == len(entries):
        # each array object once: its position is where JAX put that object
        found = {(role, *path): by_id.get(id(leaf)) for path, role, leaf in entries}
        if None not in found.values():
            return found
    flat, _ = jtu.tree_flatten_with_path(variables)
    # a box (nn.Partitioned, ...) adds an attribute key (`.value`): drop it
    return {
        tuple(key_of(e) for e in keypath if not isinstance(e, jtu.GetAttrKey)): i
        for i, (keypath, _) in enumerate(flat)
    }


_MAPPING, _BOX, _SEQUENCE, _LEAF = range(4)


_KINDS: dict[type, int] = {}


def _node_kind(cls: type) -> int:
    kind = _KINDS.get(cls)
    if kind is None:
        if issubclass(cls, nn.meta.AxisMetadata):
            kind = _BOX
        elif issubclass(cls, Mapping):
            kind = _MAPPING
        elif issubclass(cls, (tuple, list)):
            kind = _SEQUENCE
        else:
            kind = _LEAF
        _KINDS[cls] = kind
    return kind


def _by_module(
    variables: Mapping[str, Any], orders: dict[Path, tuple]
) -> list[tuple[Path, str, Any]]:
    """`(path, collection, array)` for every variable, grouped by module path.

    Modules come in the order the dicts list them (Linen's creation order, unlike
    JAX's sorted flattening, where `Dense_10` comes before `Dense_2`), `params`
    first; within a module, `params` before the other collections. `orders` gets
    the key order of every mapping not in sorted order, by `(collection, *path)`.
    """
    _note_order(variables, (), orders)
    seen: dict[Path, int] = {}
    found: list[tuple[Path, str, Any]] = []

    def visit(node: Any, path: Path, role: str) -> None:
        if path not in seen:
            seen[path] = len(seen)
        kind = _node_kind(type(node))
        if kind == _BOX:
            node = node.unbox()
            kind = _node_kind(type(node))
        if kind == _MAPPING:
            children = node.items()
            _note_order(node, (role, *path), orders)
        elif kind == _SEQUENCE:
            children = enumerate(node)
        elif node is None:  # an empty subtree for JAX, as in `tree_leaves`
            return
        else:
            found.append((path, role, node))
            return
        for key, child in children:
            visit(child, path + (key,), role)

    names = sorted(variables, key=lambda c: c != "params")
    for name in names:
        visit(variables[name], (), str(name))
    if len(names) == 1:  # one collection: visited module by module already
        return found
    rank = lambda e: tuple(seen[e[0][:d]] for d in range(len(e[0]) + 1))  # noqa: E731
    return sorted(found, key=rank)


def _collisions(entries: list[tuple[Path, str, Any]]) -> list[str]:
    problems, roles = [], {}
    if len({role for _, role, _ in entries}) == 1:  # one collection: no collision
        return [
            f"  collection {r!r} is an array, not a mapping"
            for p, r, _ in entries
            if not p
        ]
    for path, role, _ in entries:
        if not path:
            problems.append(f"  collection {role!r} is an array, not a mapping")
        elif path in roles:
            problems.append(
                f"  {path_str(path)} is in collections {roles[path]!r} and {role!r}"
            )
        roles.setdefault(path, role)
    for path, role, _ in entries:
        for depth in range(1, len(path)):
            if path[:depth] in roles:
                problems.append(
                    f"  {path_str(path[:depth])} is a variable in collection "
                    f"{roles[path[:depth]]!r} and a module in collection {role!r}"
                )
    return problems


def to_linen(tree: Tree) -> dict[str, Any]:
    """Rebuild the Linen variables of a `bridge.Tree` made by `bridge.from_linen`.

    **Arguments:**

    - `tree`: a `bridge.Tree` from `bridge.from_linen`, with the same leaf paths.

    **Returns:**

    The variables, in the container types given to `from_linen` (`dict` stays
    `dict`, `FrozenDict` stays `FrozenDict`), boxes and their metadata restored.
    """
    src, leaves = native_leaves(tree, "linen")
    treedef, _, orders = src.record  # pyright: ignore[reportGeneralTypeIssues]
    variables = jtu.tree_unflatten(treedef, leaves)
    if orders:  # JAX rebuilds dicts in sorted key order: restore the given order
        variables = _reorder(variables, (), dict(orders))
    return variables


def _note_order(node: Mapping, path: Path, orders: dict[Path, tuple]) -> None:
    keys = tuple(node)
    try:
        in_order = list(keys) == sorted(keys)
    except TypeError:  # keys of mixed types
        in_order = False
    if not in_order:
        orders[path] = keys


def _reorder(node: Any, path: Path, orders: dict[Path, tuple]) -> Any:
    """`node` (a mapping at `path`) with every mapping in `orders` in that order."""
    children = {
        key: _reorder(child, path + (key,), orders)
        if _node_kind(type(child)) == _MAPPING
        else child
        for key, child in node.items()
    }
    keys = orders.get(path)
    if keys is not None:
        children = {key: children[key] for key in keys}
    if type(node) is dict:
        return children
    return type(node)(children)  # FrozenDict


def linen_module(tree: Tree) -> nn.Module | None:
    """The Linen module given to `bridge.from_linen`, if any."""
    src = tree._info.source
    return None if src is None else src.record[1].value  # pyright: ignore


def bind(tree: Tree) -> Any:
    """The Linen module bound to the Tree's variables; non-`params` collections are
    mutable, so a forward pass that updates batch statistics works, and
    `bound.variables` reads the updated values. Without a module: the variables."""
    variables = to_linen(tree)
    module = linen_module(tree)
    if module is None:
        return variables
    mutable = [c for c in variables if c != "params"]
    return module.bind(variables, mutable=mutable)
