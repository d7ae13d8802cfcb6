"""Hugging Face RMSNorms that compute `x * (1 + weight)` (Gemma's, and the families
that took it up: Qwen3-Next, Qwen3.5, VaultGemma, ...): their `weight` is not the
`scale` of Flax's RMSNorm, which computes `x * scale`."""

from __future__ import annotations

import inspect
import re
from typing import Any


ONE_PLUS_WEIGHT = re.compile(r"\(\s*1(?:\.0)?\s*\+\s*self\.weight\b")
"""What such a norm's `forward` computes with, in transformers' source
(`output * (1.0 + self.weight.float())`)."""

NAMED = "Gemma"
"""A norm class whose name has this in it is taken as one, whatever its source says
(a class without source: refused rather than guessed)."""


def one_plus_weight(cls: Any) -> bool:
    """Whether the norm class `cls` computes `x * (1 + weight)`: a class of its
    lineage is named after Gemma, or its `forward`'s source multiplies by `(1 +
    self.weight`."""
    if any(NAMED in c.__name__ for c in getattr(cls, "__mro__", ())):
        return True
    try:
        source = inspect.getsource(cls.forward)
    except (AttributeError, OSError, TypeError):
        return False
    return ONE_PLUS_WEIGHT.search(source) is not None
