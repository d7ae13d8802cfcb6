"""A Hugging Face folder's `config.json`, read for what the weights beside it do not
say (the model family: `model_type`)."""

from __future__ import annotations

import json
from pathlib import Path


CONFIG = "config.json"
LIMIT = 1 << 20
"""The most bytes read of a `config.json` (transformers' are a few kilobytes)."""


def model_type(weights: Path) -> str | None:
    """The `model_type` in the `config.json` beside the weights file (or index)
    `weights`; None without one, or when it is not a small JSON object naming one."""
    try:
        with open(Path(weights).parent / CONFIG, "rb") as f:
            text = f.read(LIMIT + 1)
        config = json.loads(text) if len(text) <= LIMIT else None
    except (OSError, ValueError):
        return None
    found = config.get("model_type") if isinstance(config, dict) else None
    return found if isinstance(found, str) else None
