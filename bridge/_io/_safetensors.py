"""One safetensors file: flat name -> array, plus string metadata; read lazily."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

from ._atomic import atomic_file


def write(path: Path, arrays: Mapping[str, Any], metadata: dict[str, str]) -> None:
    """Write `arrays` (numpy-convertible, C-contiguous once converted) atomically."""
    flat = {k: np.require(v, requirements="C") for k, v in arrays.items()}
    with atomic_file(path) as tmp:
        safetensors.numpy.save_file(flat, tmp, metadata=metadata)


def header(path: Path) -> tuple[dict[str, str], dict[str, tuple[tuple[int, ...], str]]]:
    """The file's metadata and `{name: (shape, dtype)}`, without reading any array.

    Raises `safetensors.SafetensorError` for a file that is not safetensors or is
    truncated (the header's offsets must cover the file exactly).
    """
    with safetensors.safe_open(path, framework="numpy") as f:
        metadata = f.metadata() or {}
        shapes = {}
        for name in f.keys():
            piece = f.get_slice(name)
            shapes[name] = (tuple(piece.get_shape()), _dtype_name(piece.get_dtype()))
    return metadata, shapes


def read(path: Path, names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Each named array, one at a time, as a read-only view of the file's memory map
    (no copy: the caller copies it once, into a JAX array). Call `header` first: it
    checks that the file is whole."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        layout = json.loads(f.read(size))
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for name in names:
        entry = layout[name]
        begin, end = entry["data_offsets"]
        dtype = jnp.dtype(_dtype_name(entry["dtype"]))
        view = data[8 + size + begin : 8 + size + end].view(dtype)
        yield name, view.reshape(entry["shape"])


# safetensors' dtype codes -> numpy names
_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def _dtype_name(code: str) -> str:
    return _DTYPES.get(code, code.lower())
