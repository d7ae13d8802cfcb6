"""The flax msgpack format (`flax.serialization`): nested dicts of arrays, no metadata.

bridge writes it as Linen variables, `{collection: {module: {name: array}}}`, so the
collections keep each array's role and `flax.serialization.from_bytes(variables, ...)`
or `msgpack_restore` reads it directly. Dicts keep their order both ways: the file
holds the model's creation order (as `flax.serialization.to_bytes` of Linen params
does) and reading it gives that order back, never a sorted one.

The file is read once, whole (a msgpack file has no index), and decoded by bridge's
own hook for flax's array extension: shapes, dtype names and byte counts are checked
and nothing but plain data and arrays is built.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import msgpack
import numpy as np
from flax import serialization

from .._paths import MAX_DEPTH, is_index
from ._atomic import atomic_file
from ._contents import DTYPE_NAMES, Contents, Malformed, Stored, dotted
from ._errors import unreadable
from ._files import open_regular, read_whole
from ._format import Format, register_format


NAME = "msgpack"
_ARRAY, _SCALAR = 1, 3  # flax's msgpack extension codes (`_MsgpackExtType`)
_CHUNKED = "__msgpack_chunked_array__"  # flax's form of an array over 1 GiB


def save(path: Path, contents: Contents, arrays: Mapping[str, Any]) -> None:
    """Write the arrays as Linen variables `{role: {module: ... {name: array}}}`, in
    `contents`' order, atomically."""
    variables: dict[str, Any] = {}
    for s in contents.tensors:
        node = variables.setdefault(s.role, {})
        for key in map(str, s.path[:-1]):
            node = node.setdefault(key, {})
        node[str(s.path[-1])] = np.asarray(arrays[s.key])
    for role, keys in contents.empty:
        node = variables.setdefault(role, {})
        for key in map(str, keys):
            node = node.setdefault(key, {})
    # in_place: flax copies the tree with jax.tree.map otherwise, which sorts keys
    data = serialization.msgpack_serialize(variables, in_place=True)
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def _array(data: bytes) -> np.ndarray:
    """flax's array extension: msgpack `(shape, dtype name, C-order bytes)`."""
    parts = msgpack.unpackb(data, raw=True, max_array_len=MAX_DEPTH)
    if not (isinstance(parts, list) and len(parts) == 3):
        raise Malformed("an array entry is not (shape, dtype, bytes)")
    shape, name, buffer = parts
    if not (
        isinstance(shape, list)
        and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
        )
    ):
        raise Malformed(f"an array has shape {shape!r}")
    dtype = name.decode("ascii", "replace") if isinstance(name, bytes) else None
    if dtype not in DTYPE_NAMES:
        raise Malformed(f"an array has dtype {name!r}, which bridge does not read")
    if not isinstance(buffer, bytes):
        raise Malformed("an array's data is not bytes")
    nbytes = math.prod(shape) * jnp.dtype(dtype).itemsize
    if nbytes != len(buffer):
        raise Malformed(
            f"a {dtype} array of shape {tuple(shape)} needs {nbytes} bytes, "
            f"the file holds {len(buffer)}"
        )
    return np.frombuffer(buffer, jnp.dtype(dtype)).reshape(shape)


def _extension(code: int, data: bytes) -> Any:
    if code in (_ARRAY, _SCALAR):
        return _array(data)
    raise Malformed(f"it holds a msgpack extension of type {code}, not an array")


def _unchunk(node: dict, where: str) -> np.ndarray:
    shape, chunks = node.get("shape"), node.get("chunks")
    if not (isinstance(shape, dict) and isinstance(chunks, dict)):
        raise Malformed(f"{where}: a chunked array without shape or chunks")
    dims: list[Any] = [shape.get(str(i)) for i in range(len(shape))]
    pieces: list[Any] = [chunks.get(str(i)) for i in range(len(chunks))]
    if not all(isinstance(d, int) and d >= 0 for d in dims) or not all(
        isinstance(p, np.ndarray) and p.ndim == 1 for p in pieces
    ):
        raise Malformed(f"{where}: a malformed chunked array")
    if len({p.dtype for p in pieces}) > 1 or sum(p.size for p in pieces) != math.prod(
        dims
    ):
        raise Malformed(f"{where}: chunks that do not make an array of shape {dims}")
    flat = np.concatenate(pieces) if pieces else np.empty(0)
    return flat.reshape(dims)


