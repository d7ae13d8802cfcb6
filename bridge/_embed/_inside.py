"""The wrapped models inside an outer model's Tree, for the walks that look at layers
(`bridge.port`, `bridge.port_plan`, `bridge.compare`).

A wrapper's arrays sit in the outer Tree at the wrapper's path (`as_nnx`,
`as_linen`) or under its `model` field (`as_equinox`), mirroring the wrapped model's
own Tree. `embedded` rebuilds that Tree from the outer one, so its layers are found
in the wrapped model's framework. Wrappers are found in the outer model's native
modules (NNX, Equinox: every module is there) or, in a Linen model, among the
submodules its module declares as fields or in `setup` (`_as_linen.linen_wrappers`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .._paths import Path, at
from .._tree import Tree, walk
from ._as_linen import linen_wrappers
from ._inner import Inner


def embedded(tree: Tree, native: Any) -> dict[Path, tuple[Path, Tree]]:
    """`{wrapper path: (prefix, wrapped Tree)}` for every wrapper of `tree` whose
    arrays are all in `tree`: the wrapped model's leaf at path `p` is the outer
    Tree's leaf at `prefix + p`. `native` is the outer model's modules (the adapter's
    `modules`), or None."""
    found = {}
    for path, wrapper in _wrappers(tree, native):
        node = _at(tree, path)
        if not isinstance(node, Tree):
            continue
        inner, field = wrapper._bridge_wrapped()
        inside = _rebuilt(inner, _at(node, field))
        if inside is not None:
            found[path] = path + field, inside
    return found


def is_wrapper(module: Any) -> bool:
    """Whether `module` is a wrapper made by `bridge.as_nnx`, `as_linen` or
    `as_equinox`: each tells what it wraps and where (`_bridge_wrapped`)."""
    return callable(getattr(type(module), "_bridge_wrapped", None))


def _wrappers(tree: Tree, native: Any) -> Iterator[tuple[Path, Any]]:
    if native is not None:
        for path, node in walk(tree):
            module = _module_at(native, path)
            if is_wrapper(module):
                _, field = module._bridge_wrapped()
                if _at(node, field) is not None:
                    yield path, module
    yield from linen_wrappers(tree)


def _module_at(native: Any, path: Path) -> Any:
    try:
        return at(native, path)
    except (AttributeError, KeyError, IndexError, TypeError):
        return None


def _rebuilt(inner: Inner, base: Tree) -> Tree | None:
    leaves = []
    for p in inner.paths:
        leaf = _at(base, p)
        if isinstance(leaf, Tree) and "init" in leaf:  # an undeleted StateIndex init
            leaf = leaf["init"]
        if leaf is None or isinstance(leaf, Tree):
            return None
        leaves.append(leaf)
    return inner.tree(leaves)


def _at(node: Any, path: Path) -> Any:
    for key in path:
        if not isinstance(node, Tree) or key not in node:
            return None
        node = node[key]
    return node
