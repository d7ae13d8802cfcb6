"""`CheckpointError`: a file or directory that is not a checkpoint bridge can read."""

from __future__ import annotations

from pathlib import Path


_UNREADABLE = """\
{path} is not a readable {format} checkpoint: {reason}. The file may be truncated, \
corrupted or not written by a checkpoint library; save it again from the model."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: a broken or hostile file, a directory that is
    not a checkpoint, a special file (FIFO, device), or metadata that contradicts
    itself. The message names the file and what is wrong with it.

    A subclass of `ValueError`, so `except ValueError` keeps working. Nothing of the
    file is run, imported or written when it is raised.
    """


def unreadable(path: Path, format: str, reason: str) -> CheckpointError:
    """The error for a `format` checkpoint at `path` that cannot be read because of
    `reason` (a short phrase, no final period)."""
    return CheckpointError(_UNREADABLE.format(path=path, format=format, reason=reason))
