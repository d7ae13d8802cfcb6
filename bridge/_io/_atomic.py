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

A directory is swapped in with `renameat2(RENAME_EXCHANGE)`. Where the filesystem
cannot exchange, a writer that knows its files moves the new ones into the old
directory, the old checkpoint whole until one rename makes the new one whole
(`atomic_dir(in_place=...)`: a Hugging Face folder whose config files do not
change); otherwise the old directory is renamed aside (`.NAME.bridge-old`) and the
new one renamed in: a save killed between the two renames leaves the old one aside,
where `reachable(path)` (used by every load) finds it and the next save puts it back. A
directory this user may not write (`chmod 555`) is refused before anything is
written; so is a file without any write bit (`chmod 444`, for root too) or one this
user may not write, and a file in a directory this user may not write; temporaries
are removed even where a writer made them read-only.

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
import json
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax


_NOT_A_CHECKPOINT = """\
{path} exists and is not a checkpoint directory; bridge.save refuses to replace it.
Save to a new path, or remove it yourself first."""

_READ_ONLY = """\
it is a directory this user may not write (mode {mode:o}): bridge.save does not \
replace a read-only checkpoint. Make it writable first (chmod u+w), or save to \
another path"""

_READ_ONLY_FILE = """\
it is a read-only file (mode {mode:o}): bridge.save does not replace a file its \
owner protected from writes. Make it writable first (chmod u+w), or save to another \
path"""

_CANNOT_WRITE_IN = """\
it is in a directory this user may not write (mode {mode:o}), where a save writes \
its temporary file. Save to another directory, or make it writable (chmod u+w)"""

_TMP, _OLD, _JOURNAL = "bridge-tmp", "bridge-old", "bridge-commit"
_HELD = threading.local()  # the directories whose turn this thread holds
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
        rf"\.{re.escape(path.name)}\.({_TMP}|{_OLD}|{_JOURNAL}-tmp|[0-9a-f]{{12}}\.(tmp|old))"
        rf"({re.escape(_ORBAX_TMP)}.*)?"
    )
    return [p for p in path.parent.iterdir() if pattern.fullmatch(p.name)]


def _writable(function: Any, name: str, _: Any) -> None:
    """`shutil.rmtree`'s error handler: make the directory holding `name` (and a
    directory `name` itself) writable, then try again, once."""
    for where in (os.path.dirname(name), name):
        with contextlib.suppress(OSError):
            if os.path.isdir(where) and not os.path.islink(where):
                os.chmod(where, os.stat(where).st_mode | 0o700)
    with contextlib.suppress(OSError):
        function(name)


def _remove(path: Path) -> None:
    """Remove a temporary of bridge's, also where a writer (or `chmod`) left it or a
    directory inside it read-only."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, onerror=_writable)
        if os.path.lexists(path):
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


def reachable(path: Path) -> Path:
    """`path`, or, where nothing is at `path` but a directory swap died between its
    two renames, the old directory it moved aside (a load reads the old version).
    A commit of several files (`atomic_files`) beside `path` that a killed save left
    half done is completed first (where this user may)."""
    if any(path.parent.glob(f".*.{_JOURNAL}")):
        with contextlib.suppress(OSError), turn(path.parent / ".journal"):
            pass  # `turn` completes it (or waits for the save doing it)
    aside = temporary(path, _OLD)
    if not os.path.lexists(path) and aside.is_dir():
        return aside
    return path


@contextlib.contextmanager
def turn(path: Path, *more: Path) -> Iterator[None]:
    """Hold the exclusive lock of `path`'s directory (one save of the directory at a
    time, in every thread and process), then clear what dead saves of `path` (and of
    `more`, in the same directory) left behind. Re-entrant in one thread: a save of
    several files takes one turn for all of them."""
    held = _HELD.__dict__.setdefault("directories", set())
    key = os.path.realpath(path.parent)
    if key in held:  # this thread's save of a checkpoint of several files
        for each in (path, *more):
            _clean(each)
        yield
        return
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.add(key)
        _settle(path.parent)
        for each in (path, *more):
            _clean(each)
        yield
    finally:
        held.discard(key)
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
    bits are kept; a new file gets the usual ones (the umask applied). Inside
    `atomic_files` naming `path`, the rename waits for the others'."""
    if path in getattr(_HELD, "group", ()):
        with written(path) as tmp:
            yield tmp
        return
    with turn(path), replacing(path) as tmp:
        yield tmp


