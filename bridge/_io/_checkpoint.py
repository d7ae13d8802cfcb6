"""`save` and `load`: a model of any framework to and from a checkpoint on disk.

A checkpoint is one safetensors file (`*.safetensors`), a flax msgpack file
(`*.msgpack`) or an orbax checkpoint directory (any other path). Arrays are stored
under their dotted neutral path (`layers.0.kernel`); the metadata records, for each
array, its path, role, shape and dtype (and for a typed PRNG key its impl), plus the
source framework, its layout, the native class of each module (and for Equinox its
plain settings, so a file can be ported without the model) and the bridge version.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import safetensors

from .._adapters._equinox import to_equinox
from .._adapters._linen import bind, from_linen, to_linen
from .._adapters._native import to_native, to_neutral
from .._adapters._nnx import to_nnx
from .._adapters._skeleton import settings, skeleton
from .._port._errors import PortError
from .._port._port import port
from .._tree import (
    Path as TreePath,
    Tree,
    build,
    framework,
    key_of,
    kind,
    leaf_roles,
    source_of,
    walk,
)
from . import _msgpack, _orbax, _safetensors


try:
    VERSION = importlib.metadata.version("bridge")
except importlib.metadata.PackageNotFoundError:  # run from a source tree
    VERSION = "unknown"
LAYOUTS = {"linen": "flax", "nnx": "flax", "equinox": "equinox"}
RESERVED = ("bridge_version", "framework", "layout", "tensors", "modules")

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

_MISSING = "{path}: no such file or directory."

_NOT_A_CHECKPOINT = """\
{path} is a directory but not a checkpoint written by bridge.save (no '{arrays}' and \
'{metadata}' items). Point at the checkpoint directory itself."""

_UNREADABLE = """\
{path} is not a readable {format} checkpoint: {reason}. The file may be truncated or \
corrupted; save it again from the model."""

_PORTING = """\
(while porting {path} into `like`: the file came from another framework, so its
arrays were paired with `like`'s layers by bridge.port)"""

_MISMATCH = """\
{path} does not fit the model given as `like`:
{problems}
A file of `like`'s own framework fills it only with exactly its arrays (the same paths,
shapes and dtypes). To see what the file holds, run `bridge inspect` on it, or load it
without `like`."""


@dataclass(frozen=True)
class Stored:
    """One array in a checkpoint, as stored: a typed PRNG key is stored as its key
    data (`shape`, `dtype` are the key data's), and `prng_impl` names its impl."""

    key: str
    path: TreePath
    role: str
    shape: tuple[int, ...]
    dtype: str
    prng_impl: str | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize

    @property
    def logical(self) -> tuple[tuple[int, ...], str]:
        """`(shape, dtype)` as the model holds it (a typed key array for PRNG keys)."""
        if self.prng_impl is None:
            return self.shape, self.dtype
        data_ndim, dtype = _key_info(self.prng_impl)
        return self.shape[: len(self.shape) - data_ndim], dtype


@dataclass(frozen=True)
class Contents:
    """What a checkpoint holds, read from its header only (no array is read)."""

    path: Path
    format: str  # "safetensors", "orbax" or "msgpack"
    framework: str | None  # None: not written by bridge, or converted
    layout: str  # "flax", "equinox" or "" (unknown)
    version: str | None
    modules: tuple[tuple[TreePath, str, dict[str, Any]], ...]  # class, settings
    metadata: dict[str, str]  # the user's own
    tensors: tuple[Stored, ...]


@functools.cache
def _key_info(impl: str) -> tuple[int, str]:
    key = jax.random.key(0, impl=impl)
    return jax.random.key_data(key).ndim, str(key.dtype)


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def dotted(path: TreePath) -> str:
    """`('layers', 0, 'kernel')` -> `'layers.0.kernel'`."""
    return ".".join(map(str, path))


def format_of(path: Path) -> str:
    """The format a path is saved in: by its suffix, orbax for anything else."""
    return {".safetensors": "safetensors", ".msgpack": "msgpack"}.get(
        path.suffix, "orbax"
    )


# --- saving -----------------------------------------------------------------------


def describe(tree: Tree, metadata: Mapping[str, str] | None) -> tuple[Contents, dict]:
    """The `Contents` a Tree is saved as, and `{dotted name: array to store}`."""
    flat = jtu.tree_flatten_with_path(tree)[0]
    problems, collisions, names, arrays, tensors = [], [], {}, {}, []
    for (keypath, leaf), role in zip(flat, leaf_roles(tree)):
        path = tuple(key_of(e) for e in keypath)
        name = dotted(path)
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            problems.append(f"{jtu.keystr(keypath)} is a {type(leaf).__name__}")
            continue
        if name in names:
            collisions.append(f"{jtu.keystr(names[name])} and {jtu.keystr(keypath)}")
        names[name] = keypath
        impl = None
        if _is_key(leaf):
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
    user = dict(metadata or {})
    bad = [f"{k!r}: {v!r}" for k, v in user.items() if not _both_str(k, v)]
    if bad:
        raise TypeError(_NOT_STRINGS.format(problems=", ".join(bad)))
    taken = [key for key in user if key in RESERVED]
    if taken:
        raise ValueError(_RESERVED_KEY.format(keys=taken, reserved=RESERVED))
    fw = framework(tree)
    native = to_native(tree) if fw == "equinox" else None
    if isinstance(native, tuple):
        native = native[0]
    modules = tuple(
        (
            path,
            f"{cls.__module__}:{cls.__qualname__}",
            settings(_at(native, path)) if native is not None else {},
        )
        for path, node in walk(tree)
        if (cls := kind(node)) is not None
    )
    layout = LAYOUTS.get(fw or "", "")
    contents = Contents(Path(), "", fw, layout, VERSION, modules, user, tuple(tensors))
    return contents, arrays


def _both_str(key: Any, value: Any) -> bool:
    return isinstance(key, str) and isinstance(value, str)


def encode(contents: Contents) -> dict[str, str]:
    """The metadata strings written to the file."""
    tensors = {}
    for s in contents.tensors:
        entry: dict[str, Any] = dict(
            path=list(s.path), role=s.role, shape=list(s.shape), dtype=s.dtype
        )
        if s.prng_impl is not None:
            entry["prng_impl"] = s.prng_impl
        tensors[s.key] = entry
    return {
        **contents.metadata,
        "bridge_version": VERSION,
        "framework": contents.framework or "",
        "layout": contents.layout,
        "tensors": json.dumps(tensors),
        "modules": json.dumps([[list(p), c, f] for p, c, f in contents.modules]),
    }


def write(path: Path, contents: Contents, arrays: Mapping[str, Any]) -> None:
    """Write `arrays` (by dotted name; typed PRNG keys as their key data) with
    `contents`' metadata, atomically."""
    fmt = format_of(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(
            f"{path.parent}: no such directory to save {path.name} in."
        )
    if fmt != "orbax" and path.is_dir():
        raise IsADirectoryError(
            f"{path} is a directory: a {fmt} checkpoint is one file; pick a file name."
        )
    arrays = {k: jax.random.key_data(v) if _is_key(v) else v for k, v in arrays.items()}
    if fmt == "safetensors":
        host = {k: np.asarray(v) for k, v in arrays.items()}
        _safetensors.write(path, host, encode(contents))
    elif fmt == "msgpack":
        variables: dict[str, Any] = {}
        for s in contents.tensors:
            _put(variables, (s.role, *map(str, s.path)), np.asarray(arrays[s.key]))
        _msgpack.write(path, variables)
    else:
        nested: dict[str, Any] = {}
        for s in contents.tensors:
            _put(nested, tuple(map(str, s.path)), arrays[s.key])
        _orbax.write(path, nested, encode(contents))


def _put(nested: dict, keys: tuple[str, ...], value: Any) -> None:
    for key in keys[:-1]:
        nested = nested.setdefault(key, {})
    nested[keys[-1]] = value


def save(path: str | os.PathLike, obj: Any, *, metadata: dict | None = None) -> None:
    """Save a model of any framework as a checkpoint, atomically.

    The format follows the path: `*.safetensors` writes one safetensors file, keyed
    by the dotted neutral paths (`layers.0.kernel`), with the role, shape and dtype
    of every array, the source framework and its layout (`"flax"` or `"equinox"`),
    and the bridge version in the file's metadata, so any framework can read it.
    `*.msgpack` writes a flax msgpack file of Linen-style variables
    (`{role: {module: {name: array}}}`). Any other path is an orbax checkpoint
    directory (items `state`: the arrays as a nested dict with their shardings, and
    `bridge`: the metadata).

    Typed PRNG keys (NNX's `RngKey`) are stored as their key data, with the impl name
    in the metadata (safetensors, orbax), and come back as typed keys.

    The checkpoint is written under a temporary name in the same directory, flushed
    to disk, then renamed to `path`: a failure leaves any earlier checkpoint at
    `path` intact. An existing orbax directory is replaced only if it is a bridge
    checkpoint.

    **Arguments:**

    - `path`: where to write.
    - `obj`: a `bridge.Tree` or a native model (anything `bridge.to_neutral` takes).
    - `metadata`: optional `dict[str, str]` stored with the arrays (safetensors,
      orbax); `bridge inspect` shows it.

    **Returns:**

    Nothing.

    **Example:**

    ```python
    >>> import bridge, tempfile, os
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> path = os.path.join(tempfile.mkdtemp(), "linear.safetensors")
    >>> bridge.save(path, model, metadata={"step": "100"})
    >>> bridge.load(path).kernel.shape
    (2, 3)

    ```
    """
    contents, arrays = describe(to_neutral(obj), metadata)
    write(Path(path), contents, arrays)


# --- reading ------------------------------------------------------------------------


def open_checkpoint(path: str | os.PathLike) -> Contents:
    """Read what a checkpoint holds from its header (no array is read).

    Raises `FileNotFoundError` for a missing path and `ValueError` naming the file
    for a directory that is not a checkpoint or a truncated or corrupted file.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(_MISSING.format(path=path))
    fmt = "orbax" if path.is_dir() else format_of(path)
    if fmt == "orbax" and not (path.is_dir() and _orbax.is_checkpoint(path)):
        if path.is_dir():
            raise ValueError(
                _NOT_A_CHECKPOINT.format(
                    path=path, arrays=_orbax.ARRAYS, metadata=_orbax.METADATA
                )
            )
        raise ValueError(
            f"{path}: unknown checkpoint format '{path.suffix}': bridge reads "
            "*.safetensors and *.msgpack files and orbax checkpoint directories."
        )
    try:
        if fmt == "safetensors":
            meta, shapes = _safetensors.header(path)
            return _decode(path, fmt, meta, shapes)
        if fmt == "msgpack":
            return _msgpack_contents(path, _msgpack.read(path))
        return _decode(path, fmt, _orbax.header(path), None)
    except (ValueError, KeyError, TypeError, OSError, safetensors.SafetensorError) as e:
        raise ValueError(
            _UNREADABLE.format(path=path, format=fmt, reason=_reason(e))
        ) from e


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _split(name: str) -> TreePath:
    return tuple(int(k) if k.isdigit() else k for k in name.split("."))


def _decode(
    path: Path,
    fmt: str,
    meta: dict[str, str],
    shapes: dict[str, tuple[tuple[int, ...], str]] | None,
) -> Contents:
    if "bridge_version" not in meta:
        if shapes is None:
            raise ValueError("no bridge metadata")
        # a safetensors file from elsewhere: names are paths, every array a param
        tensors = tuple(
            Stored(name, _split(name), "params", shape, dtype)
            for name, (shape, dtype) in shapes.items()
        )
        return Contents(path, fmt, None, "", None, (), dict(meta), tensors)
    entries = json.loads(meta["tensors"])
    tensors = tuple(
        Stored(
            name,
            tuple(e["path"]),
            e["role"],
            tuple(e["shape"]),
            e["dtype"],
            e.get("prng_impl"),
        )
        for name, e in entries.items()
    )
    for s in tensors:  # raises for a dtype or a PRNG impl JAX does not know
        jnp.dtype(s.dtype)
        if s.prng_impl is not None:
            _key_info(s.prng_impl)
    if shapes is not None:
        described = {s.key: (s.shape, s.dtype) for s in tensors}
        if described != shapes:
            raise ValueError(
                "the metadata describes other arrays than the file holds ("
                + ", ".join(sorted(set(described).symmetric_difference(shapes)))
                + ")"
            )
    modules = tuple((tuple(p), c, f) for p, c, f in json.loads(meta["modules"]))
    user = {k: v for k, v in meta.items() if k not in RESERVED}
    fw = meta["framework"] or None
    version, layout = meta["bridge_version"], meta["layout"]
    return Contents(path, fmt, fw, layout, version, modules, user, tensors)


def _msgpack_contents(path: Path, variables: dict[str, Any]) -> Contents:
    tensors = []
    for keypath, leaf in jtu.tree_flatten_with_path(variables)[0]:
        role, *rest = (str(key_of(e)) for e in keypath)
        if not rest or not hasattr(leaf, "shape"):
            raise ValueError(
                f"{jtu.keystr(keypath)} is not an array inside a collection"
            )
        name = ".".join(rest)
        dtype = str(np.asarray(leaf).dtype)
        tensors.append(Stored(name, _split(name), role, np.shape(leaf), dtype))
    return Contents(path, "msgpack", None, "", None, (), {}, tuple(tensors))


def read(
    contents: Contents, shardings: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Every array of a checkpoint as a JAX array, by dotted name, one at a time
    (typed PRNG keys re-wrapped). `shardings` places arrays (by name)."""
    shardings = shardings or {}
    by_name = {s.key: s for s in contents.tensors}
    try:
        raw = _read_raw(contents, shardings)
        out = {}
        for name, array in raw:
            impl, sharding = by_name[name].prng_impl, shardings.get(name)
            if isinstance(array, np.ndarray):
                # a view of the file's memory map: copied once, into memory JAX owns
                where = sharding if impl is None else None
                array = jax.device_put(array, where, may_alias=False)
            if impl is not None:
                array = jax.random.wrap_key_data(array, impl=impl)
            if sharding is not None and array.sharding != sharding:
                array = jax.device_put(array, sharding)
            out[name] = array
        return out
    except (ValueError, KeyError, TypeError, OSError, safetensors.SafetensorError) as e:
        raise ValueError(
            _UNREADABLE.format(
                path=contents.path, format=contents.format, reason=_reason(e)
            )
        ) from e


def _read_raw(contents: Contents, shardings: Mapping[str, Any]):
    names = [s.key for s in contents.tensors]
    if contents.format == "safetensors":
        return _safetensors.read(contents.path, names)
    if contents.format == "msgpack":
        variables = _msgpack.read(contents.path)
        return [
            (s.key, _get(variables, (s.role, *s.key.split("."))))
            for s in contents.tensors
        ]
    abstract: dict[str, Any] | None = None  # None: each array's saved sharding
    if shardings:
        abstract = {}
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        for s in contents.tensors:
            sharding = shardings.get(s.key) if s.prng_impl is None else None
            spec = jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding or default)
            _put(abstract, tuple(map(str, s.path)), spec)
    restored = _orbax.read(contents.path, abstract)
    return [(s.key, _get(restored, tuple(map(str, s.path)))) for s in contents.tensors]


def _get(nested: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        nested = nested[key]
    return nested


def _resolve(name: str) -> type | None:
    """The class named `module:qualname` if its module is already imported (nothing is
    imported or executed on load)."""
    module, _, qualname = name.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def _at(obj: Any, path: TreePath) -> Any:
    for key in path:
        obj = obj[key] if isinstance(key, int) else getattr(obj, key)
    return obj


def file_tree(contents: Contents, arrays: Mapping[str, Any]) -> Tree:
    """The Tree of a checkpoint's arrays, with their roles.

    From an Equinox file: a Tree of kind `equinox` whose native model is a
    skeleton (`bridge._adapters._skeleton`), with each module's class as its kind
    where that class is already imported. From any other file: the Tree of
    Linen-style variables (`{role: {module: {name: array}}}`, Flax's layout), so
    `bridge.to_native` gives that dict.
    """
    kinds = {p: cls for p, c, _ in contents.modules if (cls := _resolve(c))}
    if contents.framework == "equinox":
        paths = [s.path for s in contents.tensors]
        model_def, position = skeleton(
            paths, {p: (c, f) for p, c, f in contents.modules}
        )
        entries = [
            (s.path, s.role, arrays[s.key], position[s.path]) for s in contents.tensors
        ]
        slots = tuple(range(len(paths)))
        return build(entries, kinds, "equinox", (model_def, (), slots, None))
    variables: dict[str, Any] = {}
    for s in contents.tensors:
        node = variables.setdefault(s.role, {})
        for key in s.path[:-1]:
            node = node.setdefault(key, {})
        node[s.path[-1]] = arrays[s.key]
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
    return build(entries, kinds, "linen", src.record)


def _problems(contents: Contents, target: Tree) -> list[str]:
    """Every missing, unexpected, shape and dtype problem of filling `target` from the
    file."""
    stored = {s.key: s for s in contents.tensors}
    flat = jtu.tree_flatten_with_path(target)[0]
    problems = []
    for keypath, leaf in flat:
        name = dotted(tuple(key_of(e) for e in keypath))
        where = jtu.keystr(keypath)
        if name not in stored:
            problems.append(f"  missing {where} (no '{name}' in the file)")
            continue
        shape, dtype = stored.pop(name).logical
        if shape != tuple(np.shape(leaf)):
            problems.append(
                f"  {where}: shape {shape} in the file, {np.shape(leaf)} in `like`"
            )
        if dtype != str(leaf.dtype):
            problems.append(
                f"  {where}: dtype {dtype} in the file, {leaf.dtype} in `like`"
            )
    problems += [
        f"  unexpected '{name}' in the file (not in `like`)" for name in stored
    ]
    return problems


def _fill(contents: Contents, target: Tree) -> Tree:
    """`target` with every leaf read from the checkpoint, with `target`'s shardings."""
    shardings = {}
    for keypath, leaf in jtu.tree_flatten_with_path(target)[0]:
        if isinstance(leaf, jax.Array):
            shardings[dotted(tuple(key_of(e) for e in keypath))] = leaf.sharding
    arrays = read(contents, shardings)
    return jtu.tree_map_with_path(
        lambda p, _: arrays[dotted(tuple(key_of(e) for e in p))], target
    )


def _like(like: Any, tree: Tree) -> Any:
    """`tree` as the same kind of object as `like`."""
    if isinstance(like, Tree):
        return tree
    fw = framework(tree)
    if fw == "nnx":
        return to_nnx(tree)
    if fw == "equinox":
        return to_equinox(tree)
    if isinstance(like, nn.Module):
        return bind(tree)
    if isinstance(like, tuple):
        return like[0], to_linen(tree)
    return to_linen(tree)


def load(path: str | os.PathLike, like: Any = None) -> Any:
    """Load a checkpoint written by `bridge.save` (or any safetensors file).

    Arrays are read one at a time (safetensors through its memory map), so memory
    stays near one copy of the model. Nothing in the file is executed: safetensors,
    msgpack and orbax's formats hold data only, and module classes recorded in the
    metadata are looked up only among modules already imported.

    **Arguments:**

    - `path`: a `*.safetensors` or `*.msgpack` file, or an orbax checkpoint directory.
    - `like`: optional, the model to fill: a `bridge.Tree` or a native model of any
      framework (anything `bridge.to_neutral` takes). Its arrays' shardings are kept.
      When the file has exactly `like`'s arrays (same dotted paths, shapes, dtypes)
      they are read straight into it; when it was saved from another framework, its
      arrays go through `bridge.port` (layers paired by kind, shape and order,
      layouts converted).

    **Returns:**

    Without `like`: a `bridge.Tree` of the file's arrays, with their roles (typed
    PRNG keys restored, sharded arrays with their saved sharding under orbax). From
    a Flax (Linen or NNX) file or any other safetensors file it is the Tree of
    Linen-style variables (`bridge.to_native` gives `{role: {module: {name:
    array}}}`); from an Equinox file, its native model is an inert skeleton holding
    the arrays and each module's recorded settings (enough for `bridge.port`, not
    callable). With `like`: the same kind of object as `like` (a Tree, an NNX
    module, an Equinox model or `(model, state)`, Linen variables, `(module,
    variables)` or a bound module), filled from the file.

    **Raises:**

    `FileNotFoundError` for a missing path; `ValueError` naming the file for a
    directory that is not a checkpoint or a truncated or corrupted file; `ValueError`
    listing every missing, unexpected, shape and dtype problem when a file of
    `like`'s own framework does not fit it; `bridge.PortError` listing every problem
    when a file of another framework cannot be ported into it.

    **Example:**

    ```python
    >>> import bridge, tempfile, os
    >>> from flax import nnx
    >>> path = os.path.join(tempfile.mkdtemp(), "linear.safetensors")
    >>> bridge.save(path, nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> model = bridge.load(path, like=nnx.Linear(2, 3, rngs=nnx.Rngs(1)))
    >>> type(model).__name__
    'Linear'

    ```
    """
    contents = open_checkpoint(path)
    if like is None:
        return file_tree(contents, read(contents))
    target = to_neutral(like)
    problems = _problems(contents, target)
    if not problems:
        return _like(like, _fill(contents, target))
    if contents.framework != framework(target):
        source = file_tree(contents, read(contents))
        try:
            return port(source, like)
        except PortError as error:
            error.add_note(_PORTING.format(path=contents.path))
            raise
    raise ValueError(_MISMATCH.format(path=contents.path, problems="\n".join(problems)))
