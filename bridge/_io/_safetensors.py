"""The safetensors format: one file, flat name -> array, plus string metadata.

The header is read and checked from one handle (every dtype known, every byte count
matching its shape, the arrays tiling the data exactly), and each array is then read
one at a time from the same file (`_files.Files`: kept open while reads use it, its
identity checked before and after each read), so a file replaced (`os.replace`, what
`bridge.save` does) or rewritten in place while it is loaded is an error naming it,
never mixed with its successor. Reads are plain `pread`s of the declared sizes: no
memory map (a file truncated in place cannot kill the process), never more than the
file holds.

Every dtype safetensors stores is supported, including `complex64`, the 8-bit floats
and `float4_e2m1fn` (stored packed, two per byte, the first in the low nibble).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from .._lazy import LazyArray
from .._progress import advance
from .._shown import shown
from ._atomic import atomic_file
from ._contents import Contents, Malformed, decode, encode
from ._errors import unreadable
from ._files import Files, identity, open_regular, read_at, read_into, size
from ._format import Format, register_format


NAME = "safetensors"
_SUFFIX = ".safetensors"

# safetensors' dtype codes -> JAX/NumPy dtype names: every dtype safetensors stores
DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn",
}
_CODES = {name: code for code, name in DTYPES.items()}
_PACKED = {"F4": 2}  # elements per byte, for the dtypes stored packed

_HEADER_LIMIT = 100_000_000  # bytes, as safetensors' own reader

_UNKNOWN_DTYPE = """\
tensor {name!r} has dtype code {code}, which is not a safetensors dtype (known: \
{known})"""

_ODD_F4 = """\
{names}: float4_e2m1fn arrays are stored packed two per byte in safetensors, so they \
need an even number of elements; these have an odd number. Pad them, or save to an \
orbax checkpoint (a directory path)"""


MAX_NDIM = 64  # NumPy's (and so JAX's on the host)


def shape_problem(shape: tuple[int, ...], itemsize: int) -> str | None:
    """Why no array can have `shape` (of `itemsize`-byte elements), even an empty
    one: over `MAX_NDIM` dimensions, or dimensions whose product, zeros left out,
    is more bytes than an address space holds (NumPy refuses both with a raw
    `ValueError`)."""
    if len(shape) > MAX_NDIM:
        return f"has {len(shape)} dimensions; arrays have at most {MAX_NDIM}"
    if math.prod(d for d in shape if d) * itemsize >= 1 << 63:
        return f"has shape {str(shape)[:100]}: no array, even an empty one, is that big"
    return None


def _nbytes(code: str, shape: tuple[int, ...]) -> int | None:
    """Bytes of an array of `code` and `shape`, None when a packed dtype cannot
    hold that many elements."""
    count = math.prod(shape)
    per_byte = _PACKED.get(code)
    if per_byte is None:
        return count * jnp.dtype(DTYPES[code]).itemsize
    return None if count % per_byte else count // per_byte


def _to_bytes(array: np.ndarray) -> np.ndarray:
    """The bytes stored for `array`: little-endian, C order, packed when its dtype is
    packed."""
    array = np.require(array, requirements="C")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if _CODES[str(array.dtype)] == "F4":
        codes = array.reshape(-1).view(np.uint8) & 0x0F
        return codes[0::2] | (codes[1::2] << 4)
    return array.reshape(-1).view(np.uint8)


def _from_bytes(data: np.ndarray, code: str, shape: tuple[int, ...]) -> np.ndarray:
    if code == "F4":
        codes = np.empty(data.size * 2, np.uint8)
        codes[0::2], codes[1::2] = data & 0x0F, data >> 4
        data = codes
    return data.view(jnp.dtype(DTYPES[code])).reshape(shape)


def save(path: Path, contents: Contents, arrays: Mapping[str, Any]) -> None:
    """Write `arrays` in `contents`' order with its metadata, atomically. The header
    lists the arrays in that order (safetensors' readers take any order)."""
    save_plain(path, contents, arrays, encode(contents))


def save_plain(
    path: Path, contents: Contents, arrays: Mapping[str, Any], meta: dict[str, str]
) -> None:
    """`save` with `meta` as the file's whole metadata (no bridge keys: a file as
    another library writes it)."""
    host = {s.key: np.asarray(arrays[s.key]) for s in contents.tensors}
    with atomic_file(path) as tmp:
        write_file(tmp, host, meta)


def write_file(
    path: Path, arrays: Mapping[str, np.ndarray], meta: dict[str, str]
) -> None:
    """Write `arrays` (host arrays, in order) and `meta` as the safetensors file
    `path`, in place: for a writer that made `path` a temporary already (a folder
    written whole, `_atomic.atomic_dir`). A failed write raises `OSError` (a full
    disk: `ENOSPC`, `EFBIG`), as every write of bridge's does."""
    odd = [k for k, v in arrays.items() if _CODES[str(v.dtype)] == "F4" and v.size % 2]
    if odd:
        raise ValueError(_ODD_F4.format(names=", ".join(odd)) + ".")
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, array in arrays.items():
        code = _CODES[str(array.dtype)]
        end = offset + (_nbytes(code, array.shape) or 0)
        header[name] = {
            "dtype": code,
            "shape": list(array.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for array in arrays.values():
            f.write(_to_bytes(array).data)
            advance(array.nbytes)


class Entry(NamedTuple):
    code: str
    shape: tuple[int, ...]
    begin: int
    end: int


class Source(NamedTuple):
    """The file a header was read from: `files` holds it (as `key`), `start` is
    where the data starts, `entries` each array's. `owner`: closing this source
    closes `files` (False for a shard: its checkpoint's `files` hold every shard)."""

    files: Files
    key: int
    start: int
    entries: dict[str, Entry]
    owner: bool

    def close(self) -> None:
        if self.owner:
            self.files.close()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        keys = [k for k, _ in pairs]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        raise Malformed(f"the header names {twice[:5]} more than once")
    return out


def _entries(header: Any, data_size: int) -> dict[str, Entry]:
    """Every array's entry, checked: known dtype, non-negative shape, a byte range
    that matches the shape, and ranges tiling the data exactly."""
    if not isinstance(header, dict):
        raise Malformed(f"the header is a JSON {type(header).__name__}, not an object")
    entries = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(e, dict) and {"dtype", "shape", "data_offsets"} <= set(e)):
            raise Malformed(f"tensor {name!r} lacks dtype, shape or data_offsets")
        code, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(code, str) or code not in DTYPES:  # a list: unhashable
            raise Malformed(
                _UNKNOWN_DTYPE.format(
                    name=name, code=shown(code), known=", ".join(DTYPES)
                )
            )
        if not _naturals(shape):
            raise Malformed(f"tensor {name!r} has shape {str(shape)[:100]}")
        problem = shape_problem(tuple(shape), jnp.dtype(DTYPES[code]).itemsize)
        if problem:
            raise Malformed(f"tensor {name!r} {problem}")
        if not (_naturals(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
            raise Malformed(f"tensor {name!r} has data_offsets {offsets!r}")
        nbytes = _nbytes(code, tuple(shape))
        if nbytes != offsets[1] - offsets[0]:
            raise Malformed(
                f"tensor {name!r} ({DTYPES[code]}, shape {tuple(shape)}) needs "
                f"{nbytes} bytes but its data_offsets span {offsets[1] - offsets[0]}"
            )
        entries[name] = Entry(code, tuple(shape), offsets[0], offsets[1])
    end = 0
    for name, e in sorted(entries.items(), key=lambda item: item[1][2:]):
        if e.begin != end:
            what = "overlaps another" if e.begin < end else "leaves a gap before it"
            raise Malformed(f"tensor {name!r} at bytes {e.begin}..{e.end} {what}")
        end = e.end
    if end != data_size:
        raise Malformed(
            f"the header describes {end} bytes of data but the file holds "
            f"{data_size} (truncated, or extra bytes appended)"
        )
    return entries


def _naturals(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def _header(fd: int) -> tuple[dict[str, str], dict[str, Entry], int]:
    total = size(fd)
    if total < 8:
        raise Malformed(f"it holds {total} bytes, less than a header (truncated)")
    length = int.from_bytes(read_at(fd, 0, 8), "little")
    if length > min(_HEADER_LIMIT, total - 8):
        raise Malformed(
            f"its header claims {length} bytes but the file holds {total} "
            "(truncated, or not a safetensors file)"
        )
    try:
        text = read_at(fd, 8, length).decode("utf-8")
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise Malformed(f"its header is not JSON ({reason})") from None
    entries = _entries(header, total - 8 - length)
    meta = header.get("__metadata__") or {}
    if not (
        isinstance(meta, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    ):
        raise Malformed("its __metadata__ is not a map of strings to strings")
    return meta, entries, 8 + length


_POINTER_SIZE = 200  # a Git LFS pointer's bytes, ~130


def metadata(path: Path, files: Files | None = None) -> Contents:
    """The `Contents` of the file at `path`, from its header (the file is held in
    `Contents.source` for `restore`: by `files`, when given, else by its own)."""
    fd = open_regular(path, NAME, dir_fd=None if files is None else files.directory)
    owner = files is None
    files = Files() if files is None else files
    try:
        ident = identity(fd)
        meta, entries, start = _header(fd)
        key = files.add(path, NAME, fd, ident)  # `files` closes it from here on
    except (Malformed, EOFError) as e:
        try:
            head = read_at(fd, 0, min(size(fd), _POINTER_SIZE))
        except EOFError:  # it shrank meanwhile
            head = b""
        finally:
            os.close(fd)
        raise unreadable(path, NAME, str(e), head) from None
    except BaseException:
        os.close(fd)
        raise
    try:
        shapes = {n: (e.shape, DTYPES[e.code]) for n, e in entries.items()}
        source = Source(files, key, start, entries, owner)
        return decode(path, NAME, meta, shapes, source)
    except Malformed as e:
        if owner:
            files.close()
        raise unreadable(path, NAME, str(e)) from None
    except BaseException:
        if owner:
            files.close()
        raise


def restore(
    contents: Contents, shardings: Mapping[str, Any]
) -> Iterator[tuple[str, np.ndarray]]:
    """Each array, read from the file the header came from into host memory bridge
    owns (the caller moves it into a JAX array: no copy on the CPU), in file order,
    several at a time (`read_many`)."""
    yield from read_many(contents, [s.key for s in contents.tensors])


GROUP_COUNT = 1024  # arrays read at once: Linux's most buffers in one read (IOV_MAX)
GROUP_BYTES = 64 << 20  # bytes read at once, unless one array is larger


def read_many(contents: Contents, names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """`(name, array)` for each of `names`, in the order of their bytes in the file:
    arrays whose bytes are adjacent are read together (up to GROUP_COUNT arrays or
    GROUP_BYTES), each into its own memory (`read_one`'s), with one positioned read
    and one check of the file's identity before and after; 100k small tensors are a
    hundred reads, not 100k."""
    source: Source = contents.source
    group: list[str] = []
    end = size = 0
    for name in sorted(names, key=lambda n: source.entries[n].begin):
        entry = source.entries[name]
        nbytes = entry.end - entry.begin
        if group and (
            entry.begin != end
            or len(group) >= GROUP_COUNT
            or size + nbytes > GROUP_BYTES
        ):
            yield from _read_group(contents, group)
            group, size = [], 0
        group.append(name)
        end, size = entry.end, size + nbytes
    if group:
        yield from _read_group(contents, group)


def _read_group(
    contents: Contents, names: list[str]
) -> Iterator[tuple[str, np.ndarray]]:
    """Arrays whose bytes follow each other in the file, read at once."""
    source: Source = contents.source
    entries = [source.entries[n] for n in names]
    data = [source.files.pool.take(e.end - e.begin) for e in entries]
    try:
        with source.files.reading(source.key) as fd:
            read_into(fd, source.start + entries[0].begin, [d.data for d in data])
    except EOFError as e:
        raise unreadable(contents.path, NAME, f"{e} (changed while read)") from None
    for name, entry, raw in zip(names, entries, data, strict=True):
        yield name, _from_bytes(raw, entry.code, entry.shape)


def read_one(contents: Contents, name: str) -> np.ndarray:
    """One array, read from the file the header came from into host memory of its
    checkpoint's pool (`Files.pool`: 64-byte aligned, so that the JAX array made of a
    weight whose layout is kept is that memory, no copy; reused for a later read
    once the array is gone)."""
    ((_, array),) = _read_group(contents, [name])
    return array


def read_runs(contents: Contents, name: str, runs: list[tuple[int, int]]) -> np.ndarray:
    """Some elements of one array, read from the file the header came from: for each
    run `(start, count)` the elements `start ... start + count - 1` (C order), one run
    after the other, as a 1-D array (only those bytes are read)."""
    source: Source = contents.source
    entry = source.entries[name]
    if entry.code in _PACKED:  # no byte holds one element: read the whole array
        whole = read_one(contents, name).reshape(-1)
        return np.concatenate([whole[a : a + n] for a, n in runs])
    item = jnp.dtype(DTYPES[entry.code]).itemsize
    data = np.empty(sum(n for _, n in runs) * item, np.uint8)
    try:
        with source.files.reading(source.key) as fd:
            at = 0
            for start, count in runs:
                offset = source.start + entry.begin + start * item
                read_at(fd, offset, count * item, data.data[at : at + count * item])
                at += count * item
    except EOFError as e:
        raise unreadable(contents.path, NAME, f"{e} (changed while read)") from None
    return _from_bytes(data, entry.code, (data.size // item,))


def lazy(contents: Contents, source: Any = None) -> dict[str, LazyArray]:
    """`{name: LazyArray}` for a safetensors checkpoint, or a sharded one (`source`:
    its shards, `bridge._io._sharded.Source`): each array read from its file when
    used (as often as it is used), shard by shard (`LazyArray.order` is the shard's
    position); a read is plain (`LazyArray.plain`: a port may read it ahead, in a
    thread). The checkpoint's buffer pool expects every array to be read once
    (`bridge._buffers.Pool.expect`)."""
    if source is not None:
        shards = source.shards
    else:
        shards = ((contents, tuple(s.key for s in contents.tensors)),)
    stored = {s.key: s for s in contents.tensors}
    out = {}
    pool = contents.source.files.pool  # its idle buffers serve the reads to come
    pool.expect(sum(s.nbytes for s in stored.values() if s.nbytes >= pool.least))
    for order, (shard, names) in enumerate(shards):
        for name in names:
            s = stored[name]
            out[name] = LazyArray(
                s.shape,
                s.dtype,
                order,
                lambda c=shard, n=name: read_one(c, n),
                lambda runs, c=shard, n=name: read_runs(c, n, runs),
                plain=True,
            )
    return out


_SEVERAL = (
    "{path} holds several safetensors files beside its config.json ({names}): "
    "point at the one to load"
)


def _probe(directory: Path) -> Path | None:
    """The weights of a `save_pretrained` folder: `model.safetensors`
    (transformers'), else, beside a `config.json`, its one `*.safetensors` file
    (another library's name: diffusers' `diffusion_pytorch_model.safetensors`),
    one of a variant (`*.fp16.safetensors`) only where there is no other; several
    are refused, naming them."""
    path = directory / "model.safetensors"
    if path.is_file():
        return path
    if not (directory / "config.json").is_file():
        return None  # not a model's folder (a PEFT adapter's: adapter_config.json)
    found = sorted(p for p in directory.glob("*" + _SUFFIX) if p.is_file())
    plain = [p for p in found if "." not in p.name.removesuffix(_SUFFIX)]
    if len(plain) == 1 or (not plain and len(found) == 1):
        return (plain or found)[0]
    if found:
        names = ", ".join(p.name for p in found)
        raise unreadable(directory, NAME, _SEVERAL.format(path=directory, names=names))
    return None


FORMAT = register_format(
    Format(
        NAME,
        (".safetensors",),
        "*.safetensors: one safetensors file (roles in its metadata), read lazily",
        save,
        metadata,
        restore,
        frozenset(DTYPES.values()),
        lazy=lazy,
        save_plain=save_plain,
        probe=_probe,
    )
)
