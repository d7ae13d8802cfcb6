"""The adapters' kit for making Trees and reading them back: `build` (a whole-model
Tree from `(path, role, leaf, native position)` entries), `Maker` (the same, node by
node), `Recent` (a bounded cache of converted structures), `source_of` and
`native_leaves` (a Tree's adapter record and its leaves in native order, checked).
Only the adapters make Trees; the layers above read them with `bridge._tree`."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, TypeVar

import jax.tree_util as jtu

from .._kept._array import is_quantized
from .._paths import (
    MAX_DEPTH,
    Key,
    Path,
    canonical,
    check_depth,
    is_array,
    path_of,
    path_str,
)
from .._tree import Source, Tree, _Info
from ._registry import display_name


R = TypeVar("R", bound=Hashable)

_REGISTRY = getattr(jtu, "default_registry", None)


def _treedefs_from_children() -> Any:
    """`PyTreeDef.from_node_data_and_children`: a treedef made in one C call from
    its node's data and its children's treedefs (many alike children, one call), if
    this JAX has it and it rebuilds a probe's treedef; else None (then `Maker.root`
    reads the treedef from the Tree)."""
    make = getattr(jtu.PyTreeDef, "from_node_data_and_children", None)
    if make is None or _REGISTRY is None:
        return None
    probe = jtu.tree_structure({"a": (1, None), "b": [2]})
    try:
        made = make(_REGISTRY, probe.node_data(), probe.children())
    except Exception:  # another signature
        return None
    return make if made == probe else None


_FROM_DATA = _treedefs_from_children()
_LEAF_DEF = jtu.tree_structure(0)  # one leaf


def build(
    entries: Sequence[tuple[Path, str, Any, int]],
    kinds: dict[Path, Any],
    framework: str,
    record: Hashable,
    native: Mapping[Path, tuple[Key, ...]] | None = None,
) -> Tree:
    """Build a whole-model Tree from `(path, role, leaf, native_position)` entries.

    Nodes come in the order their first leaf comes in `entries`; `native` is the
    native child order of the nodes where it differs (`Source.native`). `kinds[path]`
    is the native class of the node at `path` (`()` is the root); a node whose keys are
    exactly `0..n-1` is a sequence. `native_position` is the leaf's index among the
    native leaves that `record` rebuilds the model from (see `native_leaves`).
    """
    root: dict[Key, Any] = {}
    # each parent node by path, found once: siblings share it (one look-up per leaf)
    parents: dict[Path, dict[Key, Any]] = {(): root}
    for entry in entries:
        path = entry[0]
        head = path[:-1]
        node = parents.get(head)
        if node is None:
            node = root
            for key in head:
                child = node.get(key)
                if child is None:
                    child = node[key] = {}
                elif type(child) is not dict:
                    raise ValueError(f"{path_str(path)} is both a leaf and a node.")
                node = child
            parents[head] = node
        if path[-1] in node:
            raise ValueError(f"{path_str(path)} appears twice.")
        node[path[-1]] = entry

    maker = Maker(kinds)
    paths, order = maker.paths, maker.order

    def make(node: dict[Key, Any], prefix: Path) -> tuple[tuple[Key, ...], list, list]:
        roles, children = [], []
        deep = len(prefix) >= MAX_DEPTH  # its leaves are too deep
        for key, value in node.items():
            if type(value) is dict:
                here = prefix + (key,)
                children.append(maker.node(here, *make(value, here)))
                roles.append(None)
            else:  # `Maker.leaf`, inline: once per leaf
                path, role, leaf, position = value
                if deep:
                    check_depth(path)
                paths.append(path)
                order.append(position)
                children.append(leaf)
                roles.append(role)
        return tuple(node), roles, children

    return maker.root(*make(root, ()), framework, record, native)


def native_order(paths: Sequence[Path]) -> dict[Path, tuple[Key, ...]]:
    """Each node's children in the order `paths` (the leaves' paths in native
    order) first reach them, for the nodes where that is not the canonical order:
    `build`'s `native` (`Source.native`) for a model whose native order is its
    leaves' (Haiku's dicts, Keras's variables)."""
    children: dict[Path, dict[Key, None]] = {}
    for path in paths:
        for depth in range(len(path)):
            children.setdefault(path[:depth], {})[path[depth]] = None
    native = {}
    for path, keys in children.items():
        order = tuple(keys)
        if order != canonical(order):
            native[path] = order
    return native


