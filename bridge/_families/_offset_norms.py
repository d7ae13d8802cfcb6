"""Hugging Face RMSNorms that compute `x * (1 + weight)` (Gemma's, and the families
that took it up: Qwen3-Next, VaultGemma, ...): their `weight` is not the `scale` of
Flax's RMSNorm, which computes `x * scale`. A module tells by its class; a file by
its folder's `config.json` (`model_type`)."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterable
from typing import Any


ONE_PLUS_WEIGHT = re.compile(r"\(\s*1(?:\.0)?\s*\+\s*self\.weight\b")
"""What such a norm's `forward` computes with, in transformers' source
(`output * (1.0 + self.weight.float())`)."""

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


@functools.cache  # a source read once per class, not once per layer
def one_plus_weight(cls: Any) -> bool:
    """Whether the norm class `cls` computes `x * (1 + weight)`: `FileNorm`, a class
    of its lineage named after Gemma, or a `forward` whose source multiplies by `(1 +
    self.weight`."""
    lineage = getattr(cls, "__mro__", ())
    if FileNorm in lineage or any(NAMED in c.__name__ for c in lineage):
        return True
    try:
        source = inspect.getsource(cls.forward)
    except (AttributeError, OSError, TypeError):
        return False
    return ONE_PLUS_WEIGHT.search(source) is not None


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