def _keys(node: dict) -> list[str | int]:
    """A dict's keys as path keys: all indices when every key is one (an `nnx.List`,
    a Linen list of layers), else all names (as `Contents` reads dotted names)."""
    for key in node:
        if not (isinstance(key, str) and key):
            raise Malformed(f"a dict key {str(repr(key))[:60]} is not a name")
    if node and all(map(is_index, node)):
        return [int(k) for k in node]
    return list(node)


def _arrays(
    variables: Any,
) -> Iterator[tuple[tuple[str | int, ...], np.ndarray | None]]:
    """Every `(path, array)` of the nested dicts, in the file's order, and
    `(path, None)` for each empty dict."""
    if not isinstance(variables, dict):
        raise Malformed(f"it holds a {type(variables).__name__}, not a dict of arrays")
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), variables)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict) and _CHUNKED in node:
            node = _unchunk(node, dotted(path))
        if isinstance(node, np.ndarray):
            yield path, node
        elif isinstance(node, dict):
            if not node and path:
                yield path, None
            children = [(path + (k,), v) for k, v in zip(_keys(node), node.values())]
            stack.extend(reversed(children))
        else:
            where = dotted(path) or "the top level"
            raise Malformed(f"{where} holds a {type(node).__name__}, not an array")


def _contents(path: Path, variables: Any) -> Contents:
    tensors, arrays, empty = [], {}, []
    for keys, array in _arrays(variables):
        if array is None and isinstance(keys[0], str):
            empty.append((keys[0], keys[1:]))
            continue
        if array is None or len(keys) < 2 or not isinstance(keys[0], str):
            where = dotted(keys) or "the top level"
            raise Malformed(f"{where} is an array outside a collection")
        role, rest = keys[0], keys[1:]
        name = dotted(rest)
        if name in arrays:
            raise Malformed(f"two arrays of collection {role!r} are named {name!r}")
        arrays[name] = array
        tensors.append(Stored(name, rest, role, array.shape, str(array.dtype)))
    return Contents(
        path, NAME, None, "", None, (), {}, tuple(tensors), arrays, empty=tuple(empty)
    )


def metadata(path: Path) -> Contents:
    """The `Contents` of the file: it is read and decoded whole (msgpack has no
    header); the arrays wait in `Contents.source`."""
    fd = open_regular(path, NAME)
    data = b""
    try:
        data = read_whole(fd, path, NAME)
        variables = msgpack.unpackb(
            data, ext_hook=_extension, raw=False, strict_map_key=False
        )
        return _contents(path, variables)
    except (Malformed, EOFError) as e:
        raise unreadable(path, NAME, str(e), data[:200]) from None
    except (msgpack.UnpackException, ValueError) as e:  # msgpack's decoding errors
        reason = "nested too deeply" if isinstance(e, msgpack.StackError) else str(e)
        reason = f"not msgpack ({reason or type(e).__name__})"
        raise unreadable(path, NAME, reason, data[:200]) from None
    finally:
        os.close(fd)


def restore(
    contents: Contents, shardings: Mapping[str, Any]
) -> Iterator[tuple[str, np.ndarray]]:
    """Each array, decoded when the file was opened."""
    arrays: dict[str, np.ndarray] = contents.source
    for s in contents.tensors:
        yield s.key, arrays[s.key]


FORMAT = register_format(
    Format(
        NAME,
        (".msgpack",),
        "*.msgpack: a flax msgpack file of Linen variables ({role: {module: ...}})",
        save,
        metadata,
        restore,
        DTYPE_NAMES,
        training=False,
        order=False,
    )
)
