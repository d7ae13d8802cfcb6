"""The neutral tree: one immutable, keyed pytree node for models of every framework.

A `Tree` is organised by module, the way the source model reads (`t.layers[-1].kernel`,
`t.BatchNorm_0.mean`). Its leaves are arrays; everything else (each leaf's role, the
native class of each node, and at the root the record an adapter needs to rebuild the
native model) is static metadata in the pytree's aux data, so `jax.jit` takes a Tree
directly and `eqx.tree_at` / `eqx.partition` / `eqx.combine` work on it unchanged.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Generic, TypeVar

import jax.tree_util as jtu
import numpy as np

from ._display._outline import Line, Span, html, text, treescope
from ._kept._array import QuantizedArray
from ._paths import Key, Path, path_of
from ._sizes import human


def _key_entry(key: Key, sequence: bool) -> Any:
    if sequence:
        assert isinstance(key, int)  # a sequence node's keys are its indices
        return jtu.SequenceKey(key)
    if isinstance(key, str) and key.isidentifier():
        return jtu.GetAttrKey(key)
    return jtu.DictKey(key)


class Held:
    """Any value as hashable static data: hashed and compared by value when it
    can be (so `jax.jit` sees two equal models as one), by identity otherwise (a
    function, a list, an `nn.Sequential` holding a list). `summary`, when given,
    is hashed instead of the value (equal values must have equal summaries): for a
    value that is slow to hash, such as a large NNX graph definition."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: Any, summary: Hashable = None):
        self.value = value
        try:
            self._hash = hash(value if summary is None else summary)
        except Exception:  # unhashable (a list, an array): equal by identity
            self._hash = hash(type(value))

    def __eq__(self, other):
        if type(other) is not Held:
            return False
        if self.value is other.value:
            return True
        try:
            return bool(self._hash == other._hash and self.value == other.value)
        except Exception:  # an array compares elementwise: not static data
            return False

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return f"Held({self.value!r})"


class NativeOrder:
    """A native child order held as static data that takes no part in equality: two
    Trees of the same model whose native orders differ (an NNX module after
    `nnx.jit`, Linen params after an optax step) have equal structures, and each
    still rebuilds its own native order. All `NativeOrder`s are equal."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other):
        return type(other) is NativeOrder

    def __hash__(self):
        return 0

    def __repr__(self):
        return f"NativeOrder({self.value!r})"


R = TypeVar("R", bound=Hashable)


@dataclass(frozen=True, eq=False)
class Source(Generic[R]):
    """What an adapter needs to rebuild the native model from a Tree's leaves.

    `paths` are the leaf paths in Tree order, `order[i]` is the position of Tree leaf
    `i` among the native leaves, and `record` is the adapter's own hashable data
    (treedefs, graphdef, module). Equality is structural, the hash is computed once.
    `native` maps the path of each node whose native child order differs from its
    Tree (canonical) order to its children's keys in native order; it takes no part
    in equality (see `native_order`).
    """

    framework: str
    paths: tuple[Path, ...]
    order: tuple[int, ...]
    record: R
    native: Mapping[Path, tuple[Key, ...]] = field(default_factory=dict, repr=False)
    _hash: int = field(init=False, repr=False)
    # the last Tree structure checked to fit (see `native_leaves`): a cache
    _treedef: Any = field(init=False, repr=False, default=None)
    # the `is_leaf` that flattens the Tree into its paths' leaves: None, or a test
    # for leaves that are pytrees themselves (a weight kept quantized), set only
    # when the Tree holds one (an `is_leaf` costs a Python call per node)
    _is_leaf: Any = field(init=False, repr=False, default=None)

    def __post_init__(self):
        key = (self.framework, self.paths, self.order, self.record)
        object.__setattr__(self, "_hash", hash(key))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if self is other:
            return True
        return (
            type(other) is Source
            and self._hash == other._hash
            and (self.framework, self.paths, self.order, self.record)
            == (other.framework, other.paths, other.order, other.record)
        )


@dataclass(frozen=True, eq=False)
class _Info:
    """A node's static data: child keys (None: a sequence), leaf roles, native kind."""

    keys: tuple[Key, ...] | None
    roles: tuple[str | None, ...]
    kind: Any
    source: Source[Any] | None
    _hash: int = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash(self._data()))

    @cached_property
    def entries(self) -> tuple[Any, ...]:
        """The children's `jax.tree_util` key entries, made when first read (by a
        flatten with keys: a root of many children makes many)."""
        if self.keys is None:
            return tuple([_key_entry(k, True) for k in range(len(self.roles))])
        return tuple([_key_entry(k, False) for k in self.keys])

    def _data(self):
        return (self.keys, self.roles, self.kind, self.source)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if self is other:
            return True
        return (
            type(other) is _Info
            and self._hash == other._hash
            and self._data() == other._data()
        )


