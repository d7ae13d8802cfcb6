"""Hostile GGUF files, generated at test time by a writer of the format's bytes (so
that a file can lie: gguf's own writer only writes valid files).

`gguf_bytes` writes a GGUF version 3 file; `cases()` lists the hostile ones as
`corpus.Case`s (category "gguf") that `load`, `load(like=)`, `bridge inspect` and
`bridge convert` must refuse with one `CheckpointError` naming the file (and, in its
message, the `tensor`/`key` named by `Case.name`'s part after `: `).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from . import Case


F32, F16, Q8_0, Q8_1, I8, I16, I32, I64, F64 = 0, 1, 8, 9, 24, 25, 26, 27, 28
UINT8, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT32, UINT64 = 0, 5, 6, 7, 8, 9, 4, 10


class T(NamedTuple):
    """A tensor entry: its name, dims innermost first (GGUF's order), ggml type,
    offset in the data section (None: where a valid writer puts it)."""

    name: str | bytes
    dims: tuple[int, ...]
    type: int = F32
    offset: int | None = None


def _string(text: str | bytes, length: int | None = None) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data) if length is None else length) + data


def _value(kind: int, value: Any) -> bytes:
    if kind == STRING:
        return _string(value)
    if kind == ARRAY:
        item, items, count = value  # (item type, encoded items, claimed count)
        return struct.pack("<IQ", item, count) + items
    code = {UINT8: "B", INT32: "i", FLOAT32: "f", BOOL: "?", UINT32: "I"}[kind]
    code = {UINT64: "Q"}.get(kind, code)
    return struct.pack("<" + code, value)


def _nbytes(dims: tuple[int, ...], kind: int) -> int:
    count = int(np.prod(dims))
    if kind in (Q8_0, Q8_1):
        return count // 32 * (34 if kind == Q8_0 else 36)
    size = {F16: 2, I8: 1, I16: 2, I32: 4, I64: 8, F64: 8}.get(kind, 4)
    return count * size


def gguf_bytes(
    kvs: list[tuple[str | bytes, int, Any]],
    tensors: list[T],
    data: bytes | None = None,
    alignment: int = 32,
    counts: tuple[int, int] | None = None,
) -> bytes:
    """A GGUF v3 file: `kvs` as `(key, value type, value)`, `tensors` laid out one
    after the other (each padded to `alignment`) unless their offsets say otherwise;
    `data`: the data section (default: each tensor's values `0, 1, 2, ...` in
    float32, zeros otherwise); `counts` may lie about `(tensors, key-values)`."""
    n_tensors, n_kvs = counts if counts is not None else (len(tensors), len(kvs))
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kvs))
    for key, kind, value in kvs:
        out += _string(key) + struct.pack("<I", kind) + _value(kind, value)
    offset, sections = 0, bytearray()
    for t in tensors:
        nbytes = _nbytes(t.dims, t.type)
        at = offset if t.offset is None else t.offset
        out += _string(t.name) + struct.pack("<I", len(t.dims))
        out += struct.pack(f"<{len(t.dims)}Q", *t.dims) + struct.pack("<IQ", t.type, at)
        if t.type == F32:
            sections += np.arange(nbytes // 4, dtype=np.float32).tobytes()
        else:
            sections += bytes(nbytes)
        sections += bytes(-len(sections) % alignment)
        offset = len(sections)
    out += bytes(-len(out) % alignment)
    return bytes(out) + (bytes(sections) if data is None else data)


def _file(content: bytes) -> Callable[[Path], Path]:
    def make(directory: Path) -> Path:
        path = directory / "m.gguf"
        path.write_bytes(content)
        return path

    return make


def _two(second_offset: int, first_dims=(8,)) -> bytes:
    return gguf_bytes(
        [], [T("a.weight", first_dims), T("b.weight", (8,), F32, second_offset)]
    )


def cases() -> list[Case]:
    """Each hostile GGUF file: its case name ends with what the message must name."""
    arch = ("general.architecture", STRING, "llama")
    made = [
        # tensor extents (item 3)
        ("offset equal to another's: b.weight", _two(0)),
        ("offset inside another: b.weight", _two(16, (16,))),
        ("misaligned offset: b.weight", _two(36)),
        ("a gap before it: b.weight", _two(64)),
        ("offset 2**64-1: b.weight", _two(2**64 - 1)),
        ("offset 2**63: b.weight", _two(2**63)),
        ("past the end of the file: b.weight", _two(32)[:-8]),
        (
            "first tensor not at 0: a.weight",
            gguf_bytes([], [T("a.weight", (8,), F32, 32)]),
        ),
        # sizes read before they are checked (item 14)
        (
            "array of 10**9 numbers claimed: 'tokenizer.ggml.scores'",
            gguf_bytes(
                [("tokenizer.ggml.scores", ARRAY, (FLOAT32, b"\0" * 64, 10**9))], []
            ),
        ),
        (
            "array of 2**63 strings claimed: 'tokenizer.ggml.tokens'",
            gguf_bytes([("tokenizer.ggml.tokens", ARRAY, (STRING, b"", 2**63))], []),
        ),
        (
            "array of arrays: 'x'",
            gguf_bytes([("x", ARRAY, (ARRAY, struct.pack("<IQ", UINT8, 0), 1))], []),
        ),
        (
            "a key of length 2**62: key-value 0",
            b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string(b"k", 2**62) + bytes(16),
        ),
        (
            "tensor count 2**60: tensors",
            gguf_bytes([arch], [T("a.weight", (8,))], counts=(2**60, 1)),
        ),
        (
            "dims multiplying past 2**63: a.weight",
            gguf_bytes([], [T("a.weight", (2**32, 2**32))], data=b""),
        ),
        ("five dims: a.weight", gguf_bytes([], [T("a.weight", (1, 1, 1, 1, 1))])),
        (
            "rows not whole blocks: a.weight",
            gguf_bytes([], [T("a.weight", (33,), Q8_0)], data=bytes(64)),
        ),
        # types (item 17) and text (item 18)
        ("ggml type Q8_1: Q8_1", gguf_bytes([], [T("a.weight", (32,), Q8_1)])),
        ("ggml type 999: a.weight", gguf_bytes([], [T("a.weight", (8,), 999)])),
        (
            "value type 99: 'x'",
            b"GGUF"
            + struct.pack("<IQQ", 3, 0, 1)
            + _string("x")
            + struct.pack("<IQ", 99, 0),
        ),
        (
            "non-UTF-8 value: 'general.name'",
            gguf_bytes([("general.name", STRING, b"\xff\xfe")], []),
        ),
        ("non-UTF-8 tensor name: tensor 0", gguf_bytes([], [T(b"\xffa", (8,))])),
        (
            "key twice: 'general.name'",
            gguf_bytes([("general.name", STRING, "a")] * 2, []),
        ),
        (
            "tensor twice: a.weight",
            gguf_bytes([], [T("a.weight", (8,)), T("a.weight", (8,))]),
        ),
        (
            "alignment 3: general.alignment",
            gguf_bytes([("general.alignment", UINT32, 3)], []),
        ),
        (
            "alignment 0: general.alignment",
            gguf_bytes([("general.alignment", UINT32, 0)], []),
        ),
        ("version 1: version", b"GGUF" + struct.pack("<IQQ", 1, 0, 0)),
        ("big-endian: big-endian", b"GGUF" + struct.pack(">IQQ", 3, 0, 0)),
        ("not GGUF: magic", b"GGUX" + struct.pack("<IQQ", 3, 0, 0)),
        ("empty: magic", b""),
    ]
    return [Case("gguf", name, _file(content)) for name, content in made]
