"""Adapter: Flax Linen variable collections <-> `bridge.Tree`."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from itertools import chain, repeat
from operator import add, attrgetter, is_, itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple

import flax.linen as nn
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from flax.core import FrozenDict
from flax.errors import InvalidRngError
from flax.training import train_state

from .._arguments import is_array, type_error
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
from .._qarray import is_quantized
from .._tree import (
    Held,
    NativeOrder,
    Tree,
    _Info,
    _keys,
    _new,
    _set_children,
    _set_info,
    items,
    leaf_roles,
)
from ._build import (
    _FROM_DATA,
    _LEAF_DEF,
    _REGISTRY,
    Maker,
    Recent,
    build,
    checked_leaves,
    native_leaves,
    source_of,
)
from ._registry import Adapter, Optimizer, register_adapter


if TYPE_CHECKING:
    from .._embed._keys import Keys


_COLLISION = """\
Linen variables collide when organised by module:
{problems}
bridge.Tree merges the collections under each module path, so a name may be used by one
collection only. Rename the variable in one of the collections."""


def from_linen(variables: Mapping[str, Any], module: nn.Module | None = None) -> Tree:
    """Convert Flax Linen variables to a `bridge.Tree`, without copying any array.

    The collections (`params`, `batch_stats`, `cache`, ...) are merged by module, so
    a CNN's Tree reads `t.Conv_0.kernel`, `t.BatchNorm_0.scale`, `t.BatchNorm_0.mean`;
    each leaf's role is its collection. Modules come in natural key order (`Dense_2`
    before `Dense_10`), so the variables have the same Tree structure before and after
    an optax step (which sorts the dicts); the dicts' own order is recorded for
    `bridge.to_linen`. Boxed parameters (`nn.Partitioned`,
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
            "bridge.from_linen expects `variables`, the dict `module.init` returns "
            f"(collection -> nested mapping of arrays), got {type(variables).__name__}."
            " For an NNX module use bridge.from_nnx, for Equinox bridge.from_equinox."
        )
    if module is not None and not isinstance(module, nn.Module):
        raise TypeError(
            f"`module` must be a flax.linen Module, got {type(module).__name__}."
        )
    if module is not None and module.scope is not None:
        module = module.clone(parent=None)  # a bound module: keep its definition
    # JAX's leaves (a weight kept quantized, a pytree, is one leaf of the Tree: then
    # the variables are flattened again below, with an `is_leaf` call per node)
    leaves, treedef = jtu.tree_flatten(variables)
    # the same structure as a recent call (JAX's treedef ignores dict order, so the key
    # orders and leaf types are part of the key): rebuild the Tree from its treedef
    types = tuple(map(type, leaves))
    known = _known_key(variables, treedef, types, module)
    hit = _KNOWN.get(known)
    if hit is not None:
        tree_def, order = hit
        return jtu.tree_unflatten(tree_def, [leaves[i] for i in order])
    tree = _walk(variables, module, leaves, treedef, types)
    if tree is None:  # content the one walk leaves to the general path
        whole, whole_def = jtu.tree_flatten(variables, is_leaf=is_quantized)
        if whole_def != treedef:  # the Tree's leaves are not JAX's: not cached
            known = None
        tree = _general(variables, module, whole, whole_def)
    src = tree._info.source
    assert src is not None
    _KNOWN.put(known, (src._treedef, src.order))
    return tree


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
        if len(parts) == 1:
            role, container = parts[0]
            one = self.children(role, container, path)
            listed = tuple(one)
            ordered = self.canonical.get(listed)
            if ordered is None:  # nodes repeat their keys: `(kernel, bias)`
                ordered = self.canonical[listed] = canonical(listed)
        else:
            one, role = None, ""
            merged: dict[Key, list[tuple[str, Any]]] = {}
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
                group = merged[key]  # pyright: ignore[reportPossiblyUnboundVariable]
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