class ModuleNode(dict):
    """A native module found by path, for an adapter whose modules are not nested
    as attributes under the Tree's keys (Haiku's, named by strings; Keras's, by
    variable paths): a mapping of its submodules by Tree key (what `_paths.at`
    follows), whose attributes are the module's (`eps`, `epsilon`: what codecs'
    `hyperparameters` read). `module` is None where no module sits (an array's
    path, a key no module has)."""

    module: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def __missing__(self, key: Any) -> ModuleNode:
        return ModuleNode()


def module_nodes(modules: Sequence[tuple[Path, Any]], root: Any = None) -> ModuleNode:
    """The `ModuleNode` tree of `(Tree path, module)` pairs (the first module of a
    path kept), `root` at the root."""
    top = ModuleNode()
    top.module = root
    for path, module in sorted(modules, key=lambda item: len(item[0])):
        node = top
        for key in path:
            node = node.setdefault(key, ModuleNode())
        if node.module is None:
            node.module = module
    return top


class Maker:
    """Makes the nodes of one whole-model Tree, children before parents.

    `leaf` records a leaf's path and native position (call it in Tree order),
    `node` makes an inner node, `root` the Tree with its `Source`. Nodes with the same
    keys, roles and kind share one static record: cheap to make, hash and compare.
    """

    def __init__(self, kinds: dict[Path, Any]):
        self.kinds = kinds
        self.paths: list[Path] = []
        self.order: list[int] = []
        self.infos: dict[Any, _Info] = {}
        self.nodes = 0  # inner nodes made

    def leaf(self, path: Path, leaf: Any, position: int) -> Any:
        check_depth(path)
        self.paths.append(path)
        self.order.append(position)
        return leaf

    def _data(
        self, path: Path, keys: tuple[Key, ...], roles: list
    ) -> tuple[tuple[Key, ...] | None, tuple[str | None, ...], Any]:
        seq = bool(keys) and type(keys[0]) is int and keys == tuple(range(len(keys)))
        return (None if seq else keys, tuple(roles), self.kinds.get(path))

    def node(
        self, path: Path, keys: tuple[Key, ...], roles: list, children: list
    ) -> Tree:
        if len(path) > MAX_DEPTH:
            check_depth(path)
        self.nodes += 1
        data = self._data(path, keys, roles)
        info = self.infos.get(data)
        if info is None:
            info = self.infos[data] = _Info(data[0], data[1], data[2], None)
        return Tree._make(info, children)

    def root(
        self,
        keys: tuple[Key, ...],
        roles: list,
        children: list,
        framework: str,
        record: Hashable,
        native: Mapping[Path, tuple[Key, ...]] | None = None,
        defs: list | None = None,
    ) -> Tree:
        """The Tree, with its `Source`. `defs`: the children's treedefs, from a
        caller that made them knowing every leaf is a JAX leaf (then the Tree's
        treedef is made from them in one C call instead of read from the Tree)."""
        paths, order = tuple(self.paths), tuple(self.order)
        source = Source(framework, paths, order, record, native or {})
        keys_, roles_, kind_ = self._data((), keys, roles)
        info = _Info(keys_, roles_, kind_, source)
        tree = Tree._make(info, children)
        if defs is not None and _FROM_DATA is not None:
            object.__setattr__(
                source, "_treedef", _FROM_DATA(_REGISTRY, (Tree, info), defs)
            )
            return tree
        treedef = jtu.tree_structure(tree)
        # a leaf that is a pytree (a QuantizedArray) adds nodes or leaves: then the
        # Tree is flattened with `is_leaf`, which keeps it whole
        if treedef.num_leaves != len(
            paths
        ) or treedef.num_nodes != self.nodes + 1 + len(paths):
            treedef = jtu.tree_structure(tree, is_leaf=is_quantized)
            object.__setattr__(source, "_is_leaf", is_quantized)
        object.__setattr__(source, "_treedef", treedef)
        return tree


