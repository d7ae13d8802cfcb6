"""What a Hugging Face norm class computes, where its name misleads: RMSNorms that
compute `x * (1 + weight)` (Gemma's, and the families that took it up: Qwen3-Next,
VaultGemma, ...), whose `weight` is not the `scale` of Flax's RMSNorm (`x * scale`);
and norms named `LayerNorm` that subtract no mean (T5's `T5LayerNorm`, an RMS norm).
A module tells by its class (its `forward`'s source); a file by its folder's
`config.json` (`model_type`)."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterable
from typing import Any


ONE_PLUS_WEIGHT = re.compile(r"\(\s*1(?:\.0)?\s*\+\s*\w+\.(?:weight|scale)\b")
"""What such a norm's `forward` (or `__call__`) computes with, in transformers' source
(`output * (1.0 + self.weight.float())`) or JAX code's (`(1.0 + self.scale[...])`)."""

NAMED = "Gemma"
"""A norm class whose name has this in it is taken as one, whatever its source says
or when it has none. Any other class whose source cannot be read (defined in a REPL)
is taken as a plain `x * weight` norm, as nearly every Hugging Face norm is."""

MODEL_TYPES = frozenset(
    {
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "recurrent_gemma",
        "vaultgemma",
        "t5gemma",
        "t5gemma2",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_text",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
    }
)
"""The `model_type`s (a Hugging Face folder's `config.json`) whose every norm holding
a weight alone computes `x * (1 + weight)` (transformers 5.x)."""


class FileNorm:
    """The class a layer of a file stands in for when the file's folder says it is
    such a norm (the layer holds a 1-D `weight` alone, in a `MODEL_TYPES` folder)."""


RMS = re.compile(r"\brsqrt\b|\.pow\(\s*2\s*\)|\*\*\s*2\b|\.square\(")
"""What an RMS norm's `forward` computes with (`x.pow(2).mean(-1)`, `torch.rsqrt`)."""
MEAN = re.compile(r"layer_norm|group_norm|-\s*[\w.]*mean\b|\.var\(")
"""What a norm that subtracts the mean computes with (`F.layer_norm`, `x - mean`)."""


_PROSE = re.compile(r"(\"\"\"|\'\'\')[\s\S]*?\1|#[^\n]*")
"""Docstrings and comments: words, not what the code computes."""


@functools.cache
def _forward_source(cls: Any) -> str | None:
    """The source of `cls.forward` (PyTorch), else `cls.__call__` (NNX, Equinox,
    Linen), without its docstring and comments."""
    call = getattr(cls, "forward", None) or getattr(cls, "__call__", None)
    if call is None:
        return None
    try:
        return _PROSE.sub("", inspect.getsource(call))
    except (OSError, TypeError):
        return None


def subtracts_no_mean(cls: Any) -> bool:
    """Whether the norm class `cls`, whatever its name says, computes an RMS norm:
    its `forward`'s source squares and takes a root (`pow(2)`, `rsqrt`) and never
    subtracts a mean nor calls `layer_norm` (T5's `T5LayerNorm`). False when the
    source cannot be read."""
    source = _forward_source(cls)
    return source is not None and bool(RMS.search(source)) and not MEAN.search(source)


@functools.cache  # a source read once per class, not once per layer
def one_plus_weight(cls: Any) -> bool:
    """Whether the norm class `cls` computes `x * (1 + weight)`: `FileNorm`, a class
    of its lineage named after Gemma, or a `forward` whose source multiplies by `(1 +
    self.weight`."""
    lineage = getattr(cls, "__mro__", ())
    if FileNorm in lineage or any(NAMED in c.__name__ for c in lineage):
        return True
    source = _forward_source(cls)
    return source is not None and ONE_PLUS_WEIGHT.search(source) is not None


def file_norms(
    model_type: str | None, entries: Iterable[tuple[tuple, int]]
) -> dict[tuple, type]:
    """`{layer path: FileNorm}` for a file of a `MODEL_TYPES` folder: the layers
    whose only entry is a 1-D `weight`, from every entry's `(path, ndim)`."""
    if model_type not in MODEL_TYPES:
        return {}
    held: dict[tuple, list[tuple[Any, int]]] = {}
    for path, ndim in entries:
        held.setdefault(tuple(path[:-1]), []).append((path[-1], ndim))
    return {p: FileNorm for p, e in held.items() if p and e == [("weight", 1)]}
