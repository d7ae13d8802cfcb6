"""`from_linen`'s walk: Flax Linen variable collections read into a `bridge.Tree`
(one walk over plain dicts and FrozenDicts, `_walk`; the general path for any content
Linen makes, `_Walk`), the structures recently read (`_KNOWN`), and the record
`to_linen` rebuilds the variables from (`LinenRecord`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from itertools import chain, repeat
from operator import add, is_, itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple

import flax.linen as nn
import jax.tree_util as jtu
import numpy as np
from flax.core import FrozenDict

from .._kept._array import is_quantized
from .._paths import (
    MAX_DEPTH,
    Key,
    Path,
    canonical,
    canonical_and_sorted,
    check_depth,
    path_of,
    path_str,
)
from .._tree import (
    Held,
    NativeOrder,
    Tree,
    _Info,
    _new,
    _set_children,
    _set_info,
)
from ._build import (
    _FROM_DATA,
    _LEAF_DEF,
    _REGISTRY,
    Maker,
    Recent,
)


if TYPE_CHECKING:
    pass


_COLLISION = """\
Linen variables collide when organised by module:
{problems}
bridge.Tree merges the collections under each module path, so a name may be used by one
collection only. Rename the variable in one of the collections."""


def _general(variables: Mapping, module: Any, leaves: list, treedef: Any) -> Tree:
    """`from_linen`'s general path: `_Walk` over the collections, merged by module
    path, any content Linen makes (sequences, boxes of anything, collisions
    reported, leaves found by path when not by identity)."""
    walk = _Walk(variables, leaves, {(): type(module)} if module is not None else {})
    parts = []
    for name in sorted(variables, key=lambda c: c != "params"):
        collection = variables[name]
        if _node_kind(type(collection)) in (_MAPPING, _SEQUENCE):
            parts.append((str(name), collection))
        else:
            walk.problems.append(f"  collection {name!r} is an array, not a mapping")
    _note_order(variables, (), walk.orders)
    keys, roles, children = walk.merge(parts, ())
    if walk.problems:
        raise ValueError(_COLLISION.format(problems="\n".join(walk.problems)))
    if len(walk.maker.paths) != len(leaves) or -1 in walk.maker.order:
        raise TypeError(_UNSUPPORTED.format(found=len(walk.maker.paths), n=len(leaves)))
    # one collection of plain dicts: they are the Tree's nodes, in the same order
    plain = parts[0][0] if walk.plain and len(parts) == 1 else None
    orders = NativeOrder(walk.orders)
    record = LinenRecord(treedef, Held(module), orders, plain)
    return walk.maker.root(keys, roles, children, "linen", record, walk.native)


class LinenRecord(NamedTuple):
    """What `to_linen` rebuilds the variables from (a Tree's `Source.record`)."""

    treedef: Any  # of the variables, as given
    module: Held  # the nn.Module given to from_linen, or Held(None)
    # mappings not in sorted and natural key order, a dict `{path: keys}` (read,
    # never changed): no part of equality (the same variables after an optax step
    # have the same structure)
    orders: NativeOrder
    plain: str | None  # one collection of plain dicts: its name


def _known_key(variables: Mapping, treedef: Any, types: tuple, module: Any) -> Any:
    """What `from_linen`'s walk depends on besides the leaves: the variables' treedef,
    the key order of every mapping (a treedef ignores it), each leaf's type (`types`,
    of JAX's leaves) and the module's identity (a cached Source holds the module: its
    id is not reused). None (no cache) when the walk over the mappings cannot be
    shown to have read every one of them."""
    # each mapping, box or sequence the walk counts is one of JAX's inner nodes
    # (none of those classes is a leaf for JAX here)
    if any(_node_kind(cls) != _LEAF for cls in set(types)):
        return None
    inner = treedef.num_nodes - treedef.num_leaves
    orders: list[tuple] = []
    if _key_orders(variables, orders, alike=True) != inner:
        # some alike-looking layers hold more than leaves: every mapping, one by one
        orders = []
        if _key_orders(variables, orders, alike=False) != inner:
            return None
    key = (treedef, tuple(orders), types, id(module))
    try:
        hash(key)
    except TypeError:  # unhashable box metadata: no cache
        return None
    return key


# recently converted structures: key -> (the Tree's treedef, its leaf order)
_KNOWN = Recent()


def _key_orders(node: Any, out: list[tuple], alike: bool) -> int:
    """Append the keys of every mapping under `node`, depth first (last child
    first: one fixed order), in their order; return the number of JAX inner nodes
    (mappings, boxes, sequences, None) walked through. With `alike`, the values of a
    mapping of many mappings that look alike (`Dense_0` ... `Dense_49999`, the first
    holding leaves only) are taken to hold leaves only, in C-level passes: then
    the count falls short of JAX's if one does not."""
    kinds = _KINDS
    stack = [node]
    pop, push = stack.pop, stack.append
    inner = 0
    while stack:
        node = pop()
        kind = kinds.get(type(node))
        if kind is None:
            kind = _node_kind(type(node))
        if kind == _BOX:
            inner += 1
            node = node.unbox()
            kind = _node_kind(type(node))
        if kind == _MAPPING:
            inner += 1
            out.append(tuple(node))
            values = list(node.values())
            if alike and len(values) >= _ALIKE and _look_alike(values):
                # in the order the loop would append them (last first)
                out += map(tuple, reversed(values))
                inner += len(values)
                continue
            for value in values:  # once per value: a leaf appends nothing
                if kinds.get(type(value)) != _LEAF or value is None:
                    push(value)
        elif kind == _SEQUENCE:
            inner += 1
            stack += node
        elif node is None:
            inner += 1
    return inner


def _look_alike(values: list) -> bool:
    """Whether `values` are all dicts or FrozenDicts, the first of leaves only (not
    None)."""
    if not set(map(type, values)) <= _PLAIN_MAPPINGS:
        return False
    first = set(map(type, values[0].values()))
    return all(cls is not _NONE_TYPE and _KINDS.get(cls) == _LEAF for cls in first)


_PLAIN_MAPPINGS = {dict, FrozenDict}
_NONE_TYPE = type(None)


_UNSUPPORTED = """\
These Linen variables hold {n} JAX leaves, and {found} values were found in their
nested mappings (and nn.Partitioned-style boxes) that do not match them: some node is
a pytree of a kind Linen does not make. Pass the variables as `module.init` returns
them."""


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


class _Unwalkable(Exception):
    """Content `_walk` leaves to the general path (`_Walk`)."""


# what `_walk` does with a value of each class: a mapping it reads (`dict`,
# `FrozenDict`), a leaf, a box (`nn.Partitioned`, ...), None, or anything else
# (a sequence, another mapping class: the general path)
_DICT, _VALUE, _BOXED, _NONE, _OTHER = range(5)
_WALK_KINDS: dict[type, int] = {}


def _walk_kind(cls: type) -> int:
    kind = _WALK_KINDS.get(cls)
    if kind is None:
        if cls is dict or cls is FrozenDict:
            kind = _DICT
        elif cls is type(None):
            kind = _NONE
        else:
            kind = {_LEAF: _VALUE, _BOX: _BOXED}.get(_node_kind(cls), _OTHER)
        _WALK_KINDS[cls] = kind
    return kind


def _walk(
    variables: Mapping,
    module: Any,
    leaves: list,
    treedef: Any,
    types: tuple | None = None,
    checked: bool = False,
) -> Tree | None:
    """`from_linen` in one walk over the variables, making the Tree's nodes (and
    their treedefs) as it returns from them: the Tree `_general` makes, with fewer
    steps per node (a node of leaves, or of alike layers, in C-level passes). Each
    leaf's position among JAX's `leaves` is computed from the structure (JAX lists a
    mapping's children in sorted key order), then checked at the end, in C: JAX's
    leaf at that position is the very same object (an array used twice is read
    too). It reads dicts and FrozenDicts, leaves, None and boxes of a leaf; None
    when the variables hold anything else (sequences, other mappings, non-str
    collection names), a collision, a path near `MAX_DEPTH`, or leaves that are not,
    one for one, JAX's `leaves` (then `_general` decides).

    `types`: the classes of JAX's leaves, if known. Of alike layers only the first
    layer's values are read by class (the others are shown to be leaves by the check
    at the end, with `types`); a walk that fails the check is made again `checked`,
    reading every value."""
    if _walk_kind(type(variables)) != _DICT:
        return None
    parts = []
    for name in sorted(variables, key=lambda c: c != "params"):
        collection = variables[name]
        if type(name) is not str or _walk_kind(type(collection)) != _DICT:
            return None
        parts.append((name, collection))
    maker = Maker({(): type(module)} if module is not None else {})
    paths = maker.paths
    seen: list[Any] = []  # each Tree leaf, in Tree order
    orders: dict[Path, tuple] = {}
    _note_order(variables, (), orders)
    native: dict[Path, tuple[Key, ...]] = {}
    rough: list[Path] = []  # where the variables are not plain nested dicts
    shapes: dict[tuple, _Shape] = {}
    infos: dict[tuple, _Info] = {}
    made = [0]  # inner nodes
    trusted = [False]  # alike layers taken to hold leaves, from their first
    kinds = _WALK_KINDS
    deep = MAX_DEPTH - 1
    # the Tree's treedef is made node by node (alike layers share one), unless this
    # JAX cannot: then `Maker.root` reads it from the Tree
    from_data = _FROM_DATA

    def node(
        path: Path, keys: tuple[Key, ...], roles: tuple, children: list, defs: list
    ) -> tuple[Tree, Any]:
        data = (keys, roles)
        info = infos.get(data)
        if info is None:
            info = infos[data] = _Info(*maker._data(path, keys, list(roles)), None)
        made[0] += 1
        self = _new(Tree)  # `Tree._make`, inline: once per node
        _set_info(self, info)
        _set_children(self, tuple(children))
        if from_data is None:
            return self, None
        return self, from_data(_REGISTRY, (Tree, info), defs)

    def shape_of(listed: tuple[Key, ...]) -> _Shape:
        shape = shapes.get(listed)
        if shape is None:  # nodes repeat their keys: `(kernel, bias)`
            # TypeError: keys that do not sort
            ordered, jax_order, ranks = canonical_and_sorted(listed)
            in_order = list(listed) == jax_order and listed == ordered
            singles = tuple((key,) for key in ordered)
            shape = _Shape(ordered, in_order, singles, jax_order, ranks)
            shapes[listed] = shape
        return shape

    def listed_of(container: Any, role: str, path: Path) -> tuple[Key, ...]:
        """A mapping's keys, in its order; notes that order (`orders`) and whether
        the mapping is a plain dict (`rough`)."""
        if len(path) >= deep:
            raise _Unwalkable
        if type(container) is not dict:
            rough.append(path)
        listed = tuple(container)
        if not shape_of(listed).in_order:
            orders[(role, *path)] = listed
        return listed

    def alike(role: str, path: Path, shape: _Shape, values: list) -> tuple | None:
        """The nodes of `values` (at `path + (key,)` for each key of the parent's
        `shape`) when they are alike, dicts of leaves with the same keys in the
        same order (`Dense_0` ... `Dense_49999`): made in C-level passes, with what
        `one` notes for each (`orders`, `native`, `rough`). None when they are not
        alike."""
        keys = shape.ordered
        listed = tuple(values[0])
        if len(path) + 1 >= deep or not listed:
            return None
        if list(map(tuple, values)).count(listed) != len(values):
            return None
        layer = shape_of(listed)
        ordered, in_order = layer.ordered, layer.in_order
        get = itemgetter(*ordered)
        leaves = list(map(get, values) if len(ordered) > 1 else zip(map(get, values)))
        # leaves only: each layer's values read (`checked`), or the first layer's
        # and then each leaf is one of JAX's leaves, all of kinds read as values
        # (checked at the end; if not, the walk is made again, `checked`)
        flat = chain.from_iterable(leaves) if checked else leaves[0]
        if any(kinds.get(t) != _VALUE for t in set(map(type, flat))):
            return None
        trusted[0] = not checked
        if set(map(type, values)) != {dict}:
            rough.append(path)
        if not in_order:  # `(role, *path, key)` for each
            orders.update(zip(map((role, *path).__add__, zip(keys)), repeat(listed)))
        paths.extend(
            chain.from_iterable(
                zip(*[map(path.__add__, zip(keys, repeat(k))) for k in ordered])
            )
        )
        seen.extend(chain.from_iterable(leaves))
        if listed != ordered:
            native.update(zip(map(path.__add__, zip(keys)), repeat(listed)))
        roles = (role,) * len(ordered)
        info = infos.get((ordered, roles))
        if info is None:
            data = maker._data(path + (keys[0],), ordered, list(roles))
            info = infos[(ordered, roles)] = _Info(*data, None)
        nodes = list(map(_new, repeat(Tree, len(values))))  # `Tree._make`, in C
        deque(map(_set_info, nodes, repeat(info)), maxlen=0)
        deque(map(_set_children, nodes, leaves), maxlen=0)
        made[0] += len(nodes)
        defs: list[Any] = [None] * len(nodes)
        if from_data is not None:
            one_def = from_data(_REGISTRY, (Tree, info), [_LEAF_DEF] * len(ordered))
            defs = [one_def] * len(nodes)
        # JAX's position of each leaf: its layer's first (the layer's rank in
        # the parent's sorted keys, times the layer's leaves), plus its rank within
        # its layer
        width = len(ordered)
        starts = np.asarray(shape.ranks(), np.int64) * width
        within = np.asarray(layer.ranks(), np.int64)
        return nodes, defs, (starts[:, None] + within).ravel().tolist()

    def one(container: Any, role: str, path: Path) -> tuple:
        """`(keys, roles, children, their treedefs, the JAX positions of the
        leaves below among those of `container`)` of the node at `path`, in one
        collection."""
        listed = listed_of(container, role, path)
        shape = shapes[listed]
        ordered = shape.ordered
        values = list(map(container.__getitem__, ordered))
        found = list(map(kinds.get, map(type, values)))
        if found.count(_VALUE) == len(values):
            # leaves only (a Dense layer's kernel and bias): C-level passes
            paths.extend(map(path.__add__, shape.singles))
            seen.extend(values)
            if listed != ordered:
                native[path] = listed
            defs = [_LEAF_DEF] * len(values)
            return ordered, (role,) * len(values), values, defs, shape.ranks()
        if len(values) >= _ALIKE and found.count(_DICT) == len(values):
            layers = alike(role, path, shape, values)
            if layers is not None:
                if listed != ordered:
                    native[path] = listed
                return ordered, (None,) * len(values), *layers
        keys: list[Key] = []
        roles: list[str | None] = []
        children: list[Any] = []
        defs = []
        below: list[Any] = []  # per child, its leaves' positions among its own
        counts: dict[Key, int] = {}  # per key, its JAX leaves (if not one)
        for key, child in zip(ordered, values):  # once per value of the variables
            kind = kinds.get(type(child))
            if kind is None:
                kind = _walk_kind(type(child))
            if kind == _DICT:
                here = path + (key,)
                sub = one(child, role, here)
                counts[key] = len(sub[4])
                if sub[0]:
                    made_node, made_def = node(here, *sub[:4])
                    children.append(made_node)
                    defs.append(made_def)
                    below.append(sub[4])
                    keys.append(key)
                    roles.append(None)
                else:  # an empty mapping is no module
                    rough.append(here)
                continue
            if kind == _BOXED:
                rough.append(path)
                child = child.unbox()
                kind = _walk_kind(type(child))
            if kind == _VALUE:
                paths.append(path + (key,))
                seen.append(child)
                children.append(child)
                defs.append(_LEAF_DEF)
                below.append(_FIRST)
                keys.append(key)
                roles.append(role)
            elif kind == _NONE:
                rough.append(path)
                counts[key] = 0
            else:
                raise _Unwalkable
        if listed != ordered:
            native[path] = _present(listed, keys)
        start = _starts(shape.jax_order, counts)
        positions: list[int] = []
        for key, inner in zip(keys, below):
            first = start[key]
            positions += map(add, inner, repeat(first)) if first else inner
        return tuple(keys), tuple(roles), children, defs, positions

    def merge(parts: list[tuple[str, Any]], path: Path) -> tuple:
        """`(keys, roles, children, their treedefs, positions, their collections)`
        of the node at `path`, in several collections: each leaf's JAX position
        among those of its collection's mapping at `path`."""
        merged: dict[Key, list[tuple[str, Any]]] = {}
        for part, container in parts:
            listed_of(container, part, path)
            for key, child in container.items():
                merged.setdefault(key, []).append((part, child))
        listed = tuple(merged)
        ordered = canonical(listed)
        keys: list[Key] = []
        roles: list[str | None] = []
        children: list[Any] = []
        defs: list[Any] = []
        below: list[tuple[Any, Any]] = []  # per child: (positions, collection(s))
        counts: dict[str, dict[Key, int]] = {part: {} for part, _ in parts}
        for key in ordered:
            here = path + (key,)
            inner, found = [], []
            for role, child in merged[key]:
                kind = _walk_kind(type(child))
                if kind == _BOXED:
                    rough.append(here)
                    child = child.unbox()
                    kind = _walk_kind(type(child))
                if kind == _DICT:
                    inner.append((role, child))
                elif kind == _VALUE:
                    found.append((role, child))
                elif kind == _NONE:
                    rough.append(here)
                    counts[role][key] = 0
                else:
                    raise _Unwalkable
            if found:
                if inner or len(found) > 1:  # a collision: reported by `_general`
                    raise _Unwalkable
                role, leaf = found[0]
                paths.append(here)
                seen.append(leaf)
                children.append(leaf)
                defs.append(_LEAF_DEF)
                below.append((_FIRST, role))
                keys.append(key)
                roles.append(role)
            elif inner:
                if len(inner) == 1:
                    role = inner[0][0]
                    sub = one(inner[0][1], role, here)
                    counts[role][key] = len(sub[4])
                    whose: Any = role
                else:
                    sub = merge(inner, here)
                    whose = sub[5]
                    for role, _ in inner:
                        counts[role][key] = whose.count(role)
                if sub[0]:
                    made_node, made_def = node(here, *sub[:4])
                    children.append(made_node)
                    defs.append(made_def)
                    below.append((sub[4], whose))
                    keys.append(key)
                    roles.append(None)
                else:
                    rough.append(here)
        if listed != ordered:
            native[path] = _present(listed, keys)
        starts = {
            part: _starts(shapes[tuple(container)].jax_order, counts[part])
            for part, container in parts
        }
        positions: list[int] = []
        collections: list[str] = []
        for key, (inner, whose) in zip(keys, below):
            if type(whose) is str:
                first = starts[whose][key]
                positions += map(add, inner, repeat(first)) if first else inner
                collections += repeat(whose, len(inner))
            else:
                positions += [p + starts[c][key] for p, c in zip(inner, whose)]
                collections += whose
        return tuple(keys), tuple(roles), children, defs, positions, collections

    try:
        if len(parts) == 1:
            top = one(parts[0][1], parts[0][0], ())
            order = top[4]
        else:
            top = merge(parts, ())
            # JAX lists the collections in sorted order: each one's first position
            first, total = {}, 0
            for name in sorted(variables):
                first[name] = total
                total += top[5].count(name)
            order = [p + first[c] for p, c in zip(top[4], top[5])]
    except (_Unwalkable, TypeError):  # TypeError: keys that natural order cannot sort
        return None
    # each Tree leaf is JAX's leaf at its position: the very same object
    n = len(leaves)
    if (
        len(seen) != n
        or len(order) != n
        or not all(map(is_, seen, map(leaves.__getitem__, order)))
        or (trusted[0] and not _all_values(types or tuple(map(type, leaves))))
    ):
        if trusted[0]:  # some alike layer holds more than leaves: read each value
            return _walk(variables, module, leaves, treedef, types, checked=True)
        return None
    maker.order = order
    maker.nodes = made[0]
    one_dict = not rough and type(variables) is dict and len(parts) == 1
    plain = parts[0][0] if one_dict else None
    orders_ = NativeOrder(orders)
    record = LinenRecord(treedef, Held(module), orders_, plain)
    defs = None if from_data is None else top[3]
    return maker.root(top[0], list(top[1]), top[2], "linen", record, native, defs)


def _all_values(types: tuple) -> bool:
    """Whether the types of JAX's leaves are all classes `_walk` reads as values."""
    return all(_WALK_KINDS.get(cls) == _VALUE for cls in set(types))


# from this many children on, `_walk` tries to make a node's children in C-level
# passes (`alike`)
_ALIKE = 8


def _present(listed: tuple[Key, ...], keys: list[Key]) -> tuple[Key, ...]:
    """A node's native key order (`listed`), of the keys the Tree has (`keys`)."""
    if len(keys) == len(listed):
        return listed
    present = set(keys)
    return tuple(k for k in listed if k in present)


class _Shape:
    """What `_walk` reads off a mapping's keys (nodes repeat them: `(kernel,
    bias)`): the keys in canonical order (`ordered`, the Tree's) and in sorted order
    (`jax_order`, JAX's), whether they are listed in both, `(key,)` for each of
    `ordered`."""

    __slots__ = ("ordered", "in_order", "singles", "jax_order", "_ranks")

    def __init__(self, ordered, in_order, singles, jax_order, ranks):
        self.ordered: tuple[Key, ...] = ordered
        self.in_order: bool = in_order
        self.singles: tuple[Path, ...] = singles
        self.jax_order: list[Key] = jax_order
        self._ranks: list[int] | None = ranks

    def ranks(self) -> list[int]:
        """Each key of `ordered`'s position in `jax_order` (do not modify)."""
        if self._ranks is None:
            if list(self.ordered) == self.jax_order:
                self._ranks = list(range(len(self.ordered)))
            else:
                rank = dict(zip(self.jax_order, range(len(self.jax_order))))
                self._ranks = list(map(rank.__getitem__, self.ordered))
        return self._ranks


def _starts(jax_order: list[Key], counts: dict[Key, int]) -> dict[Key, int]:
    """The position of each key's first leaf among a mapping's JAX leaves: JAX lists
    the children in sorted key order (`jax_order`); `counts` holds the number of
    leaves under each key that is not one leaf."""
    start: dict[Key, int] = {}
    total = 0
    get = counts.get
    for key in jax_order:
        start[key] = total
        total += get(key, 1)
    return start


_FIRST = (0,)  # the positions below a leaf: itself


class _Walk:
    """One pass over the collections, merged by module path, making the Tree.

    Modules come in canonical order (natural key order: `Dense_2` before
    `Dense_10`, whatever order the dicts list them in: Linen's creation order, or
    sorted after an optax step); within a module, `params` before the other
    collections. `orders` gets the key order of every mapping not in sorted and
    natural order, by `(collection, *path)`; `native` the merged key order of every
    Tree node whose dicts list it in another order than the Tree's.
    """

    def __init__(self, variables: Mapping, leaves: list[Any], kinds: dict):
        self.variables = variables
        self.maker = Maker(kinds)
        self.orders: dict[Path, tuple] = {}
        self.native: dict[Path, tuple[Key, ...]] = {}
        self.problems: list[str] = []
        # per key tuple: whether sorted and canonical, the canonical order
        self.in_order: dict[tuple, bool] = {}
        self.canonical: dict[tuple, tuple[Key, ...]] = {}
        by_id = dict(zip(map(id, leaves), range(len(leaves))))
        self.by_id = by_id if len(by_id) == len(leaves) else {}
        self.by_path: dict[Path, int] | None = None
        # plain nested dicts of arrays (no box, FrozenDict, list or None): then the
        # Tree's nodes (reordered to the recorded order) are the dicts `to_linen` gives
        self.plain = type(variables) is dict

    def position(self, role: str, path: Path, leaf: Any) -> int:
        """The leaf's index among JAX's leaves of the variables: where JAX put
        this very object, or (an object used twice) where JAX put this path."""
        i = self.by_id.get(id(leaf))
        if i is not None:
            return i
        if self.by_path is None:
            flat, _ = jtu.tree_flatten_with_path(self.variables, is_leaf=is_quantized)
            # a box (nn.Partitioned, ...) adds an attribute key (`.value`): drop it
            self.by_path = {
                path_of([e for e in keypath if type(e) is not jtu.GetAttrKey]): i
                for i, (keypath, _) in enumerate(flat)
            }
        # -1: not a JAX leaf (a pytree node of another kind): reported by from_linen
        return self.by_path.get((role, *path), -1)

    def children(self, role: str, container: Any, path: Path) -> Mapping[Key, Any]:
        """A container's children by key (a sequence's by index); notes its order."""
        if type(container) is not dict:
            self.plain = False
        if _node_kind(type(container)) == _MAPPING:
            keys = tuple(container)
            in_order = self.in_order.get(keys)
            if in_order is None:
                in_order = self.in_order[keys] = _in_order(keys)
            if not in_order:
                self.orders[(role, *path)] = keys
            return container
        return dict(enumerate(container))

    def merge(
        self, parts: list[tuple[str, Any]], path: Path
    ) -> tuple[tuple[Key, ...], list, list]:
        """`(keys, roles, children)` of the node at `path`, from its containers
        in each collection, `parts = [(collection, mapping), ...]`."""
        merged: dict[Key, list[tuple[str, Any]]] = {}
        if len(parts) == 1:
            role, container = parts[0]
            one = self.children(role, container, path)
            listed = tuple(one)
            ordered = self.canonical.get(listed)
            if ordered is None:  # nodes repeat their keys: `(kernel, bias)`
                ordered = self.canonical[listed] = canonical(listed)
        else:
            one, role = None, ""
            for part, container in parts:
                for key, child in self.children(part, container, path).items():
                    merged.setdefault(key, []).append((part, child))
            listed = tuple(merged)
            ordered = canonical(listed)
        keys: list[Key] = []
        roles: list[str | None] = []
        children: list[Any] = []
        # per leaf only what a leaf needs (this loop runs once per array of the
        # model): its path, its position among JAX's leaves, its role
        kinds, by_id, maker = _KINDS, self.by_id, self.maker
        paths, order = maker.paths, maker.order
        deep = len(path) >= MAX_DEPTH
        for key in ordered:
            here = path + (key,)
            if one is not None:
                child = one[key]
                kind = kinds.get(type(child))
                if kind == _LEAF and child is not None:
                    position = by_id.get(id(child))
                    if position is None:
                        position = self.position(role, here, child)
                    if deep:
                        check_depth(here)
                    paths.append(here)
                    order.append(position)
                    children.append(child)
                    keys.append(key)
                    roles.append(role)
                    continue
                if kind == _MAPPING or kind == _SEQUENCE:  # `group`, inline
                    sub_keys, sub_roles, sub_children = self.merge(
                        [(role, child)], here
                    )
                    if sub_keys:
                        children.append(
                            maker.node(here, sub_keys, sub_roles, sub_children)
                        )
                        keys.append(key)
                        roles.append(None)
                    else:
                        self.plain = False
                    continue
                group = [(role, child)]
            else:
                group = merged[key]
            self.group(here, group, keys, roles, children)
        if listed is not ordered and listed != ordered:
            if len(keys) == len(listed):
                self.native[path] = listed
            else:
                present = set(keys)
                self.native[path] = tuple(k for k in listed if k in present)
        return tuple(keys), roles, children

    def group(
        self,
        here: Path,
        group: list[tuple[str, Any]],
        keys: list[Key],
        roles: list[str | None],
        children: list[Any],
    ) -> None:
        """Add the child at `here` from its values in each collection, `group =
        [(collection, value), ...]`: a leaf, a merged node, or a collision."""
        inner, found = [], []
        for role, child in group:
            kind = _node_kind(type(child))
            if kind == _BOX:
                self.plain = False
                child = child.unbox()
                kind = _node_kind(type(child))
            if kind == _MAPPING or kind == _SEQUENCE:
                inner.append((role, child))
            elif child is not None:  # None: an empty subtree for JAX
                found.append((role, child))
            else:
                self.plain = False
        key = here[-1]
        if found and (inner or len(found) > 1):
            self.collision(here, found, inner)
        elif found:
            role, leaf = found[0]
            position = self.position(role, here, leaf)
            children.append(self.maker.leaf(here, leaf, position))
            keys.append(key)
            roles.append(role)
        elif inner:
            sub_keys, sub_roles, sub_children = self.merge(inner, here)
            if sub_keys:  # an empty mapping is no module
                node = self.maker.node(here, sub_keys, sub_roles, sub_children)
                children.append(node)
                keys.append(key)
                roles.append(None)
            else:  # but it stays in the variables: to_linen rebuilds them whole
                self.plain = False

    def collision(self, path: Path, found: list, inner: list) -> None:
        where = path_str(path)
        for (first, _), (role, _) in zip(found, found[1:]):
            self.problems.append(f"  {where} is in collections {first!r} and {role!r}")
        for role, _ in inner:
            self.problems.append(
                f"  {where} is a variable in collection {found[0][0]!r} and a module "
                f"in collection {role!r}"
            )


def _note_order(node: Mapping, path: Path, orders: dict[Path, tuple]) -> None:
    keys = tuple(node)
    if not _in_order(keys):
        orders[path] = keys


def _in_order(keys: tuple) -> bool:
    """Whether `keys` are in sorted and in canonical order (JAX rebuilds a dict in
    sorted order; a Tree lists it in canonical order)."""
    try:
        return list(keys) == sorted(keys) and keys == canonical(keys)
    except TypeError:  # keys of mixed types
        return False
