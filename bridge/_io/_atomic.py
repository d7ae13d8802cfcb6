"""Atomic writes: a checkpoint appears whole at its path, or not at all.

Everything is written under a temporary name in the destination's own directory (so
the final rename never crosses a filesystem), flushed to disk, then renamed over the
destination. A failure before the rename leaves any earlier checkpoint at that path
untouched and removes the temporary.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path


_NOT_A_CHECKPOINT = """\
{path} exists and is not a checkpoint directory; bridge.save refuses to replace it.
Save to a new path, or remove it yourself first."""


def _temporary(path: Path, tag: str) -> Path:
    return path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.{tag}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success, flush it and rename it to
    `path`. On any exception the temporary is removed and `path` is left as it was."""
    tmp = _temporary(path, "tmp")
    try:
        tmp.touch(exist_ok=False)  # the mode a new file gets here (the umask applied)
        mode = tmp.stat().st_mode
        yield tmp
        os.chmod(tmp, mode)  # a writer may have made its own file, private
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync(path.parent)


@contextlib.contextmanager
def atomic_dir(path: Path, is_checkpoint: Callable[[Path], bool]) -> Iterator[Path]:
    """Yield a temporary directory path next to `path` (not yet created); on success,
    flush it and rename it to `path`.

    An existing `path` is replaced only when `is_checkpoint(path)` is true; it is
    moved aside first and deleted once the new directory is in place, so a failure at
    any point leaves either the old or the new checkpoint whole.
    """
    if path.exists() and not (path.is_dir() and is_checkpoint(path)):
        raise FileExistsError(_NOT_A_CHECKPOINT.format(path=path))
    tmp = _temporary(path, "tmp")
    try:
        yield tmp
        for sub in sorted(tmp.rglob("*"), reverse=True):
            _fsync(sub)
        _fsync(tmp)
        old = _temporary(path, "old")
        if path.exists():
            os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            if old.exists():
                os.rename(old, path)
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _fsync(path.parent)
