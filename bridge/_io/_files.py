"""Reading a checkpoint file safely: refuse anything but a regular file (a FIFO would
block, a device never ends), read exactly the bytes asked for, and never mix two
versions of a file: every read checks that the file is the one whose header was read
(`Identity`: device, inode, size, modification time), before and after.

`Files` holds the open files of one checkpoint being read: each opened when a read
needs it and kept open while reads use it, at most `Files.limit` open at once (the
least recently used is closed, and opened again when read again, its identity
checked), all closed with the checkpoint. A sharded checkpoint of thousands of shards
loads under the usual 1,024-descriptor limit, and no read ever uses a descriptor
number closed meanwhile (it may belong to another file by then). Its `pool` holds the
host buffers the reads fill (`bridge._buffers.Pool`: reused once their arrays are gone,
dropped with the checkpoint). The files of a checkpoint of several files are opened
through one opened directory (`open_directory`): a folder swapped for its next
version while it is read is read whole from the version first opened, or refused.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from .._buffers import Pool
from ._errors import CheckpointError, unreadable


class _OSCheckpointError(CheckpointError):
    """A `CheckpointError` that is also an `OSError`, made as one:
    `(errno, message)`. `ValueError` comes first in its classes, so `OSError`'s own
    constructor never ran: `errno` and `strerror` were None and `str()` the tuple
    `(2, '...')`; here they are the code and the message."""

    def __init__(self, code: int, message: str):
        super().__init__(code, message)
        self.errno, self.strerror = code, message  # type: ignore[attr-defined]

    def __str__(self) -> str:
        return str(self.args[-1])


class MissingCheckpoint(_OSCheckpointError, FileNotFoundError):
    """No file or directory at the path (also a `FileNotFoundError`)."""


class DeniedCheckpoint(_OSCheckpointError, PermissionError):
    """The checkpoint exists but may not be read (also a `PermissionError`)."""


def missing(path: Path) -> MissingCheckpoint:
    return MissingCheckpoint(errno.ENOENT, f"{path}: no such file or directory.")


def denied(path: Path) -> DeniedCheckpoint:
    return DeniedCheckpoint(
        errno.EACCES,
        f"{path}: permission denied: the checkpoint exists but this user may not "
        "read it (check its mode and owner).",
    )


def _kind(mode: int) -> str:
    for test, name in [
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ]:
        if test(mode):
            return name
    return "not a regular file"


def open_regular(
    path: Path, fmt: str, *, follow: bool = True, dir_fd: int | None = None
) -> int:
    """A read-only descriptor of the regular file at `path`.

    Opened non-blocking (a FIFO does not wait for a writer) and checked with `fstat`
    on the descriptor itself, so the file checked is the file read. `follow=False`
    refuses a symlink. With `dir_fd` (an open directory, `open_directory`), the file
    named `path.name` in that very directory, whatever is at `path`'s directory now.
    Raises `CheckpointError` (or its `FileNotFoundError` and `PermissionError` kinds)
    naming the file.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    if not follow:
        flags |= os.O_NOFOLLOW
    try:
        if dir_fd is None:
            fd = os.open(path, flags)
        else:
            fd = os.open(path.name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise missing(path) from None
    except PermissionError:
        raise denied(path) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise unreadable(path, fmt, "it is a symbolic link") from None
        raise unreadable(path, fmt, e.strerror or str(e)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise unreadable(path, fmt, f"it is {_kind(mode)}, not a regular file")
    return fd


def open_directory(path: Path) -> int:
    """A descriptor of the directory at `path`, through which the files of one
    checkpoint are opened (`open_regular(..., dir_fd=)`): a directory swapped for
    another meanwhile (a save of the same folder) is never mixed with it."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise missing(path) from None
    except PermissionError:
        raise denied(path) from None


def size(fd: int) -> int:
    """The size in bytes of the open file `fd`."""
    return os.fstat(fd).st_size


def read_at(fd: int, offset: int, count: int, into: memoryview | None = None) -> bytes:
    """Exactly `count` bytes of `fd` from `offset` (into `into` when given); raises
    `EOFError` if the file ends first (it shrank since its header was read)."""
    buffer = into if into is not None else memoryview(bytearray(count))
    read_into(fd, offset, [buffer[:count]])
    return bytes(buffer) if into is None else b""


def read_into(fd: int, offset: int, buffers: list[memoryview]) -> None:
    """Fill `buffers` (at most `os.sysconf("SC_IOV_MAX")`, 1,024 on Linux) with the
    bytes of `fd` from `offset` on, one after the other, in as few positioned reads
    as the system allows (one, from the page cache); raises `EOFError` if the file
    ends first."""
    left = [b.cast("B") for b in buffers if b.nbytes]
    count = sum(b.nbytes for b in left)
    done = 0
    while left:
        n = os.preadv(fd, left, offset + done)
        if n == 0:
            raise EOFError(f"the file ended {count - done} bytes early")
        done += n
        while left and n >= left[0].nbytes:
            n -= left.pop(0).nbytes
        if n:
            left[0] = left[0][n:]


class Identity(NamedTuple):
    """What tells one version of a file from another: a file replaced (`os.replace`)
    has another inode, one rewritten in place another size or modification time."""

    device: int
    inode: int
    size: int
    mtime_ns: int


def inode(path: str | os.PathLike) -> tuple[int, int] | None:
    """Which file or directory is at `path` now, `(device, inode)` (None: none): a
    directory a save swapped in has another."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def identity(fd: int) -> Identity:
    st = os.fstat(fd)
    return Identity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_CHANGED = (
    "it changed while it was read (its {what} differs from when its header was "
    "read): another process rewrote or replaced it. Load it again once the writer "
    "is done"
)


def check_same(fd: int, path: Path, fmt: str, expected: Identity) -> None:
    """`CheckpointError` naming the file if it is no longer the version `expected`."""
    now = identity(fd)
    if now != expected:
        what = "inode" if now[:2] != expected[:2] else "size or modification time"
        raise unreadable(path, fmt, _CHANGED.format(what=what))


def read_whole(fd: int, path: Path, fmt: str) -> bytes:
    """The whole file, checked unchanged from before the read to after it."""
    before = identity(fd)
    data = read_at(fd, 0, before.size)
    check_same(fd, path, fmt, before)
    return data


class _File(NamedTuple):
    path: Path
    fmt: str
    identity: Identity


class Files:
    """The open files of one checkpoint being read (see the module's docstring).

    `add(path, fmt, fd, identity)` takes a descriptor whose header was read (the
    file's identity taken before that read); `reading(key)` gives a descriptor of the
    file for one read, opening it again if it was closed, and checks its identity
    before and after the read; `pool` gives the memory reads go into; `close()`
    closes every file and empties the pool. Safe from several threads.
    """

    limit = 64

    def __init__(self, limit: int | None = None, directory: int | None = None):
        """`directory`: an open directory (`open_directory`) the files are opened
        again from, closed with the files."""
        if limit is not None:
            self.limit = limit
        self.directory = directory
        self._files: list[_File] = []
        self._open: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._users: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()
        self.pool = Pool()

    def add(self, path: Path, fmt: str, fd: int, ident: Identity) -> int:
        check_same(fd, path, fmt, ident)  # unchanged while its header was read
        with self._lock:
            key = len(self._files)
            self._files.append(_File(path, fmt, ident))
            self._open[key] = fd
            self._trim()
        return key

    @contextlib.contextmanager
    def reading(self, key: int) -> Iterator[int]:
        path, fmt, ident = self._files[key]
        with self._lock:
            self._users[key] += 1
            fd = self._open.pop(key, None)
            if fd is not None:
                self._open[key] = fd  # the most recently used
        try:
            if fd is None:
                fd = self._reopen(key)
            check_same(fd, path, fmt, ident)
            yield fd
            check_same(fd, path, fmt, ident)
        finally:
            with self._lock:
                self._users[key] -= 1
                self._trim()

    def _reopen(self, key: int) -> int:
        path, fmt, ident = self._files[key]
        try:
            fd = open_regular(path, fmt, dir_fd=self.directory)
        except CheckpointError:
            raise unreadable(path, fmt, _CHANGED.format(what="path")) from None
        with self._lock:
            other = self._open.pop(key, None)  # another thread opened it meanwhile
            self._open[key] = fd
        if other is not None:
            os.close(other)
        return fd

    def _trim(self) -> None:
        """Close the least recently used files no read is using, down to `limit`."""
        idle = [k for k in self._open if not self._users[k]]
        for key in idle[: max(0, len(self._open) - self.limit)]:
            os.close(self._open.pop(key))

    def close(self) -> None:
        with self._lock:
            for fd in self._open.values():
                os.close(fd)
            self._open.clear()
            if self.directory is not None:
                os.close(self.directory)
                self.directory = None
        self.pool.close()
