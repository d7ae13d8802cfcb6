"""Reading a quantized checkpoint as a dense one: each quantized weight (its stored
tensors, `bridge._quant._schemes`) becomes one `LazyArray` of the dense shape that
dequantizes when its layer is converted, so a load holds the model being filled plus
about one layer, never the dequantized file.

The dense dtype: `load`'s `dtype=` if given, else the `dtype` (`torch_dtype`) of the
folder's `config.json` (the model's own dtype, as transformers dequantizes into it),
else the dtype most of the checkpoint's other floating-point tensors have, else
float32.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._io._config import read_config
from .._io._contents import Contents
from .._io._format import format_named
from .._lazy import LazyArray
from . import _gguf, _schemes
from ._schemes import Quantized, Scan


_CONFIG_NAMES = ("quantization_config", "compression_config")
_FLOATS = ("float16", "bfloat16", "float32")


def folder_config(contents: Contents) -> dict[str, Any]:
    """The `config.json` beside the checkpoint (`{}` if none; `CheckpointError`
    naming it when it is not a small regular file holding a JSON object: see
    `bridge._io._config`)."""
    return read_config(Path(contents.path).parent) or {}


def quantization_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The `quantization_config` of a model's config (None if there is none)."""
    for key in _CONFIG_NAMES:
        found = config.get(key)
        if isinstance(found, dict):
            return found
    return None


def applies(contents: Contents) -> bool:
    """Whether `contents` may hold quantized tensors bridge reads as companions: a
    PyTorch-layout checkpoint without bridge's metadata (from Hugging Face, or
    written by `save_state_dict`)."""
    return contents.version is None and contents.layout == "torch"


def scan(contents: Contents, arrays: Mapping[str, LazyArray]) -> Scan:
    """The quantized weights of `contents` (raising `QuantizationError` for any it
    cannot read); `arrays` reads the small tensors a scheme needs up front."""
    config = quantization_config(folder_config(contents))
    tensors = {s.key: (tuple(s.shape), s.dtype) for s in contents.tensors}
    return _schemes.recognise(
        contents.path, tensors, config, lambda name: arrays[name].read()
    )


def dense_dtype(contents: Contents, found: Scan, dtype: Any = None) -> np.dtype:
    """The dtype quantized weights are dequantized to (see the module's note)."""
    if dtype is not None:
        return np.dtype(jnp.dtype(dtype))
    config = folder_config(contents)
    named = config.get("dtype", config.get("torch_dtype"))
    if isinstance(named, str) and named.removeprefix("torch.") in _FLOATS:
        return np.dtype(jnp.dtype(named.removeprefix("torch.")))
    hidden = found.hidden()
    counts = collections.Counter(
        s.dtype for s in contents.tensors if s.key not in hidden and s.dtype in _FLOATS
    )
    if counts:
        return np.dtype(jnp.dtype(counts.most_common(1)[0][0]))
    return np.dtype(np.float32)


def dense(
    contents: Contents, arrays: Mapping[str, LazyArray], dtype: Any = None
) -> dict[str, LazyArray] | None:
    """`arrays` (a checkpoint's tensors, each read when used) with every quantized
    weight's tensors replaced by one `LazyArray` under the weight's name that reads
    and dequantizes them when used, and the tensors a dense model has no use for
    (activation scales) left out; None for a checkpoint with no quantized weight
    (its arrays are read as they are). `load` asks it as a plug-in
    (`bridge._io._plugins`): for a port read lazily and for a read without `like`."""
    if not applies(contents):
        return None
    found = scan(contents, arrays)
    if not found.quantized:
        return None
    return _replaced(contents, arrays, found, dtype)


def _replaced(
    contents: Contents, arrays: Mapping[str, LazyArray], found: Scan, dtype: Any
) -> dict[str, LazyArray]:
    out_dtype = dense_dtype(contents, found, dtype)
    hidden = found.hidden()
    out = {k: v for k, v in arrays.items() if k not in hidden}
    for name, q in found.quantized.items():
        out[name] = _dequantizing(q, arrays, out_dtype, contents.path)
    return out


def _dequantizing(
    q: Quantized, arrays: Mapping[str, LazyArray], dtype: np.dtype, path: Any
) -> LazyArray:
    order = max(arrays[n].order for n in q.parts.values())
    return LazyArray(
        q.shape,
        dtype,
        order,
        lambda: _schemes.dequantize(q, lambda n: arrays[n].read(), dtype, path),
    )


def quantization_summary(contents: Contents) -> list[str]:
    """Lines for `bridge inspect` on an open checkpoint: each scheme with its bit
    width, how many weights, their bytes stored and dequantized (reading only the
    few small tensors a scheme needs, such as compressed-tensors' `weight_shape`)."""
    if isinstance(contents.source, _gguf.Source):
        return _gguf_summary(contents)
    fmt = format_named(contents.format)
    if fmt.lazy is None or not applies(contents):
        return []
    found = scan(contents, fmt.lazy(contents))
    if not found.quantized:
        return []
    dtype = dense_dtype(contents, found)
    stored = {s.key: s.nbytes for s in contents.tensors}
    groups: dict[str, list[Quantized]] = {}
    for q in found.quantized.values():
        groups.setdefault(q.describe(), []).append(q)
    lines = [f"quantized weights (dequantized as {dtype.name}):"]
    for scheme, weights in groups.items():
        held = sum(stored[n] for q in weights for n in q.parts.values())
        dense_bytes = sum(math.prod(q.shape) for q in weights) * dtype.itemsize
        lines.append(
            f"  {scheme}: {_count(len(weights))}, {held:,} bytes stored, "
            f"{dense_bytes:,} bytes dequantized"
        )
    return lines


def stored_types(contents: Contents) -> dict[str, tuple[str, int]]:
    """`{name: (stored type, bytes stored)}` of the tensors a checkpoint stores in a
    type of its own that it is not read as (a GGUF file's `Q4_K`, read as float32),
    for `bridge inspect`; empty for every other checkpoint."""
    if not isinstance(contents.source, _gguf.Source):
        return {}
    return {
        name: (kind, held)
        for name, (kind, _, held) in _gguf.quantized(contents).items()
    }


def _gguf_summary(contents: Contents) -> list[str]:
    types: dict[str, list[tuple[float, int, int]]] = {}
    dense = {s.key: math.prod(s.shape) * 4 for s in contents.tensors}
    for name, (kind, bits, held) in _gguf.quantized(contents).items():
        types.setdefault(kind, []).append((bits, held, dense[name]))
    if not types:
        return []
    lines = ["quantized weights (GGUF, dequantized as float32):"]
    for kind, rows in types.items():
        held = sum(r[1] for r in rows)
        dense_bytes = sum(r[2] for r in rows)
        lines.append(
            f"  {kind}, {rows[0][0]:g} bits per weight: {_count(len(rows))}, "
            f"{held:,} bytes stored, {dense_bytes:,} bytes dequantized"
        )
    return lines


def _count(n: int) -> str:
    return f"{n} weight" + ("" if n == 1 else "s")