def to_linen(tree: Tree) -> dict[str, Any]:
    """Rebuild the Linen variables of a `bridge.Tree` made by `bridge.from_linen`.

    **Arguments:**

    - `tree`: a `bridge.Tree` from `bridge.from_linen`, with the same leaf paths.

    **Returns:**

    The variables, in the container types given to `from_linen` (`dict` stays
    `dict`, `FrozenDict` stays `FrozenDict`), boxes and their metadata restored.
    """
    record = source_of(tree, "linen", LinenRecord).record
    orders = record.orders.value
    if record.plain is not None:  # the Tree's dicts, in their recorded order
        checked_leaves(tree, "linen")
        return {record.plain: _dicts(tree, (record.plain,), orders)}
    _, leaves = native_leaves(tree, "linen", LinenRecord)
    variables = jtu.tree_unflatten(record.treedef, leaves)
    if orders:  # JAX rebuilds dicts in sorted key order: restore the order
        variables = _reorder(variables, (), orders)
    return variables


def _dicts(node: Tree, path: Path, orders: dict[Path, tuple]) -> dict[Key, Any]:
    """The nested dicts of a Tree, each in its order in `orders` (keyed by
    `(collection, *path)`) if there, else in the Tree's."""
    layers = _alike_dicts(node, path, orders)
    out: dict[Key, Any]
    if layers is not None:
        out = dict(zip(_keys(node), layers))
    else:
        out = {
            k: _dicts(c, path + (k,), orders) if type(c) is Tree else c
            for k, c in items(node)
        }
    keys = orders.get(path)
    return out if keys is None else {k: out[k] for k in keys}


def _alike_dicts(node: Tree, path: Path, orders: dict[Path, tuple]) -> list | None:
    """The dicts of a node's children when they are alike layers (`Dense_0` ...
    `Dense_49999`: Trees of one static record, of leaves only, all in the Tree's
    order or all in one recorded order), made in C-level passes; else None."""
    children = node._children
    keys = node._info.keys
    if len(children) < _ALIKE or keys is None:
        return None
    if set(map(type, children)) != {Tree}:
        return None
    infos = set(map(_INFO, children))
    if len(infos) != 1:
        return None
    (info,) = infos
    names = info.keys
    if names is None or len(names) < 2 or None in info.roles:
        return None
    wanted = set(map(orders.get, map(path.__add__, zip(keys))))
    if len(wanted) != 1:
        return None
    (listed,) = wanted
    rows = map(_CHILDREN, children)
    if listed is None:
        listed = names
    elif len(listed) != len(names) or set(listed) != set(names):
        return None
    else:  # each layer's children in the recorded order
        rows = map(itemgetter(*map(names.index, listed)), rows)
    return list(map(dict, map(zip, repeat(listed), rows)))


_INFO = attrgetter("_info")
_CHILDREN = attrgetter("_children")


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
    return None if src is None else src.record.module.value


_RNGS_WITHOUT_MODULE = """\
`rngs` was given, but this Linen Tree was made without its module, so there is no
module to bind them to. Make the Tree with bridge.from_linen(variables, module), or
call module.apply(variables, ..., rngs=...) yourself on bridge.to_linen(tree)."""


def bind(tree: Tree, rngs: Any = None) -> Any:
    """The Linen module bound to the Tree's variables; non-`params` collections are
    mutable, so a forward pass that updates batch statistics works, and
    `bound.variables` reads the updated values. `rngs` as for `module.apply`: a
    dict `{stream: key}`, or one key for the `"params"` stream (which Linen's
    `make_rng` falls back to). Without a module: the variables."""
    variables = to_linen(tree)
    module = linen_module(tree)
    if module is None:
        if rngs is not None:
            raise ValueError(_RNGS_WITHOUT_MODULE)
        return variables
    if rngs is not None:
        rngs = dict(rngs) if isinstance(rngs, Mapping) else {"params": rngs}
        for key in rngs.values():
            if not is_array(key):
                raise type_error("rngs", "a dict {stream: JAX key} or one JAX key", key)
    mutable = [c for c in variables if c != "params"]
    return module.bind(variables, rngs=rngs, mutable=mutable)


