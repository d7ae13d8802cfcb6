"""The orbax format: a checkpoint directory whose item `state` holds the arrays (a
nested dict, with orbax's own sharding metadata) and item `bridge` the metadata
strings (JSON).

The metadata is read by bridge itself (one JSON file, no orbax import, no symlink
followed, bounded in size); the arrays by orbax, after checking that nothing in
`state` is a symlink or a special file (orbax would follow it out of the directory).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import stat
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ._atomic import atomic_dir
from ._contents import DTYPE_NAMES, Contents, Malformed, decode, encode
from ._errors import CheckpointError, unreadable
from ._files import missing, open_regular, read_whole, size
from ._format import Format, formats, register_format


# orbax.checkpoint is imported by the functions that use it: importing it costs about
# 0.35 s, which `import bridge` should not pay when no orbax checkpoint is touched.


NAME = "orbax"
_ORBAX = threading.Lock()  # orbax's checkpointers fail when threads run them at once
ARRAYS, METADATA = "state", "bridge"
_METADATA_FILE = "metadata"  # orbax's JsonSave file name inside the item
_METADATA_LIMIT = 100_000_000  # bytes
_ORBAX_METADATA = "_METADATA"  # what orbax writes in an item that holds arrays

_NOT_A_CHECKPOINT = """\
{path} is a directory but not a checkpoint written by bridge.save (no '{arrays}' and \
'{metadata}' items). Point at the checkpoint directory itself."""

_UNKNOWN_SUFFIX = """\
{path}: unknown checkpoint format '{suffix}': bridge reads {known}."""


def is_checkpoint(path: Path) -> bool:
    """Whether the directory looks like an orbax checkpoint written by bridge."""
    return (path / METADATA).is_dir() and (path / ARRAYS).is_dir()


def save(path: Path, contents: Contents, arrays: Mapping[str, Any]) -> None:
    """Write the arrays as a nested dict (by path) and the metadata, atomically as
    directory `path`. Zero-size arrays are described by the metadata alone (orbax
    refuses them), and a model without arrays writes an empty `state`."""
    import orbax.checkpoint as ocp

    nested: dict[str, Any] = {}
    for s in contents.tensors:
        if math.prod(s.shape) == 0:
            continue
        node = nested
        for key in map(str, s.path[:-1]):
            node = node.setdefault(key, {})
        node[str(s.path[-1])] = arrays[s.key]
    items: dict[str, Any] = {METADATA: ocp.args.JsonSave(encode(contents))}
    if nested:
        items[ARRAYS] = ocp.args.StandardSave(nested)
    with atomic_dir(path, is_checkpoint) as tmp, _ORBAX, _held_orbax_errors():
        before = set(threading.enumerate())
        try:
            with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
                checkpointer.save(tmp.absolute(), ocp.args.Composite(**items))
        except BaseException as e:
            _join_writers(before)
            if isinstance(e, ValueError):  # orbax reports write failures so
                raise _write_error(path, e) from e
            raise
        (tmp / ARRAYS).mkdir(exist_ok=True)


_WRITERS_TIMEOUT = 300.0  # seconds


def _join_writers(before: set[threading.Thread]) -> None:
    """Wait for the writer threads an orbax save started (those not in `before`)
    to end. When one write fails (a full disk), orbax raises at once while its
    other threads go on writing into the temporary directory: removed then, it is
    made again behind the failed save's back (and a save tried again at once would
    share it with them)."""
    for thread in set(threading.enumerate()) - before:
        if type(thread).__module__.startswith("orbax."):
            thread.join(_WRITERS_TIMEOUT)


@contextlib.contextmanager
def _held_orbax_errors() -> Iterator[None]:
    """Hold back the errors orbax's writer threads log (through absl, each with a
    traceback) while a save runs: when the save fails, its `OSError` says it once (a
    full disk printed two tracebacks above `bridge convert`'s one-line error); when it
    succeeds, they are logged as they came."""
    logger = logging.getLogger("absl")
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in (
            record.pathname
        ):
            held.append(record)
            return False
        return True

    logger.addFilter(hold)
    try:
        yield
    finally:
        logger.removeFilter(hold)
    for record in held:  # reached only when the save succeeded
        logger.handle(record)


def _write_error(path: Path, error: ValueError) -> OSError:
    """The `OSError` for orbax's report of a failed write."""
    text = str(error)
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS):
        if os.strerror(code) in text:
            return OSError(code, os.strerror(code), str(path))
    reason = (text.strip().splitlines() or [type(error).__name__])[0]
    return OSError(
        errno.EIO, f"orbax could not write the checkpoint: {reason}", str(path)
    )


def _default_sharding() -> jax.sharding.Sharding:
    """Where an array the caller places nowhere goes: this process's first device, or,
    with several processes, every device (replicated), which each process can read."""
    if jax.process_count() == 1:
        # jax 0.12.1 deprecates constructing the class; older ones lack the function
        make = getattr(jax.sharding, "make_single_device_sharding", None)
        if make is None:
            return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return make(jax.local_devices()[0])
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _known() -> str:
    files = [s for fmt in formats() for s in fmt.suffixes]
    return (
        " and ".join(f"*{s}" for s in files) + " files and orbax checkpoint directories"
    )