_SLICE_OF_MAPPING = """\
Only a sequence node (an NNX nnx.List, an Equinox tuple or list) takes a slice; this
node maps names to children, {keys}. Select children by name, e.g.
`lambda t: (t.layers_0, t.layers_1)`."""


class Tree:
    """A model of any framework as one immutable pytree, organised by module.

    Made by the adapters (`bridge.from_linen`, `bridge.from_nnx`,
    `bridge.from_equinox`, `bridge.to_neutral`), turned back by `bridge.to_native`.
    Children read like the source model: by attribute (`t.layers`), by item
    (`t["layers"]`), and sequences (NNX `nnx.List`, Equinox tuples) by index, from the
    end too (`t.layers[-1]`), and by slice, a tuple of the children (`t.layers[1:]`).
    `jax.tree_util.keystr` paths read `.layers[0].kernel`.

    Leaves made by an adapter are arrays, shared with the source (never copied). Each
    leaf has a role (`bridge.roles`): `"params"`, `"batch_stats"`, `"rngs"`, ...

    **Example:**

    ```python
    >>> import jax, equinox as eqx, bridge
    >>> mlp = eqx.nn.MLP(2, 3, width_size=4, depth=2, key=jax.random.key(0))
    >>> t = bridge.from_equinox(mlp)
    >>> t.layers[-1].weight.shape
    (3, 4)
    >>> spec = jax.tree_util.tree_map(lambda _: False, t)
    >>> spec = eqx.tree_at(lambda s: s.layers[-1].weight, spec, replace=True)
    >>> sum(jax.tree_util.tree_leaves(spec))
    1

    ```
    """

    # `_flat`, set on the Trees `bridge.make_step` returns: the leaves as the step
    # holds them, an object with `.treedef` and `.leaves()`. Such a Tree is made
    # without children (`Tree._lazy`), and builds them on first use (`__getattr__`):
    # a training loop that only passes it to the next step never does
    __slots__ = ("_info", "_children", "_flat")
    _info: _Info
    _children: tuple[Any, ...]

    def __init__(self, *args, **kwargs):
        raise TypeError(
            "A Tree is made by an adapter: use bridge.to_neutral(model), "
            "bridge.from_linen, bridge.from_nnx or bridge.from_equinox."
        )

    @staticmethod
    def _make(info: _Info, children: Sequence[Any]) -> Tree:
        # once per node of every Tree made or unflattened: the slots' own setters
        # (half the time of `object.__setattr__` by name)
        self = _new(Tree)
        _set_info(self, info)
        _set_children(self, tuple(children))
        return self

    @classmethod
    def _lazy(cls, info: _Info, flat: Any) -> Tree:
        """A Tree with root `info` whose children are built from `flat` when read."""
        self = object.__new__(cls)
        object.__setattr__(self, "_info", info)
        object.__setattr__(self, "_flat", flat)
        return self

    def __setattr__(self, name, value):
        raise AttributeError(
            f"A Tree is immutable: use eqx.tree_at(lambda t: t.{name}, tree, "
            "replace=...) to get a new Tree with that change."
        )

    def __delattr__(self, name):
        raise AttributeError("A Tree is immutable.")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "_children":  # a lazy Tree (`Tree._lazy`), read for the first time
            flat = object.__getattribute__(self, "_flat")
            children = jtu.tree_unflatten(flat.treedef, flat.leaves())._children
            object.__setattr__(self, "_children", children)
            return children
        keys = self._info.keys
        if keys is not None and name in keys:
            return self._children[keys.index(name)]
        raise AttributeError(self._missing(name))

    def __getitem__(self, key: Key | slice) -> Any:
        """A child by key or index; a slice of a sequence node is a tuple of the
        stored children (`t.layers[1:]`), so `eqx.tree_at` finds them."""
        keys = self._info.keys
        if keys is None:
            if isinstance(key, slice):
                return self._children[key]
            if isinstance(key, int) and -len(self) <= key < len(self):
                return self._children[key]
        elif isinstance(key, slice):
            raise KeyError(_SLICE_OF_MAPPING.format(keys=list(keys)))
        elif key in keys:
            return self._children[keys.index(key)]
        raise KeyError(self._missing(key))

    def _missing(self, key: Key) -> str:
        keys = self._info.keys
        if keys is None:
            return f"{key!r} is not an index of this sequence of {len(self)} children."
        return f"This Tree has no child {key!r}; its children are {list(keys)}."

    def __len__(self) -> int:
        return len(self._children)

    def __iter__(self) -> Iterator[Any]:
        """Keys for a mapping node (like `dict`), children for a sequence (like
        `list`)."""
        keys = self._info.keys
        return iter(self._children if keys is None else keys)

    def __contains__(self, key: object) -> bool:
        keys = self._info.keys
        return key in (range(len(self)) if keys is None else keys)

    def __dir__(self):
        keys = self._info.keys or ()
        return [k for k in keys if isinstance(k, str)]

    def __repr__(self) -> str:
        return text(outline(self))

    def _repr_html_(self) -> str:
        return html(outline(self))

    def __treescope_repr__(self, path: Any, subtree_renderer: Any) -> Any:
        return treescope(outline(self), path)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: a Tree holds a model's arrays, not its computation."""
        raise TypeError(_NOT_CALLABLE)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


