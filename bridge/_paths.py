"""Neutral paths: `('layers', 0, 'kernel')`, one copy of each helper that reads,
writes or follows them.

A neutral key is a `str` (an attribute or mapping key) or an `int` (a sequence index);
a path is a tuple of keys. `jax.tree_util` key paths, `keystr` strings and dotted
checkpoint names (`layers.0.kernel`) all convert to and from it here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from itertools import compress, repeat
from operator import attrgetter
from typing import Any, cast

import jax.tree_util as jtu
import numpy as np


Key = str | int
Path = tuple[Key, ...]

MAX_DEPTH = 400
"""The longest path `bridge` handles, in keys: far beyond any model (a few dozen), and
within Python's recursion limit for the walks over a Tree. A deeper model or file is
refused with a clear error instead of a `RecursionError` half way through."""


def check_depth(path: Path) -> None:
    """Refuse a path longer than `MAX_DEPTH` keys: ValueError naming where it starts."""
    if len(path) > MAX_DEPTH:
        start = path_str(path[:4])
        raise ValueError(
            f"{start}... is nested {len(path)} levels deep; bridge handles at most "
            f"{MAX_DEPTH} (real models nest a few dozen): flatten the structure."
        )


_KEY_OF = {
    jtu.GetAttrKey: attrgetter("name"),
    jtu.DictKey: attrgetter("key"),
    jtu.SequenceKey: attrgetter("idx"),
    jtu.FlattenedIndexKey: attrgetter("key"),
}


def key_of(entry: Any) -> Key:
    """The neutral key (`str` or `int`) of one `jax.tree_util` key entry."""
    get = _KEY_OF.get(type(entry))
    if get is None:
        raise TypeError(f"Unknown key entry {entry!r}.")
    return get(entry)


def path_of(keypath: Sequence[Any]) -> Path:
    """The neutral path of a `jax.tree_util` key path: `('layers', 0, 'kernel')`."""
    try:  # once per leaf of a model: no Python call per key
        return tuple([_KEY_OF[type(entry)](entry) for entry in keypath])
    except KeyError:
        return tuple(map(key_of, keypath))  # names the unknown entry


def path_str(path: Sequence[Key]) -> str:
    """`('layers', 0, 'kernel')` -> `'.layers[0].kernel'`, as `jax.tree_util.keystr`."""
    out = []
    for key in path:
        if isinstance(key, int):
            out.append(f"[{key}]")
        elif key.isidentifier():
            out.append(f".{key}")
        else:
            out.append(f"[{key!r}]")
    return "".join(out)


_DIGITS = re.compile(r"(\d+)")


def natural(key: Key) -> tuple:
    """A sort key for one neutral key: indices first, by value, then names in natural
    order (`Dense_2` before `Dense_10`), ties broken by the name itself."""
    got = _NATURAL.get(key)
    if got is None:
        got = _natural(key)
        if len(_NATURAL) >= _NATURAL_SIZE:
            _NATURAL.clear()
        _NATURAL[key] = got
    return got


def _natural(key: Key) -> tuple:
    if isinstance(key, int):
        return (0, key)
    parts: list[Any] = _DIGITS.split(key)
    if len(parts) > 1:
        parts[1::2] = map(int, parts[1::2])
    return (1, tuple(parts), key)


# `natural` of the keys seen lately: models repeat their keys (`kernel`, `bias`,
# `layers_0`) across nodes and conversions. Bounded: cleared when full.
_NATURAL: dict[Key, tuple] = {}
_NATURAL_SIZE = 1 << 18


def canonical(keys: Sequence[Key]) -> tuple[Key, ...]:
    """`keys` in canonical order (`natural`): the order of a Tree node's children
    for frameworks whose native order can change while the model stays the same."""
    try:  # the usual case, every key seen before: a C-level sort key
        return tuple(sorted(keys, key=_NATURAL.__getitem__))
    except KeyError:
        pass
    if len(keys) >= _MANY:
        both = _numbered(keys)
        if both is not None:
            return both[0]
    return tuple(sorted(keys, key=natural))


def canonical_and_sorted(
    keys: Sequence[Key],
) -> tuple[tuple[Key, ...], list[Key], list[int] | None]:
    """`(canonical(keys), sorted(keys), ranks)`: `ranks[i]` is the position of the
    `i`-th canonical key in sorted order (JAX lists a dict's children sorted), or
    None when not computed here. Raises `TypeError` for keys that do not sort."""
    if len(keys) >= _MANY:
        both = _numbered(keys)
        if both is not None:
            return both
    return canonical(keys), sorted(keys), None


# from this many keys on, `canonical` first tries `_numbered` (a few C-level passes)
# before computing `natural` key by key (about a microsecond each)
_MANY = 64
_ASCII_DIGITS = "0123456789"


def _numbered(
    keys: Sequence[Key],
) -> tuple[tuple[Key, ...], list[Key], list[int]] | None:
    """`canonical_and_sorted(keys)` when every key is a name without digits
    followed by ASCII digits or nothing, with no leading zero (`Dense_0` ...
    `Dense_49999`, a node of many numbered layers), sorted in C; None otherwise
    (then `canonical` computes `natural` per key). For such keys `natural` orders by
    name, then by the number, which for equal names is the order of `(length,
    key)`."""
    if not all(map(str.__instancecheck__, keys)):
        return None
    names = list(map(str.rstrip, cast("Sequence[str]", keys), repeat(_ASCII_DIGITS)))
    joined = "".join(names)
    if joined.isascii():
        if any(map(joined.__contains__, _ASCII_DIGITS)):  # a digit within a name
            return None
        # a name's digits with a leading zero (`natural` reads `007` as 7): in the
        # keys with every non-digit marked `_`, a `_` followed by `0` and a digit
        strs = cast("Sequence[str]", keys)
        marked = "\0".join(("", *strs)).encode().translate(_MARK_NAMES)
        if any(map(marked.__contains__, _LEADING_ZEROS)):
            return None
    else:
        if _DIGITS.search(joined) is not None:
            return None
        strs = cast("Sequence[str]", keys)
        lengths = list(map(len, names))
        zeros = map(str.startswith, strs, repeat("0"), lengths)
        for key, start in compress(zip(strs, lengths), zeros):
            if len(key) > start + 1:
                return None
    # natural order is the order of (name, length, key): sorted, then by length,
    # then by name (stable sorts); `sorted` (JAX's order) on the way
    jax_order: list[Key] = sorted(strs)
    strs = cast("list[str]", jax_order)
    n = len(strs)
    perm = np.argsort(np.fromiter(map(len, strs), np.int64, n), kind="stable")
    if names.count(names[0]) != n:  # several names: `Dense_0`, `Conv_0`, ...
        names = list(map(str.rstrip, strs, repeat(_ASCII_DIGITS)))
        index = {name: i for i, name in enumerate(sorted(set(names)))}
        ids = np.fromiter(map(index.__getitem__, names), np.int64, n)
        perm = perm[np.argsort(ids[perm], kind="stable")]
    ranks = perm.tolist()
    return tuple(map(jax_order.__getitem__, ranks)), jax_order, ranks


_MARK_NAMES = bytes(c if chr(c) in _ASCII_DIGITS else ord("_") for c in range(256))
_LEADING_ZEROS = tuple(f"_0{d}".encode() for d in _ASCII_DIGITS)


def is_index(key: str) -> bool:
    """Whether a name's part is an index: ASCII digits written as `str(int)` writes
    them (`"10"`, not `"010"`, `"١"` Arabic-Indic or `"²"` superscript, which
    `str.isdigit` accepts and `int` reads as another number or refuses)."""
    return key.isascii() and key.isdecimal() and (key == "0" or key[0] != "0")


def name_key(key: str) -> Key:
    """A name's part as a path key: an index (`is_index`) or the name."""
    return int(key) if is_index(key) else key


def parse(name: str, sep: str = ".") -> Path:
    """`'layers.0.kernel'` -> `('layers', 0, 'kernel')`: indices become ints."""
    return tuple(map(name_key, name.split(sep)))


def child(node: Any, key: Key) -> Any:
    """The child of a native node at `key`: an item for an `int` key or a mapping,
    an attribute otherwise (Equinox modules, skeletons, Linen `setup` children)."""
    if isinstance(key, int) or isinstance(node, Mapping):
        return node[key]
    return getattr(node, key)


def at(root: Any, path: Path) -> Any:
    """The native node at `path` under `root`, following `child`."""
    for key in path:
        root = child(root, key)
    return root


_ARRAY_TYPES: dict[type, bool] = {}


def is_array(leaf: Any) -> bool:
    """Whether a leaf is an array (has a shape and a dtype: JAX and NumPy arrays,
    tracers, `jax.ShapeDtypeStruct`), decided once per type."""
    cls = type(leaf)
    known = _ARRAY_TYPES.get(cls)
    if known is None:
        # a benign race: two threads may both compute the same value
        known = _ARRAY_TYPES[cls] = hasattr(leaf, "shape") and hasattr(leaf, "dtype")
    return known
