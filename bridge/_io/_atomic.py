"""Atomic writes: a checkpoint appears whole at its path, or not at all.

Everything is written under a temporary name in the destination's own directory (so
the final rename never crosses a filesystem), flushed to disk, then renamed over the
destination. The temporary's name is derived from the destination alone
(`.NAME.bridge-tmp`), the same in every process, and saves into one directory take
turns (an exclusive `flock` on the directory, released by the kernel even when a
process is killed). So whatever a temporary is found when a save starts was left by
a save that died: it is removed (and an orbax directory that a dead save had moved
aside is put back if the destination is missing). A failure before the rename
leaves any earlier checkpoint untouched and removes the temporary; an overwritten
checkpoint keeps its permission bits.

With several processes (`jax.distributed`), all of them write a directory checkpoint
into that one temporary (orbax's own barrier waits for every shard); process 0 alone
holds the turn, clears leftovers before the others start, and swaps the directory in
after orbax's barrier, while the others wait for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import jax


_NOT_A_CHECKPOINT = """\
{path} exists and is not a checkpoint directory; bridge.save refuses to replace it.
Save to a new path, or remove it yourself first."""

_TMP, _OLD = "bridge-tmp", "bridge-old"
_ORBAX_TMP = (
    ".orbax-checkpoint-tmp"  # orbax writes `<dir>.orbax-checkpoint-tmp-*` first
)


def temporary(path: Path, tag: str = _TMP) -> Path:
    """The temporary name of `path`'s next version (or, `tag="bridge-old"`, of its
    previous one while an orbax directory is swapped): the same in every process."""
    return path.parent / f".{path.name}.{tag}"


def _leftovers(path: Path) -> list[Path]:
    """Temporaries of `path` that a save which died left behind (older bridge
    versions named them `.NAME.<12 hex>.tmp` or `.old`)."""
    pattern = re.compile(
        rf"\.{re.escape(path.name)}\.({_TMP}|{_OLD}|[0-9a-f]{{12}}\.(tmp|old))"
        rf"({re.escape(_ORBAX_TMP)}.*)?"
    )
    return [p for p in path.parent.iterdir() if pattern.fullmatch(p.name)]


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _clean(path: Path) -> None:
    """Put back an old orbax directory that a swap moved aside if `path` is missing
    (the swap died between its two renames), then remove every temporary of `path`."""
    aside = temporary(path, _OLD)
    if aside.is_dir() and not os.path.lexists(path):
        os.rename(aside, path)
    for stale in _leftovers(path):
        _remove(stale)


@contextlib.contextmanager
def _turn(path: Path) -> Iterator[None]:
    """Hold the exclusive lock of `path`'s directory, then clear what dead saves of
    `path` left behind."""
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _clean(path)
        yield
    finally:
        os.close(fd)  # releases the lock


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mode(path: Path) -> int | None:
    """The permission bits of the existing `path`, None if there is none."""
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def _naming(path: Path, tmp: Path) -> Iterator[None]:
    """Re-raise a write's `OSError` that names no file (a full disk: `write()` knows
    no name) or only the temporary, or a file inside it, as one naming `path`."""
    try:
        yield
    except OSError as e:
        name = None if e.filename is None else str(e.filename)
        if not e.strerror or not (name is None or name.startswith(str(tmp))):
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to `path` (an empty file, which the writer
    overwrites); on success, flush it and rename it to `path`. On any exception the
    temporary is removed and `path` is left as it was. An existing file's permission
    bits are kept; a new file gets the usual ones (the umask applied)."""
    with _turn(path):
        tmp = temporary(path)
        try:
            tmp.touch(exist_ok=False)
            mode = _mode(path)
            mode = _mode(tmp) if mode is None else mode
            with _naming(path, tmp):
                yield tmp
            os.chmod(tmp, 0o644 if mode is None else mode)  # the writer's may differ
            _fsync(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync(path.parent)


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux `renameat2(RENAME_EXCHANGE)`); False where
    the system or filesystem cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_cwd = -100
    done = renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE)
    if done == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(a))


@contextlib.contextmanager
def atomic_dir(path: Path, is_checkpoint: Callable[[Path], bool]) -> Iterator[Path]:
    """Yield a temporary directory path next to `path` (not yet created); on success,
    flush it and swap it with `path` atomically (where the system cannot, the old
    directory is moved aside first and put back if the process dies before the new
    one is in place, at the next save).

    An existing `path` is replaced only when `is_checkpoint(path)` is true.
    """
    if os.path.lexists(path) and not (path.is_dir() and is_checkpoint(path)):
        raise FileExistsError(_NOT_A_CHECKPOINT.format(path=path))
    # with several processes (`jax.distributed`), process 0 alone takes the turn,
    # clears, swaps and cleans; the others write into the same temporary
    primary = jax.process_index() == 0
    with _turn(path) if primary else contextlib.nullcontext():
        _barrier(f"bridge.save {path}: cleared")
        tmp = temporary(path)
        try:
            with _naming(path, tmp):
                yield tmp  # returns after the writer's own barrier (orbax's)
            if primary:
                mode = _mode(path)
                if mode is not None:
                    os.chmod(tmp, mode)
                for sub in sorted(tmp.rglob("*"), reverse=True):
                    _fsync(sub)
                _fsync(tmp)
                if not (path.exists() and _exchange(tmp, path)):
                    aside = temporary(path, _OLD)
                    if path.exists():
                        os.rename(path, aside)
                    os.rename(tmp, path)
                    shutil.rmtree(aside, ignore_errors=True)
        finally:
            if primary:
                _clean(path)  # the old version, orbax's temporaries
        _barrier(f"bridge.save {path}: in place")  # none returns before the swap
        _fsync(path.parent)


def _barrier(name: str) -> None:
    """Wait for every process of a multi-process run (a no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