_new = object.__new__
_set_info = Tree.__dict__["_info"].__set__
_set_children = Tree.__dict__["_children"].__set__


_NOT_CALLABLE = """\
A bridge.Tree holds a model's arrays, not its computation, so it cannot be called.
Run it as its framework's model: `bridge.to_native(tree)(x)` (NNX, Equinox), or
`module.apply(bridge.to_native(tree), x)` (Linen variables); or load a checkpoint
straight into your model: `model = bridge.load(path, like=model)`."""


def _leaf_text(leaf: Any) -> str:
    """An array as `dtype[shape]` (`float32[64,32]`), read from its attributes only
    (a lazy or abstract leaf stays unread); a weight kept quantized says so."""
    if isinstance(leaf, QuantizedArray):  # its scheme and stored shape
        return repr(leaf)
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        return type(leaf).__name__
    return f"{dtype}[{','.join(map(str, shape))}]"


Sizes = dict[str, tuple[int, int]]
"""`{role: (elements, bytes)}` of the arrays under a node, params first."""


def _leaf_size(leaf: Any) -> tuple[int, int]:
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        return 0, 0
    count = math.prod(shape)
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # a typed PRNG key
        itemsize = 0
    return count, count * itemsize


def _sizes_text(sizes: Sizes) -> str:
    return ", ".join(f"{r}: {n:,} ({human(b)})" for r, (n, b) in sizes.items())


