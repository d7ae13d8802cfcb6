"""A Hugging Face folder's `config.json`, read for what the weights beside it do not
say (the model family: `model_type`; a quantized checkpoint's
`quantization_config`).

It is read as a checkpoint's header is: a regular file (opened without blocking: a
FIFO or a device, or a symbolic link to one, is refused, never waited on or read
without end), at most `LIMIT` bytes, JSON nested no deeper than Python's parser
goes, an object. Anything else is a `CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._errors import CheckpointError, unreadable
from ._files import MissingCheckpoint, open_regular, read_at, size


CONFIG = "config.json"
LIMIT = 16 << 20
"""The most bytes of a `config.json` (transformers' are a few kilobytes; a label map
of 20,000 classes about 1 MB)."""
_FORMAT = "Hugging Face config"


def read_json(
    path: Path, fmt: str, limit: int, hook: Callable[[Any], Any] | None = None
) -> dict[str, Any]:
    """The JSON object in the file at `path` (a `fmt` file of at most `limit`
    bytes; `hook`: json's `object_pairs_hook`), read as a checkpoint's header is.
    Raises `CheckpointError` naming the file (`MissingCheckpoint` when there is
    none)."""
    fd = open_regular(path, fmt)
    try:
        n = size(fd)
        if n > limit:
            reason = (
                f"it is {n} bytes, more than the {limit} bytes {path.name} may hold"
            )
            raise unreadable(path, fmt, reason)
        data = read_at(fd, 0, n)
    except EOFError as e:
        raise unreadable(path, fmt, f"{e} (changed while read)") from None
    finally:
        os.close(fd)
    try:
        config = json.loads(data.decode("utf-8"), object_pairs_hook=hook)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError: not JSON, a key twice (`hook`), an integer of too many digits
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise unreadable(path, fmt, f"it is not JSON ({reason[:200]})") from None
    if not isinstance(config, dict):
        what = type(config).__name__
        raise unreadable(path, fmt, f"it holds a JSON {what}, not an object")
    return config


def read_config(directory: Path) -> dict[str, Any] | None:
    """The JSON object in `directory`'s `config.json`, None when there is none
    (`read_json`'s errors)."""
    try:
        return read_json(Path(directory) / CONFIG, _FORMAT, LIMIT)
    except MissingCheckpoint:
        return None


def model_type(weights: Path) -> str | None:
    """The `model_type` in the `config.json` beside the weights file (or index)
    `weights`; None without one, or when it is not a small JSON object naming one
    (a hint: a FIFO, a device or a broken file is never waited on, only ignored;
    `read_config` refuses them where the config is needed)."""
    try:
        config = read_config(Path(weights).parent)
    except CheckpointError:
        return None
    found = config.get("model_type") if config is not None else None
    return found if isinstance(found, str) else None


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
