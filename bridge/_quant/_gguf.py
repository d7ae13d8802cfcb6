"""The GGUF format (llama.cpp's files: `*.gguf`), read with the `gguf` library.

Its header is read by `gguf.GGUFReader`; each tensor is dequantized by
`gguf.quants.dequantize` (Q8_0, Q4_0, Q4_K, Q6_K, ... to float32, bit for bit as
llama.cpp's own reference) when its layer is converted. `F32`, `F16` and `BF16`
tensors are read as they are. GGUF stores a tensor's dimensions innermost first; read
in NumPy order, a linear layer's weight is `(out, in)`, PyTorch's layout, so a GGUF
file is read as a PyTorch-layout checkpoint under its own names (`token_embd.weight`,
`blk.0.attn_q.weight`, ...). The scalar key-values (`general.architecture`,
`llama.block_count`, ...) are its metadata; arrays of them (the tokenizer's
vocabulary) are left out.

Note: llama.cpp's Hugging Face converter permutes the rows of Llama's `q_proj` and
`k_proj` (`blk.N.attn_q`, `attn_k`) so that each head's rotary pairs are adjacent: a
model reading them applies the rotary embedding to pairs `(2i, 2i + 1)`, as llama.cpp
does, not to the two halves of each head as transformers' Llama does.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np

from .._families import _gguf_llama
from .._io._contents import Contents, Stored, dotted, split
from .._io._errors import CheckpointError, unreadable
from .._io._format import Format, register_format
from .._lazy import LazyArray
from .._paths import path_of


NAME = "gguf"

_NO_GGUF = """\
{path} is a GGUF file; reading it needs the `gguf` package (llama.cpp's reader): \
pip install gguf"""

_NO_WRITE = """\
{path}: bridge reads GGUF files but does not write them. Save as safetensors \
(optionally in PyTorch layout, quantized to FP8: save(..., layout="torch", \
quantize="fp8-block")), or convert with llama.cpp's convert_hf_to_gguf.py."""

_DENSE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class Tensor(NamedTuple):
    """One GGUF tensor: its ggml type's name (`"Q4_K"`), bits per weight, bytes
    stored, and the reader's array of its bytes (or values)."""

    type: str
    bits: float
    nbytes: int
    data: Any


class Source(NamedTuple):
    """The open reader and each tensor by name; `renamed`: the names a view of the
    file gives them (`{name: (GGUF name, heads to un-permute the rows by, or 0)}`,
    see `hf_view`)."""

    reader: Any
    tensors: dict[str, Tensor]
    renamed: Mapping[str, tuple[str, int]] = {}

    def close(self) -> None:
        mmap = getattr(self.reader.data, "_mmap", None)
        if mmap is not None:
            mmap.close()


def _gguf(path: Path) -> Any:
    try:
        return importlib.import_module("gguf")  # optional, not a dependency
    except ImportError:
        raise unreadable(path, NAME, _NO_GGUF.format(path=path)) from None


def _scalar(field: Any) -> str | None:
    """A scalar key-value as text, None for an array."""
    if len(field.types) != 1:
        return None
    value = field.contents()
    return value if isinstance(value, str) else repr(value)


def metadata(path: Path) -> Contents:
    """The `Contents` of a GGUF file: each tensor's NumPy shape and the dtype it is
    read as (float32 for a quantized type), the file's scalar key-values."""
    gguf = _gguf(path)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise unreadable(path, NAME, f"gguf cannot read its header ({e})") from None
    tensors: dict[str, Tensor] = {}
    stored = []
    for t in reader.tensors:
        kind = t.tensor_type.name
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = Tensor(kind, 8 * size / block, int(t.n_bytes), t.data)
        dtype = _DENSE.get(kind, "float32")
        stored.append(Stored(t.name, split(t.name), "params", shape, dtype))
    meta = {
        key: text
        for key, field in reader.fields.items()
        if not key.startswith("GGUF.") and (text := _scalar(field)) is not None
    }
    source = Source(reader, tensors)
    return Contents(path, NAME, "torch", "torch", None, (), meta, tuple(stored), source)


def read_one(contents: Contents, name: str) -> np.ndarray:
    """Tensor `name`, dequantized to float32 by `gguf` if it is quantized."""
    gguf = _gguf(contents.path)

    stored, heads = contents.source.renamed.get(name, (name, 0))
    tensor: Tensor = contents.source.tensors[stored]
    shape = next(s.shape for s in contents.tensors if s.key == name)
    if tensor.type == "BF16":
        array = np.array(tensor.data).view(ml_dtypes.bfloat16).reshape(shape)
    elif tensor.type in _DENSE:
        array = np.array(tensor.data).reshape(shape)
    else:
        qtype = gguf.GGMLQuantizationType[tensor.type]
        array = gguf.quants.dequantize(np.asarray(tensor.data), qtype).reshape(shape)
    return _gguf_llama.unpermute(array, heads) if heads else array


def hf_view(contents: Contents) -> Contents | str:
    """`contents` (a GGUF file of a Llama) under Hugging Face's names
    (`model.layers.0.self_attn.q_proj.weight`), the query and key rows un-permuted
    when read (`bridge._families._gguf_llama`), or why it cannot be. A tensor
    Hugging Face's Llama does not have keeps its GGUF name."""
    arch = contents.metadata.get("general.architecture")
    if arch not in _gguf_llama.ARCHITECTURES:
        return f"its architecture {arch!r} has no Hugging Face names in bridge"
    renamed: dict[str, tuple[str, int]] = {}
    stored = []
    for s in contents.tensors:
        found = _gguf_llama.hf_name(s.key)
        if found is None:
            stored.append(s)
            continue
        name, key = found
        heads = 0
        if key is not None:
            text = contents.metadata.get(f"{arch}.{key}", "")
            if not text.isdigit() or len(s.shape) not in (1, 2):
                return (
                    f"{s.key}: its rows are permuted, but no {arch}.{key} says by "
                    "how many heads"
                )
            heads = int(text)
            if heads == 0 or s.shape[0] % (2 * heads):
                return (
                    f"{s.key}: {s.shape[0]} rows are not {heads} heads of pairs "
                    f"({arch}.{key})"
                )
        renamed[name] = (s.key, heads)
        stored.append(dataclasses.replace(s, key=name, path=split(name)))
    source = Source(contents.source.reader, contents.source.tensors, renamed)
    return dataclasses.replace(contents, tensors=tuple(stored), source=source)


_NO_HF = """\
{path}: `like` has Hugging Face's Llama names ({example}), but this GGUF file cannot \
be read under them: {problem}"""


def named_like(contents: Contents, target: Any) -> Contents:
    """`contents` as `target` (a Tree) names its layers: a GGUF Llama file under
    Hugging Face's names when `target` has some of those and none of the file's own
    (`blk.0.attn_q`); anything else as it is."""
    if not isinstance(contents.source, Source) or target is None:
        return contents
    leaves = jax.tree_util.tree_flatten_with_path(target)[0]
    modules = {dotted(path_of(p)[:-1]) for p, _ in leaves}
    own = {dotted(s.path[:-1]) for s in contents.tensors}
    if own & modules:
        return contents
    hf = {
        found[0].rpartition(".")[0]
        for s in contents.tensors
        if (found := _gguf_llama.hf_name(s.key)) is not None
    }
    wanted = sorted(hf & modules)
    if not wanted:
        return contents
    view = hf_view(contents)
    if isinstance(view, str):
        problem = _NO_HF.format(path=contents.path, example=wanted[0], problem=view)
        raise CheckpointError(problem)
    return view


def restore(
    contents: Contents, shardings: Mapping[str, Any]
) -> Iterator[tuple[str, np.ndarray]]:
    """Each tensor, dequantized, one at a time."""
    for s in contents.tensors:
        yield s.key, read_one(contents, s.key)


def lazy(contents: Contents) -> dict[str, LazyArray]:
    """`{name: LazyArray}`: each tensor read (and dequantized) when used."""
    return {
        s.key: LazyArray(s.shape, s.dtype, 0, lambda n=s.key: read_one(contents, n))
        for s in contents.tensors
    }


def quantized(contents: Contents) -> dict[str, tuple[str, float, int]]:
    """The quantized tensors of a GGUF checkpoint: `{name: (type, bits per weight,
    bytes stored)}`."""
    return {
        name: (t.type, t.bits, t.nbytes)
        for name, t in contents.source.tensors.items()
        if t.type not in _DENSE
    }


def _save(path: Path, contents: Contents, arrays: Mapping[str, Any]) -> None:
    # never reached through `bridge.save`: the format stores no dtype
    raise ValueError(_NO_WRITE.format(path=path))


def dense_nbytes(contents: Contents) -> int:
    """Bytes of every tensor as read (dequantized)."""
    return sum(
        math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in contents.tensors
    )


FORMAT = register_format(
    Format(
        NAME,
        (".gguf",),
        "*.gguf: a llama.cpp GGUF file, read only, each tensor dequantized when its "
        "layer is converted",
        _save,
        metadata,
        restore,
        frozenset(),  # written by no one: bridge reads GGUF only
        lazy=lazy,
        training=False,
        rename=named_like,
    )
)