class _Walk:
    """One pass over a Tree for its outline: each node's sizes and signature (kind,
    names, shapes, dtypes, roles: what makes two blocks the same), memoised."""

    def __init__(self, tree: Tree):
        self.native = native_order(tree)
        self.sizes: dict[int, Sizes] = {}
        self.signatures: dict[int, Hashable] = {}

    def children(self, node: Tree, path: Path) -> list[tuple[str, Any, Any, Key]]:
        """`(label, child, role, key)` in the model's own order."""
        info = node._info
        out = [
            (jtu.keystr((e,)), c, r, k)
            for e, c, r, k in zip(info.entries, node._children, info.roles, _keys(node))
        ]
        order = self.native.get(path)
        if order is not None and set(order) == {c[3] for c in out}:
            rank = {k: i for i, k in enumerate(order)}
            out.sort(key=lambda c: rank[c[3]])
        return out

    def size(self, node: Tree) -> Sizes:
        found = self.sizes.get(id(node))
        if found is not None:
            return found
        out: Sizes = {}
        for child, role in zip(node._children, node._info.roles):
            parts = (
                self.size(child).items()
                if isinstance(child, Tree)
                else [(role or "params", _leaf_size(child))]
            )
            for r, (n, b) in parts:
                n0, b0 = out.get(r, (0, 0))
                out[r] = (n0 + n, b0 + b)
        out = dict(sorted(out.items(), key=lambda kv: kv[0] != "params"))
        self.sizes[id(node)] = out
        return out

    def signature(self, node: Any) -> Hashable:
        if not isinstance(node, Tree):
            return (_leaf_text(node),)
        found = self.signatures.get(id(node))
        if found is None:
            info = node._info
            found = (
                getattr(info.kind, "__name__", None),
                info.roles,
                tuple(self.signature(c) for c in node._children),
                None if info.keys is None else tuple(map(str, info.keys)),
            )
            self.signatures[id(node)] = found
        return found


def outline(tree: Tree) -> Line:
    """The Tree as an outline (`bridge._display._outline`): a line per layer (its
    name, kind, arrays' dtypes and shapes, parameter count), a node holding layers
    with its total; a run of equal layers or blocks of a sequence (or named
    `layers_0`, `layers_1`, ...) folded into one line, `[0..11]: 12 × (Block)`,
    over one block's lines; children in the model's own order. Arrays are read by
    their shapes and dtypes only."""
    walk = _Walk(tree)
    return _node(tree, "Tree", walk, (), root=True)


_INDEXED = re.compile(r"^(.*?)(\d+)(\]?)$")


def _node(node: Tree, label: str, walk: _Walk, path: Path, root: bool = False) -> Line:
    kind = getattr(node._info.kind, "__name__", None)
    children = walk.children(node, path)
    named = [Span(label, "head" if root else "name")]
    if kind:
        named += [Span(" ("), Span(kind, "kind"), Span(")")]
    if not any(isinstance(c, Tree) for _, c, _, _ in children) and not root:
        return Line(
            (*named, *_arrays(children), Span(f"  # {_count(walk, node)}", "count"))
        )
    if len(children) == 1 and not root and not kind:  # a chain: one name
        sub_label, child, role, key = children[0]
        if isinstance(child, Tree):
            return _node(child, label + sub_label, walk, path + (key,))
    head = (*named, Span(f"  # {_sizes_text(walk.size(node))}", "count"))
    lines = []
    for run in _runs(children, walk):
        sub_label, child, role, key = run[0]
        if not isinstance(child, Tree):
            note = "" if role in (None, "params") else f"  # {role}"
            lines.append(
                Line(
                    (
                        Span(sub_label, "name"),
                        Span(" "),
                        Span(_leaf_text(child), "shape"),
                        Span(note, "muted"),
                    )
                )
            )
            continue
        line = _node(child, sub_label, walk, path + (key,))
        if len(run) > 1:
            line = _folded(line, run, walk)
        lines.append(line)
    return Line(head, tuple(lines))


def _count(walk: _Walk, node: Tree) -> str:
    return ", ".join(
        f"{n:,}" if r == "params" else f"{r}: {n:,}"
        for r, (n, _) in walk.size(node).items()
    )