# --- the adapter record -------------------------------------------------------------


_UNBOUND = """\
An unbound Linen module holds no weights (a Linen module without variables).
Initialise it first and pass both:
    variables = module.init(jax.random.key(0), example_input)
    (module, variables)    # or module.bind(variables)"""

_NEEDS_RNGS = """\
{error}
This Linen model draws random numbers (`make_rng`, as `nn.Dropout` does when not
deterministic) from a stream the step was not given. Give the step its streams, as to
`module.apply`: `step(tree, opt_state, *batch, rngs={{"dropout": key}})`, with a new
key each step (e.g. `jax.random.fold_in(key, i)`); a new key does not retrace."""

_NO_MODULE = """\
Linen variables alone cannot be called: pass `(module, variables)`, a bound module, or a
Tree made with `bridge.from_linen(variables, module)`."""


def _is_pair(obj: Any) -> bool:
    return (
        isinstance(obj, tuple)
        and len(obj) == 2
        and isinstance(obj[0], nn.Module)
        and isinstance(obj[1], Mapping)
    )


def _recognise(obj: Any) -> bool:
    return isinstance(obj, (nn.Module, Mapping)) or _is_pair(obj)


def _to_tree(obj: Any) -> Tree:
    if isinstance(obj, nn.Module):
        if obj.scope is None:
            raise TypeError(_UNBOUND)
        return from_linen(obj.variables, obj)
    if isinstance(obj, tuple):
        return from_linen(obj[1], obj[0])
    return from_linen(obj)


def _like(target: Any, tree: Tree) -> Any:
    if isinstance(target, nn.Module):
        return bind(tree)
    if isinstance(target, tuple):
        return target[0], to_linen(tree)
    return to_linen(tree)


def _empty(tree: Tree) -> list[tuple[str, Path]]:
    """The variables' empty mappings (`{"params": {"a": {}}}` -> `("params",
    ("a",))`), read from the structure `to_linen` rebuilds."""
    record = source_of(tree, "linen", LinenRecord).record
    treedef = record.treedef
    variables = jtu.tree_unflatten(treedef, [None] * treedef.num_leaves)
    out: list[tuple[str, Path]] = []
    stack = [(str(role), (), node) for role, node in reversed(variables.items())]
    while stack:  # depth first, in the variables' order
        role, path, node = stack.pop()
        if _node_kind(type(node)) == _MAPPING:
            if not node:
                out.append((role, path))
            stack += [(role, path + (k,), v) for k, v in reversed(node.items())]
    return out


def _forward(
    tree: Tree, loss_fn: Callable[..., Any], batch: tuple, rngs: Any
) -> tuple[Any, Tree | None]:
    native = bind(tree, rngs)
    if not isinstance(native, nn.Module):  # variables without a module
        return loss_fn(native, *batch), None
    try:
        out = loss_fn(native, *batch)
    except InvalidRngError as error:
        raise ValueError(_NEEDS_RNGS.format(error=error)) from error
    return out, from_linen(native.variables, linen_module(tree))


def _embed(
    tree: Tree, args: tuple, kwargs: dict[str, Any], keys: Keys, inference: Any
) -> tuple[Any, Tree, tuple[str, ...]]:
    """A call inside a wrapper: bound with every stream of `keys` (as
    `module.apply(rngs=...)`), every collection but `params` mutable. A Linen module
    takes its mode as a call argument: `inference` is not used."""
    native = bind(tree, keys.every())
    out = native(*args, **kwargs)
    return out, from_linen(native.variables, linen_module(tree)), ()


