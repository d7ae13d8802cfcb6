"""A model's Tree as a checkpoint's contents (`describe`: the `Contents` and the arrays
to write) and back (`file_tree`: the Tree of a checkpoint's arrays)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.tree_util as jtu

from .._adapters._linen import from_linen
from .._adapters._registry import Adapter, registered
from .._adapters._torch import from_torch
from .._paths import Path as TreePath, at, path_of
from .._tree import (
    Tree,
    build,
    framework,
    kind,
    leaf_roles,
    native_order,
    native_paths,
    source_of,
    walk,
)
from . import _experts
from ._classes import resolve
from ._contents import RESERVED, VERSION, Contents, Stored, dotted, is_key, split


_RESERVED_KEY = """\
metadata keys {keys} are reserved: bridge writes {reserved} itself. Rename your keys
(for example with a prefix: 'user.step')."""

_NOT_STRINGS = """\
`metadata` must map strings to strings (safetensors stores text only); got {problems}.
Encode other values yourself, e.g. json.dumps(value)."""

_NOT_AN_ARRAY = """\
Only arrays can be saved, but {problems}. Save the whole model (eqx.combine a
partitioned Tree first), not a filter spec."""

_KEY_COLLISION = """\
Two paths give the same dotted name in the file: {problems}. Rename one of them."""


def describe(tree: Tree, metadata: Mapping[str, str] | None) -> tuple[Contents, dict]:
    """The `Contents` a Tree is saved as, and `{dotted name: array to store}`."""
    flat = list(zip(jtu.tree_flatten_with_path(tree)[0], leaf_roles(tree)))
    if native_order(tree):  # the file lists the arrays in the model's native order
        at_path = {path_of(kp): ((kp, leaf), role) for (kp, leaf), role in flat}
        flat = [at_path[path] for path in native_paths(tree)]
    problems, collisions, names, arrays, tensors = [], [], {}, {}, []
    for (keypath, leaf), role in flat:
        path = path_of(keypath)
        name = dotted(path)
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            problems.append(f"{jtu.keystr(keypath)} is a {type(leaf).__name__}")
            continue
        if name in names:
            collisions.append(f"{jtu.keystr(names[name])} and {jtu.keystr(keypath)}")
        names[name] = keypath
        impl = None
        if is_key(leaf):
            impl = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        arrays[name] = leaf
        tensors.append(
            Stored(name, path, str(role), tuple(leaf.shape), str(leaf.dtype), impl)
        )
    if problems:
        raise TypeError(_NOT_AN_ARRAY.format(problems=", ".join(problems)))
    if collisions:
        raise ValueError(_KEY_COLLISION.format(problems="; ".join(collisions)))
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(
            f"`metadata` must be a dict of strings to strings, got a "
            f"{type(metadata).__name__}."
        )
    user = dict(metadata or {})
    bad = [f"{k!r}: {v!r}" for k, v in user.items() if not both_str(k, v)]
    if bad:
        raise TypeError(_NOT_STRINGS.format(problems=", ".join(bad)))
    taken = [key for key in user if key in RESERVED]
    if taken:
        raise ValueError(_RESERVED_KEY.format(keys=taken, reserved=RESERVED))
    fw = framework(tree)
    adapter = registered(fw)
    settings = _settings(tree, adapter)
    modules = tuple(
        (path, f"{cls.__module__}:{cls.__qualname__}", settings(path))
        for path, node in walk(tree)
        if (cls := kind(node)) is not None
    )
    layout = "" if adapter is None else adapter.layout
    empty = (
        () if adapter is None or adapter.empty is None else tuple(adapter.empty(tree))
    )
    contents = Contents(
        Path(), "", fw, layout, VERSION, modules, user, tuple(tensors), empty=empty
    )
    return contents, arrays


def _settings(tree: Tree, adapter: Adapter | None) -> Callable[[TreePath], dict]:
    """Each module's plain settings by path, where its adapter records them."""
    if adapter is None or adapter.settings is None or adapter.modules is None:
        return lambda path: {}
    native, settings = adapter.modules(tree), adapter.settings
    return lambda path: settings(at(native, path))


def both_str(key: Any, value: Any) -> bool:
    return isinstance(key, str) and isinstance(value, str)


def _natural(path: tuple) -> tuple:
    return tuple((0, k, "") if isinstance(k, int) else (1, 0, k) for k in path)


def file_tree(contents: Contents, arrays: Mapping[str, Any]) -> Tree:
    """The Tree of a checkpoint's arrays, with their roles.

    From a file of a framework whose adapter reads files itself (`from_file`:
    Equinox, whose native model is then a skeleton, `bridge._adapters._skeleton`):
    that framework's Tree. Each module's class is its kind where that class is
    already imported. From any other file: the Tree of Linen-style variables
    (`{role: {module: {name: array}}}`, Flax's layout), so `bridge.to_native` gives
    that dict.
    """
    if contents.layout == "torch":  # files sort names: 2 before 10, as PyTorch
        # (by `arrays`' names: a quantized weight's parts are one array there;
        # a name whose path lost a `prefix=` goes by that path)
        renamed = {s.key: dotted(s.path) for s in contents.tensors}
        ordered = sorted(arrays, key=lambda name: _natural(split(name)))
        state = {renamed.get(name, name): arrays[name] for name in ordered}
        if _experts.has_packed(state):  # transformers v5: read per expert
            state = _experts.unpack(state)
        return from_torch(state)
    kinds = {p: cls for p, c, _ in contents.modules if (cls := resolve(c))}
    adapter = registered(contents.framework)
    if adapter is not None and adapter.from_file is not None:
        tensors = [(s.path, s.role, arrays[s.key]) for s in contents.tensors]
        modules = {p: (c, f) for p, c, f in contents.modules}
        return adapter.from_file(tensors, modules, kinds)
    variables: dict[str, Any] = {}
    for s in contents.tensors:
        node = variables.setdefault(s.role, {})
        for key in s.path[:-1]:
            node = node.setdefault(key, {})
        node[s.path[-1]] = arrays[s.key]
    for role, path in contents.empty:  # checked: none holds or is inside an array
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