def _arrays(children: list[tuple[str, Any, Any, Key]]) -> list[Span]:
    """A layer's arrays on its line, its params first, each other role after its
    name: `scale float32[4], bias float32[4]; batch_stats: mean float32[4], ...`."""
    roles: dict[str, list[tuple[str, Any]]] = {}
    for label, leaf, role, _ in children:
        roles.setdefault(role or "params", []).append((label.lstrip("."), leaf))
    spans = [Span("  ")]
    ordered = sorted(roles.items(), key=lambda kv: kv[0] != "params")
    for i, (role, arrays) in enumerate(ordered):
        if i:
            spans.append(Span(f"; {role}: ", "muted"))
        for j, (name, leaf) in enumerate(arrays):
            spans += [Span(", " if j else ""), Span(name + " ", "muted")]
            spans.append(Span(_leaf_text(leaf), "shape"))
    return spans


def _runs(children: list[tuple[str, Any, Any, Key]], walk: _Walk) -> list[list]:
    """The children in runs: equal blocks in a row whose labels count up (`[3]`,
    `[4]`; `layers_3`, `layers_4`) together, every other child alone."""
    runs: list[list] = []
    for child in children:
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and isinstance(child[1], Tree)
            and isinstance(last[1], Tree)
            and _next_label(last[0]) == child[0]
            and walk.signature(child[1]) == walk.signature(last[1])
        ):
            runs[-1].append(child)
        else:
            runs.append([child])
    return runs


def _next_label(label: str) -> str | None:
    found = _INDEXED.match(label)
    if found is None:
        return None
    head, number, tail = found.groups()
    return f"{head}{int(number) + 1}{tail}"


def _folded(line: Line, run: list, walk: _Walk) -> Line:
    """`line` (the run's first block) as the run's: `[0..11]: 12 × Kind  # each:
    ...`, folded over the first block's lines."""
    first, last = run[0][0], run[-1][0]
    found = _INDEXED.match(last)
    assert found is not None  # `_runs` made it
    label = line.spans[0].text  # the first block's, a chain's names after it
    ranged = f"{first.rstrip(']')}..{found.group(2)}{found.group(3)}"
    span = ranged + label[len(first) :] + ": "
    rest = list(line.spans[1:])
    if rest and rest[0].text == " (":  # the kind: `12 × (Block)`
        kind, rest = rest[:3], rest[3:]
    else:
        kind = []
    each = [
        Span(s.text.replace("  # ", "  # each: ", 1), s.style)
        if s.style == "count"
        else s
        for s in rest
    ]
    times = Span(f"{len(run)} ×", "count")
    spans = (Span(span, "name"), times, *kind, *each)
    return Line(spans, line.children, folded=True)


def _flatten_with_keys(t: Tree):
    return tuple(zip(t._info.entries, t._children)), t._info


def _flatten(t: Tree):
    return t._children, t._info


def _unflatten(info: _Info, children) -> Tree:
    return Tree._make(info, children)


jtu.register_pytree_with_keys(Tree, _flatten_with_keys, _unflatten, _flatten)


def native_order(tree: Tree) -> Mapping[Path, tuple[Key, ...]]:
    """The native child order of a whole-model Tree's nodes, where it differs from
    the Tree's order: `{node path: child keys in native order}` (empty for a part of
    a model, or a framework whose Tree order is its native order).

    A Tree's own order is canonical, so that the same model always has the same
    structure: NNX and Linen children in natural key order (`Dense_2` before
    `Dense_10`), Equinox fields in class order. The native order (NNX attribute
    order, Linen dict order) is what `bridge.to_native` rebuilds; it is the creation
    order only when nothing sorted it (see `bridge._port._pairing.Order`)."""
    src = tree._info.source
    return {} if src is None else src.native


def native_paths(tree: Tree) -> list[Path]:
    """The leaf paths of `tree` in native order (`native_order`), parents' order
    first: how a checkpoint lists them."""
    native = native_order(tree)
    out: list[Path] = []

    def visit(node: Tree, prefix: Path) -> None:
        children = dict(items(node))
        keys = native.get(prefix)
        if keys is None or set(keys) != set(children):
            keys = tuple(children)
        for key in keys:
            child = children[key]
            if isinstance(child, Tree):
                visit(child, prefix + (key,))
            else:
                out.append(prefix + (key,))

    visit(tree, ())
    return out


