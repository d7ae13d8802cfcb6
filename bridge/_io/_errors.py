"""`CheckpointError`: a file or directory that is not a checkpoint bridge can read."""

from __future__ import annotations

import re
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


_LFS = b"version https://git-lfs.github.com/spec/"
_LFS_POINTER = """\
{path} is a Git LFS pointer ({size}), not the checkpoint: the repository was \
cloned without Git LFS, which leaves a small text file in place of each large one. \
Fetch the files: run `git lfs install` and then `git lfs pull` in the clone, or \
download the model with huggingface_hub (`hf download REPO_ID`)."""


def unreadable(
    path: Path, format: str, reason: str, head: bytes = b""
) -> CheckpointError:
    """The error for a `format` checkpoint at `path` that cannot be read because of
    `reason` (a short phrase, no final period). `head`, the file's first bytes where
    they are at hand, tells a Git LFS pointer (a hub repository cloned without Git
    LFS), whose fix is to fetch the file, not to save it again."""
    if head.startswith(_LFS):
        text = head.decode("ascii", "replace")
        stood = re.search(r"^size (\d+)$", text, re.M)
        size = f"{len(head)} bytes"
        if stood:
            size += f" in place of a file of {int(stood[1]):,} bytes"
        return CheckpointError(_LFS_POINTER.format(path=path, size=size))
    return CheckpointError(_UNREADABLE.format(path=path, format=format, reason=reason))


class BridgeDeprecationWarning(DeprecationWarning):
    """An earlier spelling of a call that still works, naming the call that does the
    job now (`bridge.save(..., layout="torch")`: `bridge.save_pretrained`). Shown
    where the call is made in `__main__` (a script, a notebook), as Python shows
    `DeprecationWarning`s."""
