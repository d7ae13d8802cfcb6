"""What a checkpoint holds (`Contents`, one `Stored` per array) and the metadata strings
it is written with; shared by every format.

The metadata is a `dict[str, str]`: the user's own keys, and `bridge_version`,
`framework`, `layout`, `tensors` (JSON: each array's path, role, shape, dtype and, for
a typed PRNG key, its impl), `modules` (JSON: each module's path, class and
settings) and, where the model was saved with example inputs, `order` (JSON: the
arrays' names in the order the model's forward pass first uses them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp

from .._adapters._registry import plain_reader
from .._paths import MAX_DEPTH, Path as TreePath, is_index, parse
from .._shown import shown
from .._version import VERSION


RESERVED = (
    "bridge_version",
    "framework",
    "layout",
    "tensors",
    "modules",
    "training",
    "empty",
    "order",
)


@dataclasses.dataclass(frozen=True)
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
        data_shape, dtype = key_info(self.prng_impl)
        return self.shape[: len(self.shape) - len(data_shape)], dtype


@dataclasses.dataclass(frozen=True)
class Contents:
    """What a checkpoint holds, read from its header only (no array is read).

    `source` is what the format opened to read the header (for a file, its open
    handle), so that the arrays come from the very file the header came from; it is
    closed by `close()` (or when the `Contents` is garbage collected).
    """

    path: Path
    format: str  # a registered format's name: "safetensors", "orbax", "msgpack"
    framework: str | None  # None: not written by bridge, or converted
    layout: str  # "flax", "equinox", "torch" or "" (unknown)
    version: str | None
    modules: tuple[tuple[TreePath, str, dict[str, Any]], ...]  # class, settings
    metadata: dict[str, str]  # the user's own
    tensors: tuple[Stored, ...]
    source: Any = dataclasses.field(default=None, compare=False, repr=False)
    training: str = ""  # JSON: a training checkpoint's optimizer state, step, extras
    # the model's empty mappings, which hold no array: `(role, path)`, e.g.
    # `("params", ("a",))` for Linen's `{"params": {"a": {}}}`
    empty: tuple[tuple[str, TreePath], ...] = ()
    # the arrays' names in the order the model's forward pass first uses them
    # (`save(..., example=...)`); empty where no order was recorded
    order: tuple[str, ...] = ()

    def close(self) -> None:
        """Close what the format opened (nothing is read after this)."""
        close = getattr(self.source, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Contents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@functools.cache
def key_info(impl: str) -> tuple[tuple[int, ...], str]:
    """`(key data shape, dtype name)` of one key of the PRNG impl named `impl`."""
    key = jax.random.key(0, impl=impl)
    return jax.random.key_data(key).shape, str(key.dtype)


def is_key(x: Any) -> bool:
    """Whether `x` is a typed PRNG key array (stored as its key data)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def dotted(path: TreePath) -> str:
    """`('layers', 0, 'kernel')` -> `'layers.0.kernel'`."""
    return ".".join(map(str, path))


def split(name: str) -> TreePath:
    """`'layers.0.kernel'` -> `('layers', 0, 'kernel')` (digits become indices)."""
    return parse(name)


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
        **{k: v for k, v in contents.metadata.items() if k not in RESERVED},
        "bridge_version": VERSION,
        "framework": contents.framework or "",
        "layout": contents.layout,
        "tensors": json.dumps(tensors),
        "modules": json.dumps([[list(p), c, f] for p, c, f in contents.modules]),
        **({"training": contents.training} if contents.training else {}),
        **(
            {"empty": json.dumps([[r, list(p)] for r, p in contents.empty])}
            if contents.empty
            else {}
        ),
        **({"order": json.dumps(list(contents.order))} if contents.order else {}),
    }


class Malformed(Exception):
    """Raised by `decode` with the reason a header cannot be read (the format
    turns it into a `CheckpointError` naming the file)."""


