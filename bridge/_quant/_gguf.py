"""The GGUF format (llama.cpp's files: `*.gguf`), read with the `gguf` library.

Its header is read and checked by `bridge._quant._gguf_header` (as llama.cpp checks
it; values equal to `gguf.GGUFReader`'s, tested); each tensor is read with positioned
reads and dequantized by `gguf.quants.dequantize` (Q8_0, Q4_0, Q4_K, Q6_K, ... to
float32, bit for bit as llama.cpp's own reference) when its layer is converted.
`F32`, `F16`, `BF16`, `F64` and `I8`...`I64` tensors are read as they are. GGUF
stores a tensor's dimensions innermost first; read
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
import functools
import importlib
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np

from .._families import _gguf_llama
from .._io._contents import Contents, Malformed, Stored, dotted, split
from .._io._errors import CheckpointError, unreadable
from .._io._files import Files, identity, open_regular, read_at
from .._io._format import Format, register_format
from .._lazy import LazyArray
from .._paths import path_of
from .._shown import shown
from ._gguf_header import read_header


NAME = "gguf"

_NO_GGUF = """\
{path} is a GGUF file; reading it needs the `gguf` package (llama.cpp's reader): \
pip install gguf"""

_NO_WRITE = """\
{path}: bridge reads GGUF files but does not write them. Save as safetensors \
(optionally in PyTorch layout, quantized to FP8: bridge.save_quantized(path, \
model, "fp8-block")), or convert with llama.cpp's convert_hf_to_gguf.py."""

# the types stored as NumPy dtypes (read as they are, not dequantized)
_DENSE = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F64": "float64",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
}
_NUMPY = {
    name: np.dtype(ml_dtypes.bfloat16 if name == "BF16" else dtype)
    for name, dtype in _DENSE.items()
}


class Tensor(NamedTuple):
    """One GGUF tensor: its ggml type's name (`"Q4_K"`), bits per weight, bytes
    stored, its NumPy shape (as read: dequantized) and where its bytes start in the
    data section."""

    type: str
    bits: float
    nbytes: int
    shape: tuple[int, ...]
    offset: int


class Source(NamedTuple):
    """The open file (`files`, as `key`), where its data section starts, and each
    tensor by name; `renamed`: the names a view of the file gives them (`{name:
    (GGUF name, heads to un-permute the rows by, or 0)}`, see `hf_view`)."""

    files: Files
    key: int
    start: int
    tensors: dict[str, Tensor]
    renamed: Mapping[str, tuple[str, int]] = {}

    def close(self) -> None:
        self.files.close()


def _gguf(path: Path) -> Any:
    try:
        return importlib.import_module("gguf")  # optional, not a dependency
    except ImportError:
        raise unreadable(path, NAME, _NO_GGUF.format(path=path)) from None


@functools.cache
def _types() -> tuple[dict[int, tuple[str, int, int]], frozenset[int]]:
    """`({ggml type number: (name, values a block, bytes a block)}, the numbers of
    the types bridge reads)`: those stored as NumPy dtypes and those the gguf package
    dequantizes."""
    gguf = importlib.import_module("gguf")
    sizes, readable = {}, set()
    for qtype, (block, size) in gguf.GGML_QUANT_SIZES.items():
        sizes[int(qtype)] = (qtype.name, block, size)
        if qtype.name not in _DENSE:
            try:  # what gguf cannot dequantize raises NotImplementedError
                gguf.quants.dequantize(np.zeros((1, size), np.uint8), qtype)
            except NotImplementedError:
                continue
        readable.add(int(qtype))
    return sizes, frozenset(readable)


def metadata(path: Path) -> Contents:
    """The `Contents` of a GGUF file: each tensor's NumPy shape and the dtype it is
    read as (float32 for a quantized type), the file's scalar key-values. The header
    is checked as llama.cpp checks it (`bridge._quant._gguf_header`)."""
    _gguf(path)
    fd = open_regular(path, NAME)
    files = Files()
    try:
        ident = identity(fd)
        header = read_header(fd, *_types())
        key = files.add(path, NAME, fd, ident)  # `files` closes it from here on
    except (Malformed, EOFError) as e:
        os.close(fd)
        raise unreadable(path, NAME, str(e)) from None
    except BaseException:
        os.close(fd)
        raise
    tensors: dict[str, Tensor] = {}
    stored = []
    for t in header.tensors:
        kind, block, size = _types()[0][t.type]
        tensors[t.name] = Tensor(kind, 8 * size / block, t.nbytes, t.shape, t.offset)
        dtype = _DENSE.get(kind, "float32")
        stored.append(Stored(t.name, split(t.name), "params", t.shape, dtype))
    source = Source(files, key, header.start, tensors)
    return Contents(
        path, NAME, "torch", "torch", None, (), header.scalars, tuple(stored), source
    )


def read_one(contents: Contents, name: str) -> np.ndarray:
    """Tensor `name`, read from the file its header came from (positioned reads,
    its identity checked before and after), dequantized to float32 by `gguf` if it
    is quantized."""
    source: Source = contents.source
    stored, heads = source.renamed.get(name, (name, 0))
    tensor = source.tensors[stored]
    data = np.empty(tensor.nbytes, np.uint8)
    try:
        with source.files.reading(source.key) as fd:
            read_at(fd, source.start + tensor.offset, tensor.nbytes, data.data)
    except EOFError as e:
        raise unreadable(contents.path, NAME, f"{e} (changed while read)") from None
    if tensor.type in _DENSE:
        array = data.view(_NUMPY[tensor.type]).reshape(tensor.shape)
    else:
        if not tensor.nbytes:  # a dimension of 0: gguf's dequantize cannot reshape
            return np.zeros(tensor.shape, np.float32)
        gguf = _gguf(contents.path)
        qtype = gguf.GGMLQuantizationType[tensor.type]
        blocks = gguf.quants.quant_shape_to_byte_shape(tensor.shape, qtype)
        array = gguf.quants.dequantize(data.reshape(blocks), qtype)
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
            # at most 9 digits: Python refuses to read an int of over 4,300
            digits = text.isascii() and text.isdigit() and len(text) <= 9
            if not digits or len(s.shape) not in (1, 2):
                return (
                    f"{s.key}: its rows are permuted, but no {arch}.{key} says by "
                    f"how many heads (it is {shown(text, 40)})"
                )
            heads = int(text)
            if heads == 0 or s.shape[0] % (2 * heads):
                return (
                    f"{s.key}: {s.shape[0]} rows are not {heads} heads of pairs "
                    f"({arch}.{key})"
                )
        renamed[name] = (s.key, heads)
        stored.append(dataclasses.replace(s, key=name, path=split(name)))
    source = contents.source._replace(renamed=renamed)
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