def native_rank(tree: Tree) -> Callable[[Path], tuple[int, ...]]:
    """A sort key that puts paths under `tree` in its native order (`native_order`);
    a key the Tree does not hold (a layer index inside a stack) ranks by itself."""
    native = native_order(tree)
    positions: dict[Path, dict[Key, int]] = {}
    for path, node in walk(tree):
        keys = native.get(path) or _keys(node)
        positions[path] = {k: i for i, k in enumerate(keys)}

    def rank(path: Path) -> tuple[int, ...]:
        out = []
        for depth, key in enumerate(path):
            here = positions.get(path[:depth], {})
            out.append(here.get(key, key if isinstance(key, int) else len(here)))
        return tuple(out)

    return rank


def walk(tree: Tree, prefix: Path = ()) -> Iterator[tuple[Path, Tree]]:
    """Every node of `tree` with its path, parents before children, in Tree order."""
    yield prefix, tree
    for key, child in zip(_keys(tree), tree._children):
        if isinstance(child, Tree):
            yield from walk(child, prefix + (key,))


def _keys(node: Tree) -> tuple[Key, ...]:
    keys = node._info.keys
    return tuple(range(len(node))) if keys is None else keys


def items(node: Tree) -> list[tuple[Key, Any]]:
    """`(key, child)` pairs of one node, in order."""
    return list(zip(_keys(node), node._children))


def kind(node: Tree) -> Any:
    """The native class of the module at this node (None when unknown)."""
    return node._info.kind


def framework(tree: Tree) -> str | None:
    """`"linen"`, `"nnx"`, `"equinox"` or `"torch"` for a whole-model Tree, else
    None."""
    src = tree._info.source
    return None if src is None else src.framework


def roles(tree: Tree) -> Tree:
    """The same structure as `tree`, with each leaf's role string as the leaf.

    A role is the Linen collection name (`"params"`, `"batch_stats"`, `"cache"`, ...);
    for NNX the collection flax's own bridge maps the Variable type to (`Param` ->
    `"params"`, `BatchStat` -> `"batch_stats"`, `RngKey`/`RngCount` -> `"rngs"`,
    `Cache` -> `"cache"`, `Intermediate` -> `"intermediates"`); for Equinox
    `"params"` for the model's arrays, `"batch_stats"` for a `BatchNorm`'s entries of
    `eqx.nn.State` and `"state"` for other `State` entries.

    **Arguments:**

    - `tree`: a `bridge.Tree` (or a part of one).

    **Returns:**

    A `bridge.Tree` of the same structure whose leaves are role strings.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, flax.linen as nn, bridge
    >>> bn = nn.BatchNorm(use_running_average=True)
    >>> v = bn.init(jax.random.key(0), jnp.ones((1, 3)))
    >>> r = bridge.roles(bridge.from_linen(v))
    >>> r.mean, r.scale
    ('batch_stats', 'params')

    ```
    """
    if not isinstance(tree, Tree):
        raise TypeError(f"`tree` must be a bridge.Tree, got {type(tree).__name__}.")
    info = tree._info
    children = [
        roles(c)
        if isinstance(c, Tree)
        else jtu.tree_map(lambda _, r=r: r, c)
        if isinstance(c, QuantizedArray)  # its parts: one role
        else r
        for c, r in zip(tree._children, info.roles)
    ]
    return Tree._make(info, children)


def leaf_roles(tree: Tree) -> list[str | None]:
    """Each leaf's role, in `jax.tree_util.tree_leaves(tree)` order."""
    return jtu.tree_leaves(roles(tree))


def map_with_path(fn: Callable[[Path, Any], Any], tree: Tree, *rest: Any) -> Any:
    """`jax.tree_util.tree_map_with_path` with neutral paths (`('layers', 0, 'w')`)."""
    return jtu.tree_map_with_path(lambda p, *xs: fn(path_of(p), *xs), tree, *rest)