# every dtype name a stored array may have (`str(dtype)` of a JAX or NumPy array)
DTYPE_NAMES = frozenset(
    "bool int2 int4 int8 int16 int32 int64 uint2 uint4 uint8 uint16 uint32 uint64 "
    "float16 bfloat16 float32 float64 complex64 complex128 float4_e2m1fn "
    "float8_e3m4 float8_e4m3 float8_e4m3b11fnuz float8_e4m3fn float8_e4m3fnuz "
    "float8_e5m2 float8_e5m2fnuz float8_e8m0fnu".split()
)


def _json(meta: Mapping[str, str], key: str) -> Any:
    text = meta.get(key)
    if not isinstance(text, str):
        raise Malformed(f"its bridge metadata has no {key!r} string")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else e.msg
        raise Malformed(f"its {key!r} metadata is not JSON ({reason})") from None


def _is_path(value: Any) -> bool:
    return (
        isinstance(value, list)
        and 0 < len(value) <= MAX_DEPTH
        and all(
            (isinstance(k, str) and k != "")
            or (isinstance(k, int) and not isinstance(k, bool) and k >= 0)
            for k in value
        )
    )


def plain_name(name: str) -> bool:
    """Whether a file without bridge metadata may name an array `name`: dotted
    names, none empty, at most `MAX_DEPTH` of them (`decode` reads no other)."""
    return _is_path(name.split("."))


def unreadable(contents: Contents) -> list[str]:
    """What `decode` would refuse in the metadata of `contents` (the checks a save
    makes before writing, so that what `save` writes `load` reads): each array's
    and each empty mapping's role and path, as `'params' ['a', '']`."""
    where = [(s.role, s.path) for s in contents.tensors]
    where += [(role, path) for role, path in contents.empty if path]
    return [
        f"{shown(role)} {shown(list(path))}"
        for role, path in where
        if not (isinstance(role, str) and role and _is_path(list(path)))
    ]


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def _known_impl(impl: str) -> bool:
    try:
        key_info(impl)
    except (ValueError, TypeError, KeyError):  # jax's PRNG registry lookup
        return False
    return True


def _stored(name: str, entry: Any) -> Stored:
    """One `tensors` entry, checked."""
    fields = ("path", "role", "shape", "dtype")
    if not (isinstance(entry, dict) and all(f in entry for f in fields)):
        raise Malformed(f"tensor {name!r}: its entry lacks one of {fields}")
    path, role, shape, dtype = (entry[f] for f in fields)
    impl = entry.get("prng_impl")
    if not _is_path(path):
        raise Malformed(
            f"tensor {name!r}: path {shown(path)} is not a list of 1 to {MAX_DEPTH} "
            "names and indices"
        )
    if not (isinstance(role, str) and role):
        raise Malformed(f"tensor {name!r}: role {shown(role)} is not a name")
    if not _is_shape(shape):
        raise Malformed(f"tensor {name!r}: shape {shown(shape)} is not a shape")
    if not (isinstance(dtype, str) and dtype in DTYPE_NAMES):
        raise Malformed(f"tensor {name!r}: unknown dtype {shown(dtype)}")
    if impl is not None and not (isinstance(impl, str) and _known_impl(impl)):
        raise Malformed(f"tensor {name!r}: unknown PRNG impl {shown(impl)}")
    if impl is not None:
        data_shape, _ = key_info(impl)
        if len(shape) < len(data_shape) or (
            tuple(shape[len(shape) - len(data_shape) :]) != data_shape
        ):
            raise Malformed(
                f"tensor {name!r}: shape {tuple(shape)} is not of {impl} key data "
                f"(trailing {data_shape})"
            )
    return Stored(name, tuple(path), role, tuple(shape), dtype, impl)