class Recent:
    """The last few structures an adapter converted: `key -> value`, at most `size`
    of them, the oldest dropped first. A second conversion of a same-structured model
    looks its Tree structure up here instead of walking the model in Python again.
    Safe to use from several threads at once (a lookup is one `dict.get`; changes
    hold a lock)."""

    def __init__(self, size: int = 32):
        self.size = size
        self.items: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any:
        return None if key is None else self.items.get(key)

    def put(self, key: Hashable, value: Any) -> None:
        if key is None:
            return
        with self._lock:
            while len(self.items) >= self.size and key not in self.items:
                del self.items[next(iter(self.items))]
            self.items[key] = value

    def clear(self) -> None:
        with self._lock:
            self.items.clear()


def source_of(
    tree: Any, framework: str | None = None, record: type[R] | None = None
) -> Source[R]:
    """The adapter record of a whole-model Tree, checked against `framework`
    (`record`: the adapter's record class, which the result's `record` is typed as)."""
    if not isinstance(tree, Tree):
        raise TypeError(
            f"`tree` must be a bridge.Tree, got {type(tree).__name__}. Make one with "
            "bridge.to_neutral(model)."
        )
    src = tree._info.source
    if src is None:
        raise TypeError(
            "This Tree is a part of a model (a subtree), not a whole model, so it "
            "cannot be turned back into a native model. Pass the whole Tree."
        )
    if framework is not None and src.framework != framework:
        raise TypeError(
            f"This Tree came from a {display_name(src.framework)} model, not a "
            f"{display_name(framework)} one: use bridge.to_native(tree), or "
            "bridge.port(tree, target) to move its weights into a "
            f"{display_name(framework)} model."
        )
    return src


_STRUCTURE_CHANGED = """\
This Tree no longer fits the {framework} model it came from:
{problems}
A Tree rebuilds its model only with the same leaves at the same paths. Change values
(or shapes) with eqx.tree_at, don't remove leaves (eqx.combine a partitioned Tree
first); to move weights into a model of another structure, use bridge.port."""


def native_leaves(
    tree: Tree, framework: str, record: type[R] | None = None
) -> tuple[Source[R], list[Any]]:
    """The Tree's leaves in the native order of the model it came from, checked.

    Raises `ValueError` naming every path that is missing, unexpected, or not an array.
    """
    src, flat = checked_leaves(tree, framework)
    leaves: list[Any] = [None] * len(flat)
    for leaf, pos in zip(flat, src.order):
        leaves[pos] = leaf
    return src, leaves


def checked_leaves(
    tree: Tree, framework: str, record: type[R] | None = None
) -> tuple[Source[R], list[Any]]:
    """The Tree's leaves in Tree order, checked to fit its source as
    `native_leaves` checks them (for an adapter that rebuilds from the Tree's
    nodes, not from the native leaf order)."""
    src = source_of(tree, framework)
    flat, treedef = jtu.tree_flatten(tree, is_leaf=src._is_leaf)
    # Fast path: the structure this Source was last rebuilt from (so the same paths),
    # and array leaves (checked per leaf type). Otherwise compare paths, and remember
    # the structure if it fits.
    if (
        src._treedef is None
        or treedef != src._treedef
        or not all(map(is_array, dict(zip(map(type, flat), flat)).values()))
    ):
        if src._is_leaf is None:  # a weight replaced by a quantized one since?
            whole, treedef_whole = jtu.tree_flatten(tree, is_leaf=is_quantized)
            if treedef_whole != treedef:
                flat, treedef = whole, treedef_whole
                object.__setattr__(src, "_is_leaf", is_quantized)
        _check_paths(tree, src, framework)
        object.__setattr__(src, "_treedef", treedef)
    return src, flat


def _check_paths(tree: Tree, src: Source[Any], framework: str) -> None:
    flat, _ = jtu.tree_flatten_with_path(tree, is_leaf=is_quantized)
    paths = tuple(path_of(p) for p, _ in flat)
    problems = []
    if paths != src.paths:
        have, want = set(paths), set(src.paths)
        problems += [f"  missing {path_str(p)}" for p in src.paths if p not in have]
        problems += [f"  unexpected {path_str(p)}" for p in paths if p not in want]
        if not problems:
            problems.append("  the leaves are in another order")
    for path, (_, leaf) in zip(paths, flat):
        if not is_array(leaf):
            problems.append(
                f"  {path_str(path)} is a {type(leaf).__name__}, not an array "
                "(a filter spec or a partitioned half cannot become a model)"
            )
    if problems:
        raise ValueError(
            _STRUCTURE_CHANGED.format(
                framework=display_name(framework), problems="\n".join(problems)
            )
        )
