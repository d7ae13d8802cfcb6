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
    except OSError:
        return None
    return named_type(text) if len(text) <= LIMIT else None


def named_type(text: str | bytes) -> str | None:
    """The `model_type` a `config.json`'s text names (None: none, or not JSON)."""
    try:
        config = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply
        return None
    found = config.get("model_type") if isinstance(config, dict) else None
    return found if isinstance(found, str) else None


def written_type(configs: dict[str, str], folder: Path) -> str | None:
    """The `model_type` of a Hugging Face folder being written: its new
    `config.json` (`configs`, `{file name: text}`), else the one it holds."""
    if CONFIG in configs:
        return named_type(configs[CONFIG])
    return model_type(Path(folder) / CONFIG)