def _infer(model: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if isinstance(model, nn.Module):
        return model(*inputs, **kwargs)
    if isinstance(model, tuple):
        return model[0].apply(model[1], *inputs, **kwargs)
    raise TypeError(_NO_MODULE)


def _called(run: Callable[[], Any]) -> tuple[Any, dict[tuple, type]]:
    """`run()` (a forward pass), with the class of every submodule it calls by its
    path (`("conv",)`): Linen records the classes of compact submodules nowhere
    else."""
    seen: dict[tuple, type] = {}

    def record(method: Callable, args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if module.scope is not None:
            seen.setdefault(tuple(module.scope.path), type(module))
        return method(*args, **kwargs)

    with nn.intercept_methods(record):
        out = run()
    return out, seen


def _from_file(
    tensors: list[tuple[str, Path, str, Any]],
    modules: dict[Path, tuple[str, dict[str, Any]]],
    kinds: dict[Path, Any],
    empty: list[tuple[str, Path]],
) -> Tree:
    """The Tree of a Flax file (Linen, NNX, or of no known framework) as Linen-style
    variables, `{role: {module: {name: array}}}`, with the recorded classes."""
    variables: dict[str, Any] = {}
    for _, path, role, array in tensors:
        node = variables.setdefault(role, {})
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = array
    for role, path in empty:  # checked: none holds or is inside an array
        node = variables.setdefault(role, {})
        for key in path:
            node = node.setdefault(key, {})
    plain = from_linen(variables)
    # the same Tree, with the recorded classes (NNX's): they tell bridge.port each
    # layer's kind
    src = source_of(plain)
    entries = [
        (path, str(role), leaf, position)
        for path, position, role, leaf in zip(
            src.paths, src.order, leaf_roles(plain), jtu.tree_leaves(plain)
        )
    ]
    return build(entries, kinds, "linen", src.record, src.native)


def _unwrap_train_state(obj: Any) -> tuple[Any, Any] | None:
    if isinstance(obj, train_state.TrainState):
        return obj.opt_state, obj.step
    return None


def _wrap_train_state(like: Any, state: Any, step: Any) -> Any:
    dtype = jnp.result_type(like.step)
    return like.replace(opt_state=state, step=jnp.array(step, dtype))


def _train_state_model(obj: Any) -> Tree | None:
    """The Tree of a TrainState's parameters (with its module when `apply_fn` is a
    Linen module's bound method)."""
    if not isinstance(obj, train_state.TrainState):
        return None
    module = getattr(obj.apply_fn, "__self__", None)
    variables = {"params": obj.params}
    return from_linen(variables, module if isinstance(module, nn.Module) else None)


def _optimizer_params(tree: Tree) -> Any:
    return to_linen(tree).get("params", {})


def _declared(
    tree: Tree, wanted: Callable[[Any], bool]
) -> list[tuple[Path, Any]] | None:
    """The submodules of a Linen model's Tree that `wanted` accepts (not looking
    inside them), with their paths: those its module (given to `bridge.from_linen`,
    or as `(module, variables)`) declares as fields or in `setup`, at any depth. A
    submodule made inside a compact `__call__` exists only while the model runs: it
    is not found. None without the module (Linen variables record no module
    classes); empty when the module itself is wanted."""
    module = source_of(tree, "linen", LinenRecord).record.module.value
    if module is None:
        return None
    if wanted(module):
        return []
    try:  # best effort: a module whose setup fails outside apply has none found
        bound = module.clone(parent=None).bind(to_linen(tree))
        return list(_declared_in(bound, wanted))
    except Exception:
        return []


def _declared_in(module: nn.Module, wanted: Callable[[Any], bool]):
    module._try_setup()
    for child in module._state.children.values():
        if not isinstance(child, nn.Module) or child.scope is None:
            continue
        if wanted(child):
            yield tuple(child.scope.path), child
        else:
            yield from _declared_in(child, wanted)


ADAPTER = register_adapter(
    Adapter(
        name="linen",
        display="Flax Linen",
        recognise=_recognise,
        to_tree=_to_tree,
        to_native=bind,
        module_types=(nn.Module,),
        layout="flax",
        like=_like,
        forward=_forward,
        infer=_infer,
        bind=bind,
        records_classes=False,
        called=_called,
        empty=_empty,
        embed=_embed,
        from_file=_from_file,
        optimizer=Optimizer(
            _unwrap_train_state,
            _wrap_train_state,
            _train_state_model,
            params=_optimizer_params,
        ),
        declared=_declared,
    )
)