def _plain_paths(names: list[str]) -> dict[str, TreePath]:
    """The paths of a file's dotted names (a file bridge did not write): a name's
    segments become indices where every sibling is a plain number (`layers.0`,
    `layers.1`), names otherwise (`l.0` next to `l.x` stays `'0'`)."""
    split_names = {}
    for name in names:
        if not plain_name(name):
            raise Malformed(
                f"tensor name {shown(name)} is not a dotted path (empty segments, or "
                f"over {MAX_DEPTH} of them)"
            )
        split_names[name] = tuple(name.split("."))
    children: dict[tuple[str, ...], set[str]] = {}
    for parts in split_names.values():
        for n in range(len(parts)):
            children.setdefault(parts[:n], set()).add(parts[n])
    numbered = {
        parent for parent, keys in children.items() if all(is_index(k) for k in keys)
    }
    return {
        name: tuple(int(k) if parts[:n] in numbered else k for n, k in enumerate(parts))
        for name, parts in split_names.items()
    }


def _check_paths(tensors: tuple[Stored, ...]) -> None:
    """No two arrays at one path, no array at a path inside another's, and no node
    whose children mix indices and names (they could not be ordered)."""
    kinds: dict[TreePath, type] = {}
    for s in tensors:
        for n, key in enumerate(s.path):
            if kinds.setdefault(s.path[:n], type(key)) is not type(key):
                raise Malformed(
                    f"tensor {s.key!r}: the children of {s.path[:n]} mix indices "
                    "and names"
                )
    seen: dict[TreePath, str] = {}
    for s in tensors:
        if s.path in seen:
            raise Malformed(
                f"tensors {seen[s.path]!r} and {s.key!r} both claim path {s.path}"
            )
        seen[s.path] = s.key
    for s in tensors:
        for n in range(1, len(s.path)):
            if s.path[:n] in seen:
                raise Malformed(
                    f"tensor {s.key!r} is inside tensor {seen[s.path[:n]]!r} "
                    f"(path {s.path} below {s.path[:n]})"
                )


def _empty(
    entries: Any, tensors: tuple[Stored, ...]
) -> tuple[tuple[str, TreePath], ...]:
    """The `empty` metadata, checked: `[[role, path], ...]`, each an empty mapping, so
    neither an array's path nor around or inside one of the same role."""
    if not isinstance(entries, list):
        raise Malformed(f"its 'empty' metadata is a {type(entries).__name__}")
    out = []
    for entry in entries:
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and isinstance(entry[0], str)
            and entry[0]
            and (entry[1] == [] or _is_path(entry[1]))
        ):
            raise Malformed(f"an 'empty' entry {shown(entry)} is not [role, path]")
        out.append((entry[0], tuple(entry[1])))
    if not out:
        return ()
    around = {(s.role, s.path[:n]): s.key for s in tensors for n in range(len(s.path))}
    arrays = {(s.role, s.path): s.key for s in tensors}
    for role, path in out:
        inside = (arrays.get((role, path[:n])) for n in range(len(path) + 1))
        key = around.get((role, path)) or next(filter(None, inside), None)
        if key is not None:
            raise Malformed(
                f"the empty mapping {role}:{shown(list(path))} holds or is tensor "
                f"{key!r}, or is inside it"
            )
    return tuple(out)


def _plain_order(meta: Mapping[str, str], tensors: tuple[Stored, ...]) -> tuple:
    """The order of use a plain file records (`bridge convert` writes it into a
    Hugging Face folder's files beside `"format": "pt"`), of its own arrays (a
    shard's part of its folder's); none where its `order` is not such a record
    (another library's key: it stays in the metadata, as every key does)."""
    try:
        names = _json(meta, "order") if "order" in meta else None
    except Malformed:
        return ()
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return ()
    if len(set(names)) != len(names):
        return ()
    held = {s.key for s in tensors}
    return tuple(n for n in names if n in held)


def _order(names: Any, tensors: tuple[Stored, ...]) -> tuple[str, ...]:
    """The `order` metadata, checked: the names of stored arrays, each once."""
    if not isinstance(names, list):
        raise Malformed(f"its 'order' metadata is a {type(names).__name__}")
    stored = {s.key for s in tensors}
    unknown = [n for n in names if not isinstance(n, str) or n not in stored]
    if unknown:
        raise Malformed(
            f"its 'order' metadata names {shown(unknown[0])}, no array of the file"
        )
    if len(set(names)) != len(names):
        raise Malformed("its 'order' metadata names an array twice")
    return tuple(names)


