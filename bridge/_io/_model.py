"""A model's Tree as a checkpoint's contents (`describe`: the `Contents` and the arrays
to write) and back (`file_tree`: the Tree of a checkpoint's arrays)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.tree_util as jtu

from .._adapters._registry import Adapter, adapters, file_reader, registered
from .._families._gpt2 import file_linears
from .._families._offset_norms import file_norms
from .._paths import Path as TreePath, at, path_of
from .._tree import (
    Tree,
    framework,
    kind,
    leaf_roles,
    native_order,
    native_paths,
    walk,
)
from ._classes import resolve
from ._config import CONFIG, model_type, read_config
from ._contents import RESERVED, VERSION, Contents, Stored, dotted, is_key, split
from ._errors import CheckpointError


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


def describe(
    tree: Tree,
    metadata: Mapping[str, str] | None,
    uses: Mapping[TreePath, tuple[int, ...]] | None = None,
) -> tuple[Contents, dict]:
    """The `Contents` a Tree is saved as, and `{dotted name: array to store}`;
    `uses`, where the model's forward pass was traced (`save(..., example=...)`):
    the position of each array's first use (`Contents.order`)."""
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
    user = check_metadata(metadata)
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
    used = sorted((pos, dotted(path)) for path, pos in (uses or {}).items())
    contents = Contents(
        Path(),
        "",
        fw,
        layout,
        VERSION,
        modules,
        user,
        tuple(tensors),
        empty=empty,
        order=tuple(name for _, name in used if name in arrays),
    )
    return contents, arrays


def _settings(tree: Tree, adapter: Adapter | None) -> Callable[[TreePath], dict]:
    """Each module's plain settings by path, where its adapter records them."""
    if adapter is None or adapter.settings is None or adapter.modules is None:
        return lambda path: {}
    native, settings = adapter.modules(tree), adapter.settings
    return lambda path: settings(at(native, path))


def check_metadata(metadata: Any) -> dict[str, str]:
    """`metadata` (None or a dict of strings to strings) as a dict, or `TypeError`
    naming the argument and what is not a string."""
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(
            f"`metadata` must be a dict of strings to strings, got a "
            f"{type(metadata).__name__}."
        )
    user = dict(metadata or {})
    bad = [f"{k!r}: {v!r}" for k, v in user.items() if not both_str(k, v)]
    if bad:
        raise TypeError(_NOT_STRINGS.format(problems=", ".join(bad)))
    return user


def both_str(key: Any, value: Any) -> bool:
    return isinstance(key, str) and isinstance(value, str)


def file_tree(contents: Contents, arrays: Mapping[str, Any]) -> Tree:
    """The Tree of a checkpoint's arrays, with their roles.

    The adapter that reads the file's framework and layout makes it
    (`Adapter.from_file`, chosen by `file_reader`): from an Equinox file, an Equinox
    Tree whose native model is a skeleton (`bridge._adapters._skeleton`); from a
    PyTorch-layout file, its state dict; from a Flax file (Linen, NNX) or any other,
    the Tree of Linen-style variables (`{role: {module: {name: array}}}`, Flax's
    layout), so `bridge.to_native` gives that dict. Each module's class is its kind
    where that class is already imported; in a Hugging Face folder whose
    `config.json` names a family of `x * (1 + weight)` norms (Gemma), each norm's
    kind is that norm's (`bridge/_families/_offset_norms.py`).
    """
    kinds = {p: cls for p, c, _ in contents.modules if (cls := resolve(c))}
    read = file_reader(contents.framework, contents.layout)
    stored = {s.key: s for s in contents.tensors}
    # by `arrays`' names: a quantized weight's tensors are one array there, under
    # the weight's name (`bridge._quant._read.dense`)
    tensors = [
        (name, s.path, s.role, array)
        if (s := stored.get(name)) is not None
        else (name, split(name), "params", array)
        for name, array in arrays.items()
    ]
    if contents.layout == "torch":  # a Hugging Face folder says its family
        ndims = [(path, len(array.shape)) for _, path, _, array in tensors]
        family = model_type(contents.path)
        kinds.update(file_norms(family, ndims))  # read if listed
        kinds.update(file_linears(family, ndims))
    modules = {p: (c, f) for p, c, f in contents.modules}
    try:
        tree = read(tensors, modules, kinds, list(contents.empty))
    except CheckpointError:
        raise
    except ValueError as error:  # names its framework cannot hold as one model
        raise CheckpointError(f"{contents.path}: {error}") from None
    told = next(
        (a.with_config for a in adapters() if a.layout == contents.layout), None
    )
    folder = Path(contents.path).parent
    if told is not None and (folder / CONFIG).is_file():  # a Hugging Face folder:
        # its config (its tied head: `ties`), and its model built when a trace
        # needs it
        try:
            config: Any = read_config(folder)
        except CheckpointError:  # the trace says why, where it needs the config
            config = None
        tree = told(tree, str(folder) if config is None else config)
    return tree