@contextlib.contextmanager
def atomic_files(paths: list[Path]) -> Iterator[None]:
    """Replace several files of one directory as one: inside the block, each
    `atomic_file(path)` of `paths` writes and flushes its temporary; at the end, a
    journal naming them is written (the commit), then each is renamed in, then the
    journal removed. A save killed before the journal leaves every old file (its
    temporaries are cleared by the next save); after it, the next save of the
    directory, or a load (`reachable`), completes the renames. A path the block did
    not write is left as it is."""
    first = paths[0]
    journal = temporary(first, _JOURNAL)
    pending = temporary(first, _JOURNAL + "-tmp")
    with turn(first, *paths[1:]):
        _HELD.group = set(paths)
        try:
            yield
            written = [p.name for p in paths if temporary(p).is_file()]
            with open(pending, "w") as f:
                json.dump(written, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(pending, journal)  # the commit
            _fsync(first.parent)
        except BaseException:
            for p in paths:
                temporary(p).unlink(missing_ok=True)
            pending.unlink(missing_ok=True)
            raise
        finally:
            _HELD.group = ()
        _settle(first.parent)


def _settle(directory: Path) -> None:
    """Complete every commit of `atomic_files` in `directory` whose renames a killed
    save left undone (the caller holds the directory's turn)."""
    for journal in directory.glob(f".*.{_JOURNAL}"):
        try:
            names = json.loads(journal.read_text())
        except (OSError, ValueError):
            names = []
        for name in names if isinstance(names, list) else []:
            if isinstance(name, str) and "/" not in name:
                tmp = temporary(directory / name)
                if tmp.is_file():
                    os.replace(tmp, directory / name)
        _fsync(directory)
        journal.unlink(missing_ok=True)


def check_writable(path: Path) -> None:
    """`PermissionError` naming `path` where a save may not replace the file there:
    a file without any write bit (its owner's protection, refused for root too, who
    may write anything) or one this user may not write, or a directory holding it
    where this user may not create the temporary."""
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and (
            not st.st_mode & 0o222 or not os.access(path, os.W_OK)
        ):
            mode = st.st_mode & 0o7777
            raise PermissionError(
                errno.EACCES, _READ_ONLY_FILE.format(mode=mode), str(path)
            )
    parent = path.parent
    if parent.is_dir() and not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(
            errno.EACCES, _CANNOT_WRITE_IN.format(mode=_mode(parent) or 0), str(path)
        )


@contextlib.contextmanager
def written(path: Path) -> Iterator[Path]:
    """`replacing`'s first half: yield `path`'s temporary (an empty file) and flush
    what the writer put in it, without renaming it (the caller renames it with
    `commit`, once every file of a checkpoint is written). On any exception the
    temporary is removed. The caller holds `turn(path)`."""
    check_writable(path)
    tmp = temporary(path)
    try:
        tmp.touch(exist_ok=False)
        mode = _mode(path)
        mode = _mode(tmp) if mode is None else mode
        with _naming(path, tmp):
            yield tmp
        os.chmod(tmp, 0o644 if mode is None else mode)  # the writer's may differ
        _fsync(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def commit(path: Path) -> None:
    """Rename `path`'s temporary (made by `written`) over `path`."""
    os.replace(temporary(path), path)


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """`atomic_file` for a caller holding `turn(path)` already."""
    try:
        with written(path) as tmp:
            yield tmp
        commit(path)
    finally:
        temporary(path).unlink(missing_ok=True)
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
def atomic_dir(
    path: Path,
    is_checkpoint: Callable[[Path], bool],
    keep: Callable[[str], bool] | None = None,
    in_place: Callable[[Path, Path], bool] | None = None,
) -> Iterator[Path]:
    """Yield a temporary directory path next to `path` (not yet created); on success,
    flush it and swap it with `path` atomically (where the system cannot, the old
    directory is moved aside first and put back if the process dies before the new
    one is in place, at the next save; or, with `in_place`, `in_place(tmp, path)`
    moves the new files into the old directory itself, a whole checkpoint there at
    every moment, and returns True, or returns False having changed nothing).

    An existing `path` is replaced only when `is_checkpoint(path)` is true, and only
    when this user may write it (a `chmod 555` folder is refused, naming it). With
    `keep`, every file of the old directory that the writer did not write and
    `keep(name)` accepts (a tokenizer, a README beside the weights) is linked (or
    copied) into the new one before the swap.
    """
    old = reachable(path)
    if os.path.lexists(old) and not (old.is_dir() and is_checkpoint(old)):
        raise FileExistsError(_NOT_A_CHECKPOINT.format(path=path))
    if old.is_dir() and not os.access(old, os.W_OK | os.X_OK):
        raise PermissionError(
            errno.EACCES, _READ_ONLY.format(mode=_mode(old) or 0), str(path)
        )
    # with several processes (`jax.distributed`), process 0 alone takes the turn,
    # clears, swaps and cleans; the others write into the same temporary
    primary = jax.process_index() == 0
    with turn(path) if primary else contextlib.nullcontext():
        _barrier(f"bridge.save {path}: cleared")
        tmp = temporary(path)
        try:
            with _naming(path, tmp):
                yield tmp  # returns after the writer's own barrier (orbax's)
            if primary and keep is not None:
                carry(path, tmp, keep)
            if primary:
                mode = _mode(path)
                if mode is not None:
                    os.chmod(tmp, mode)
                for sub in sorted(tmp.rglob("*"), reverse=True):
                    _fsync(sub)
                _fsync(tmp)
                if not (path.exists() and _exchange(tmp, path)) and not (
                    in_place is not None and path.is_dir() and in_place(tmp, path)
                ):
                    aside = temporary(path, _OLD)
                    if path.exists():
                        os.rename(path, aside)
                    os.rename(tmp, path)
                    _remove(aside)
        finally:
            if primary:
                _clean(path)  # the old version, orbax's temporaries
        _barrier(f"bridge.save {path}: in place")  # none returns before the swap
        _fsync(path.parent)


def carry(old: Path, new: Path, keep: Callable[[str], bool]) -> None:
    """Every entry of directory `old` that `new` lacks and `keep(name)` accepts,
    linked (or copied) into `new`."""
    if not old.is_dir():
        return
    for item in old.iterdir():
        if not keep(item.name) or os.path.lexists(new / item.name):
            continue
        if item.is_dir() and not item.is_symlink():
            shutil.copytree(item, new / item.name, symlinks=True)
            continue
        try:
            os.link(item, new / item.name, follow_symlinks=False)
        except OSError:
            shutil.copy2(item, new / item.name, follow_symlinks=False)


def _barrier(name: str) -> None:
    """Wait for every process of a multi-process run (a no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
