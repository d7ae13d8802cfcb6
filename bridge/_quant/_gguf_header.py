"""The header of a GGUF file, read from an open descriptor and checked before any
tensor is read, as llama.cpp's `gguf_init_from_file` checks it.

Every length and count is checked against the bytes the file still holds before
anything is allocated or looped over; arrays of key-values (a tokenizer's vocabulary)
are skipped, not read; at most 4 dimensions a tensor, of a ggml type the `gguf`
package knows, with a whole number of blocks a row; and the tensors' data must follow
each other in the data section in the order they are listed, each starting where the
previous one ends padded to the file's alignment (so no tensor reads bytes that are
another's, the header's, or outside the file). A file that breaks a rule raises
`Malformed` naming the key or tensor.

The header is read with positioned reads (no memory mapping: a file truncated while
it is read is an error, never a `SIGBUS`).
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Mapping
from typing import NamedTuple

from .._io._contents import Malformed
from .._io._files import read_at, size


MAGIC = b"GGUF"
VERSIONS = (2, 3)  # as gguf-py's reader; version 1 stored 32-bit lengths
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
# strings in one array key-value at most (a vocabulary holds some 10**5): each is
# walked over, so their count is bounded as well as by the file's size
MOST_STRINGS = 1 << 24
_CHUNK = 1 << 20

# GGUF value types: struct format of each scalar (7 is a bool, 8 a string, 9 an array)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


class Info(NamedTuple):
    """One tensor as the header describes it: its shape in NumPy order (outermost
    first), its ggml type's number, where its bytes start in the data section and
    how many there are."""

    name: str
    shape: tuple[int, ...]
    type: int
    offset: int
    nbytes: int


class Header(NamedTuple):
    """`scalars`: each scalar key-value as text (arrays are left out); `tensors` in
    file order; `start`: where the data section starts in the file."""

    scalars: dict[str, str]
    tensors: list[Info]
    start: int
    alignment: int


class _Cursor:
    """Reads the header front to back in chunks; refuses to read past the file."""

    def __init__(self, fd: int):
        self.fd, self.total = fd, size(fd)
        self.pos = self.base = 0
        self.buffer = b""

    def left(self) -> int:
        return self.total - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise Malformed(
                f"{what} needs {n:,} bytes at byte {self.pos:,}, but the file ends "
                f"{self.left():,} bytes later (truncated, or a length that lies)"
            )
        at = self.pos - self.base
        if at + n > len(self.buffer):
            count = min(max(n, _CHUNK), self.left())
            self.buffer, self.base, at = read_at(self.fd, self.pos, count), self.pos, 0
        self.pos += n
        return self.buffer[at : at + n]

    def skip(self, n: int, what: str) -> None:
        if n > self.left():
            self.take(n, what)  # raises
        self.pos += n

    def unpack(self, code: str, what: str) -> int | float | bool:
        (value,) = struct.unpack("<" + code, self.take(struct.calcsize(code), what))
        return value

    def text(self, what: str) -> str:
        n = self.unpack("Q", what)
        data = self.take(int(n), what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            shown = data[:40].decode("utf-8", "backslashreplace")
            raise Malformed(f"{what} is not UTF-8 text ({shown!r})") from None


def _value(cursor: _Cursor, kind: int, key: str) -> str | None:
    """A key-value's value as text (`repr` of a number, as gguf-py's `contents()`
    gives it), or None for an array (skipped)."""
    what = f"key-value {key!r}"
    if kind in _SCALARS:
        return repr(cursor.unpack(_SCALARS[kind], what))
    if kind == _STRING:
        return cursor.text(what)
    if kind != _ARRAY:
        raise Malformed(f"{what} has value type {kind}, which GGUF does not define")
    item = int(cursor.unpack("I", what))
    count = int(cursor.unpack("Q", what))
    if item in _SCALARS:
        cursor.skip(
            count * struct.calcsize(_SCALARS[item]), f"{what} ({count:,} items)"
        )
    elif item == _STRING:
        if count * 8 > cursor.left() or count > MOST_STRINGS:
            raise Malformed(
                f"{what} claims {count:,} strings; the file holds {cursor.left():,} "
                f"more bytes (8 at least a string) and bridge reads at most "
                f"{MOST_STRINGS:,}"
            )
        for _ in range(count):
            cursor.skip(int(cursor.unpack("Q", what)), what)
    else:
        raise Malformed(
            f"{what} is an array of value type {item}: GGUF arrays hold numbers or "
            "strings (llama.cpp refuses arrays of arrays)"
        )
    return None


def _tensor(
    cursor: _Cursor,
    index: int,
    sizes: Mapping[int, tuple[str, int, int]],
    readable: Collection[int],
) -> Info:
    name = cursor.text(f"tensor {index}'s name")
    what = f"tensor {name!r}"
    ndims = int(cursor.unpack("I", what))
    if ndims > MAX_DIMS:
        raise Malformed(f"{what} has {ndims} dimensions; GGUF allows {MAX_DIMS}")
    dims = [int(cursor.unpack("Q", what)) for _ in range(ndims)]
    kind = int(cursor.unpack("I", what))
    offset = int(cursor.unpack("Q", what))
    if kind not in readable:
        known = ", ".join(sizes[k][0] for k in sorted(readable))
        named = f"{sizes[kind][0]} ({kind})" if kind in sizes else f"{kind}, unknown,"
        raise Malformed(
            f"{what} has ggml type {named} which bridge cannot read: the gguf "
            f"package dequantizes {known}. Convert it with llama.cpp's "
            "llama-quantize to one of those (or upgrade gguf)"
        )
    type_name, block, type_size = sizes[kind]
    count = 1
    for d in dims:
        count *= d
    if any(d >= 1 << 63 for d in dims) or count >= 1 << 63:
        raise Malformed(f"{what} has dimensions {dims}: over 2**63 elements")
    if dims and dims[0] % block:
        raise Malformed(
            f"{what} ({type_name}) has rows of {dims[0]} values, not a whole number "
            f"of its {block}-value blocks"
        )
    shape = tuple(reversed(dims))
    return Info(name, shape, kind, offset, count // block * type_size)


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def read_header(
    fd: int, sizes: Mapping[int, tuple[str, int, int]], readable: Collection[int]
) -> Header:
    """The checked header of the GGUF file open as `fd`. `sizes`: for each ggml type
    number, `(name, values a block, bytes a block)` (gguf's `GGML_QUANT_SIZES`);
    `readable`: the numbers of the types a tensor may have."""
    cursor = _Cursor(fd)
    if cursor.take(4, "the magic number") != MAGIC:
        raise Malformed("it does not start with GGUF's magic number")
    version = int(cursor.unpack("I", "the version"))
    if version not in VERSIONS:
        swapped = version & 0xFFFF == 0
        raise Malformed(
            f"its GGUF version is {version}; bridge reads versions 2 and 3"
            + (
                " in little-endian byte order (this file is big-endian)"
                if swapped
                else ""
            )
        )
    tensor_count = int(cursor.unpack("Q", "the tensor count"))
    kv_count = int(cursor.unpack("Q", "the key-value count"))
    # a key-value takes 13 bytes at least, a tensor's description 24
    if kv_count * 13 + tensor_count * 24 > cursor.left():
        raise Malformed(
            f"it claims {tensor_count:,} tensors and {kv_count:,} key-values, more "
            f"than its {cursor.total:,} bytes can describe"
        )
    scalars: dict[str, str] = {}
    seen: set[str] = set()
    alignment = DEFAULT_ALIGNMENT
    for i in range(kv_count):
        key = cursor.text(f"key-value {i}'s name")
        if key in seen:
            raise Malformed(f"key-value {key!r} appears twice")
        seen.add(key)
        kind = int(cursor.unpack("I", f"key-value {key!r}"))
        value = _value(cursor, kind, key)
        if key == "general.alignment":
            if kind != 4 or value is None or not _power_of_two(int(value)):
                raise Malformed(
                    f"general.alignment is {value!r} (type {kind}): it must be a "
                    "uint32 power of two"
                )
            alignment = int(value)
        if value is not None:
            scalars[key] = value
    tensors: list[Info] = []
    names: set[str] = set()
    for i in range(tensor_count):
        info = _tensor(cursor, i, sizes, readable)
        if info.name in names:
            raise Malformed(f"tensor {info.name!r} appears twice")
        names.add(info.name)
        tensors.append(info)
    start = _pad(cursor.pos, alignment)
    _check_extents(tensors, alignment, cursor.total - start)
    return Header(scalars, tensors, start, alignment)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_extents(tensors: list[Info], alignment: int, data_size: int) -> None:
    """Each tensor starts where the one before it ends, padded to `alignment` (as
    llama.cpp requires), and ends within the file."""
    expected = 0
    for t in tensors:
        if t.offset != expected:
            raise Malformed(
                f"tensor {t.name!r} starts at byte {t.offset:,} of the data section, "
                f"but the tensor before it ends at byte {expected:,} (padded to the "
                f"alignment, {alignment}): its bytes would be "
                + (
                    "another tensor's"
                    if t.offset < expected
                    else "misaligned"
                    if t.offset % alignment
                    else "after a gap"
                )
                + ". GGUF tensors follow each other in order, as llama.cpp requires"
            )
        if t.offset + t.nbytes > data_size:
            raise Malformed(
                f"tensor {t.name!r} needs bytes {t.offset:,}..{t.offset + t.nbytes:,} "
                f"of the data section, which holds {max(data_size, 0):,} (truncated)"
            )
        expected = _pad(t.offset + t.nbytes, alignment)