def _module(entry: Any) -> tuple[TreePath, str, dict[str, Any]]:
    if not (
        isinstance(entry, list)
        and len(entry) == 3
        and (entry[0] == [] or _is_path(entry[0]))
        and isinstance(entry[1], str)
        and isinstance(entry[2], dict)
    ):
        raise Malformed(
            f"a 'modules' entry {shown(entry)} is not [path, 'module:Class', "
            "{settings}]"
        )
    return tuple(entry[0]), entry[1], entry[2]


def _plain_reader(
    meta: Mapping[str, str], shapes: Mapping[str, tuple[tuple[int, ...], str]]
) -> tuple[str | None, str, Callable[[str], str]]:
    """`(framework, layout, role of a name)` of a file without bridge metadata: the
    adapter whose layout it is in says (a PyTorch state dict), else unknown and every
    array `params`."""
    adapter = plain_reader(meta, shapes)
    if adapter is None:
        return None, "", lambda name: "params"
    return adapter.name, adapter.layout, adapter.role_of or (lambda name: "params")


def decode(
    path: Path,
    fmt: str,
    meta: Mapping[str, str],
    shapes: Mapping[str, tuple[tuple[int, ...], str]] | None,
    source: Any = None,
) -> Contents:
    """The `Contents` of a file whose metadata strings are `meta` and which holds the
    arrays `shapes` (`{name: (shape, dtype name)}`; None when the format does not say).

    A file without bridge metadata (a safetensors file from elsewhere) holds params
    named by their dotted paths. Every field is checked (types, known dtypes and PRNG
    impls, one array per path); raises `Malformed` with the first problem.
    """
    if "bridge_version" not in meta:
        if shapes is None:
            raise Malformed("no bridge metadata")
        paths = _plain_paths(list(shapes))
        fw, layout, role = _plain_reader(meta, shapes)
        tensors = tuple(
            Stored(name, paths[name], role(name), shape, dtype)
            for name, (shape, dtype) in shapes.items()
        )
        _check_paths(tensors)
        order = _plain_order(meta, tensors)
        return Contents(
            path, fmt, fw, layout, None, (), dict(meta), tensors, source, order=order
        )
    entries = _json(meta, "tensors")
    if not isinstance(entries, dict):
        raise Malformed(f"its 'tensors' metadata is a {type(entries).__name__}")
    tensors = tuple(_stored(name, e) for name, e in entries.items())
    _check_paths(tensors)
    if shapes is not None:
        described = {s.key: (s.shape, s.dtype) for s in tensors}
        differ = sorted(
            k for k in set(described) | set(shapes) if described.get(k) != shapes.get(k)
        )
        if differ:
            raise Malformed(
                "the metadata describes other arrays than the file holds ("
                + ", ".join(map(repr, differ[:5]))
                + ")"
            )
    modules = _json(meta, "modules")
    if not isinstance(modules, list):
        raise Malformed(f"its 'modules' metadata is a {type(modules).__name__}")
    user = {k: v for k, v in meta.items() if k not in RESERVED}
    fw, version, layout = (
        meta.get(k) for k in ("framework", "bridge_version", "layout")
    )
    if not all(isinstance(v, str) for v in (fw, version, layout)):
        raise Malformed("its framework, layout or bridge_version is not a string")
    training = meta.get("training", "")
    if not isinstance(training, str):
        raise Malformed("its 'training' metadata is not a string")
    empty = _empty(_json(meta, "empty") if "empty" in meta else [], tensors)
    order = _order(_json(meta, "order") if "order" in meta else [], tensors)
    return Contents(
        path,
        fmt,
        fw or None,
        cast(str, layout),
        version,
        tuple(map(_module, modules)),
        user,
        tensors,
        source,
        training,
        empty,
        order,
    )
