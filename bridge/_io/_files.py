"""Reading a checkpoint file safely: open it once, refuse anything but a regular file
(a FIFO would block, a device never ends), and read exactly the bytes asked for."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ._errors import CheckpointError, unreadable


class MissingCheckpoint(CheckpointError, FileNotFoundError):
    """No file or directory at the path (also a `FileNotFoundError`)."""


class DeniedCheckpoint(CheckpointError, PermissionError):
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


def open_regular(path: Path, fmt: str, *, follow: bool = True) -> int:
    """A read-only descriptor of the regular file at `path`.

    Opened non-blocking (a FIFO does not wait for a writer) and checked with `fstat`
    on the descriptor itself, so the file checked is the file read. `follow=False`
    refuses a symlink. Raises `CheckpointError` (or its `FileNotFoundError` and
    `PermissionError` kinds) naming the file.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    if not follow:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
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


def size(fd: int) -> int:
    """The size in bytes of the open file `fd`."""
    return os.fstat(fd).st_size


def read_at(fd: int, offset: int, count: int, into: memoryview | None = None) -> bytes:
    """Exactly `count` bytes of `fd` from `offset` (into `into` when given); raises
    `EOFError` if the file ends first (it shrank since its header was read)."""
    buffer = into if into is not None else memoryview(bytearray(count))
    done = 0
    while done < count:
        n = os.preadv(fd, [buffer[done:count]], offset + done)
        if n == 0:
            raise EOFError(f"the file ended {count - done} bytes early")
        done += n
    return bytes(buffer) if into is None else b""
