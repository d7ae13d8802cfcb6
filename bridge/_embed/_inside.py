"""The wrapped model inside an outer model's Tree, for the walks that look at layers
(`bridge.port`, `bridge.port_plan`, `bridge.compare`).

A wrapper's arrays sit in the outer Tree at the wrapper's path (`as_nnx`,
`as_linen`) or under its `model` field (`as_equinox`), mirroring the wrapped model's
own Tree. `embedded` rebuilds that Tree from the outer one, so its layers are found
in the wrapped model's framework."""

from __future__ import annotations

from typing import Any

from .._paths import Path
from .._tree import Tree
from ._as_equinox import EquinoxWrapper
from ._as_nnx import NNXWrapper


def embedded(native: Any, node: Tree, path: Path) -> tuple[Path, Tree] | None:
    """`(prefix, wrapped Tree)` when `native` (the module at `path`, `node` its
    Tree) is a wrapper whose arrays are all in `node`: the wrapped model's leaf at
    path `p` is the outer Tree's leaf at `prefix + p`. None otherwise."""
    if isinstance(native, NNXWrapper):
        inner, prefix, base = native._bridge_inner, path, node
    elif isinstance(native, EquinoxWrapper) and isinstance(node, Tree):
        if "model" not in node:
            return None
        inner, prefix, base = native.inner, path + ("model",), node["model"]
    else:
        return None
    leaves = []
    for p in inner.paths:
        leaf = _at(base, p)
        if isinstance(leaf, Tree) and "init" in leaf:  # an undeleted StateIndex init
            leaf = leaf["init"]
        if leaf is None or isinstance(leaf, Tree):
            return None
        leaves.append(leaf)
    return prefix, inner.tree(leaves)


def _at(node: Any, path: Path) -> Any:
    for key in path:
        if not isinstance(node, Tree) or key not in node:
            return None
        node = node[key]
    return node