def _open_dir(name: str | Path, dir_fd: int | None = None) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    if dir_fd is not None:
        flags |= os.O_NOFOLLOW
    return os.open(name, flags, dir_fd=dir_fd)


def _metadata_text(path: Path) -> bytes:
    """The bytes of `bridge/metadata`, refusing symlinks and special files."""
    top = _open_dir(path)
    try:
        item = _open_dir(METADATA, dir_fd=top)
    except OSError:
        raise unreadable(path, NAME, f"'{METADATA}' is not a directory") from None
    finally:
        os.close(top)
    try:
        fd = os.open(
            _METADATA_FILE,
            os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
            dir_fd=item,
        )
    except OSError as e:
        raise unreadable(
            path, NAME, f"'{METADATA}/{_METADATA_FILE}': {e.strerror}"
        ) from None
    finally:
        os.close(item)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Malformed(f"'{METADATA}/{_METADATA_FILE}' is not a regular file")
        if size(fd) > _METADATA_LIMIT:
            raise Malformed(f"'{METADATA}/{_METADATA_FILE}' is over 100 MB")
        return read_whole(fd, path, NAME)
    except (Malformed, EOFError) as e:
        raise unreadable(path, NAME, str(e)) from None
    finally:
        os.close(fd)


def metadata(path: Path) -> Contents:
    """The `Contents` of the checkpoint directory, from its `bridge` item only."""
    if not path.is_dir():
        if not os.path.lexists(path):
            raise missing(path)
        if path.suffix:
            raise CheckpointError(
                _UNKNOWN_SUFFIX.format(path=path, suffix=path.suffix, known=_known())
            )
        open_regular(path, NAME)  # raises naming what it is (a FIFO, a device, ...)
        raise unreadable(path, NAME, "it is a file, not a checkpoint directory")
    if not is_checkpoint(path):
        raise CheckpointError(
            _NOT_A_CHECKPOINT.format(path=path, arrays=ARRAYS, metadata=METADATA)
        )
    try:
        meta = json.loads(_metadata_text(path))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise unreadable(path, NAME, f"its metadata is not JSON ({reason})") from None
    _check_tree(path)
    try:
        if not (
            isinstance(meta, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
        ):
            raise Malformed("its metadata is not a map of strings to strings")
        contents = decode(path, NAME, meta, None)
        if any(math.prod(s.shape) for s in contents.tensors) and not os.path.isfile(
            path / ARRAYS / _ORBAX_METADATA
        ):
            raise Malformed(
                f"its '{ARRAYS}' item holds no arrays (no {_ORBAX_METADATA})"
            )
        return contents
    except Malformed as e:
        raise unreadable(path, NAME, str(e)) from None


def _check_tree(path: Path) -> None:
    """Refuse symlinks and special files anywhere in the `state` item."""
    root = path / ARRAYS
    for here, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            mode = os.lstat(os.path.join(here, name)).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                where = os.path.relpath(os.path.join(here, name), path)
                what = "a symbolic link" if stat.S_ISLNK(mode) else "a special file"
                raise unreadable(path, NAME, f"'{where}' is {what}")


def restore(
    contents: Contents, shardings: Mapping[str, Any]
) -> Iterator[tuple[str, Any]]:
    """The arrays, restored by orbax with the shardings given (by name) or, when none
    is given, with their saved shardings; zero-size arrays from the metadata."""
    import orbax.checkpoint as ocp

    _check_tree(contents.path)  # again: the directory may have changed since
    stored = [s for s in contents.tensors if math.prod(s.shape) > 0]
    abstract: dict[str, Any] | None = None  # None: each array's saved sharding
    if shardings:
        abstract = {}
        default = _default_sharding()
        for s in stored:
            sharding = shardings.get(s.key) if s.prng_impl is None else None
            node = abstract
            for key in map(str, s.path[:-1]):
                node = node.setdefault(key, {})
            node[str(s.path[-1])] = jax.ShapeDtypeStruct(
                s.shape, s.dtype, sharding=sharding or default
            )
    restored: dict[str, Any] = {}
    if stored:
        try:  # orbax reads the files: any failure of it is the directory's
            with _ORBAX, ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as c:
                restored = c.restore(
                    contents.path.absolute(),
                    ocp.args.Composite(**{ARRAYS: ocp.args.StandardRestore(abstract)}),
                )[ARRAYS]
        except (ValueError, TypeError, KeyError, OSError) as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise unreadable(contents.path, NAME, reason) from None
    for s in contents.tensors:
        if math.prod(s.shape) == 0:
            yield s.key, np.zeros(s.shape, s.dtype)
            continue
        node = restored
        for key in map(str, s.path):
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            raise unreadable(contents.path, NAME, f"no array {s.key!r} in '{ARRAYS}'")
        yield s.key, node


FORMAT = register_format(
    Format(
        NAME,
        (),
        "any other path: an orbax checkpoint directory (shardings kept)",
        save,
        metadata,
        restore,
        DTYPE_NAMES - {"float8_e4m3", "uint2", "uint4"},  # tensorstore has not these
        places=True,
    )
)
