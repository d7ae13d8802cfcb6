"""The sharded Hugging Face format: `model.safetensors.index.json` maps each array's
name to the shard file holding it (`model-00001-of-00003.safetensors`, ...), all in
one directory. Opening reads the index (a regular file of bounded size, checked as a
shard is) and every shard's header (no array); arrays are then read shard after
shard. The shards are held by one `_files.Files`: at most `Files.limit` open at once,
each opened again when read again and checked to be the file whose header was read,
all closed with the checkpoint (never after "its last name": a stacked array is read
again for each layer it is sliced into).

A load reads the index and every shard through one opened directory (the folder as
it was when the load began: a folder swapped whole by a save is read from the version
first opened), and checks, once every shard's header is read, that the index is still
the file it read: a checkpoint replaced meanwhile is read again from the start (a few
times), never mixed with its successor.

Saving to a `*.safetensors.index.json` path writes one shard and its index, as one:
the shard under a name the index at the path does not use (`NAME-00001-of-00001`,
else `NAME-00001-of-00001.b`), then the index (the rename that switches versions),
then the shards only the old index named are removed. A save killed at any step
leaves the old or the new checkpoint whole; the next save removes the shards no index
names. Saves of the directory take turns (`_atomic.turn`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from collections.abc import Iterator, Mapping, Set as AbstractSet
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .._shown import shown, some
from . import _safetensors
from ._atomic import atomic_file, turn
from ._contents import Contents, Malformed, decode, encode
from ._errors import CheckpointError, unreadable
from ._files import (
    Files,
    Identity,
    MissingCheckpoint,
    identity,
    open_directory,
    open_regular,
    read_whole,
)
from ._format import Format, register_format


NAME = "sharded"
INDEX_SUFFIX = ".safetensors.index.json"
INDEX_LIMIT = 100_000_000  # bytes, as a safetensors header's

_SEVERAL = "{path} holds several index files ({names}): point at the one to load."
_BAD_INDEX = "its 'weight_map' does not map array names to shard file names"
_OUTSIDE = "shard {name} is not a file name in the index's directory"
_NOT_IN_SHARD = (
    "the index maps {count} name(s) to {shard}, which does not hold them: {names}"
)
_TWICE = "the index maps {names} more than once"
_NOT_MAPPED = (
    "{shard} holds {count} array(s) the index does not map to it: {names} "
    "(Hugging Face reads every array of a shard; bridge reads what the index maps, "
    "so the two would load different models): write the index again with every "
    "array of each shard, e.g. by saving the checkpoint again"
)
_NO_SHARD = (
    "{index}: shard {shard} is missing (the index maps {count} name(s) to it: "
    "{names}); the folder is incomplete, e.g. a download that stopped: download "
    "the shard, or save the checkpoint again."
)


class _MissingShard(MissingCheckpoint):
    """A shard the index names is not in its folder, and the index was not replaced
    while it was read: final, not read again."""


_TOO_BIG = "the index is {size} bytes, more than the {limit} an index may have"


_HF_WEIGHTS = "model.safetensors"


def index_of(path: Path) -> Path | None:
    """The index file of the sharded checkpoint in directory `path`, else None: none
    in a folder holding `model.safetensors` (a Hugging Face folder, which
    transformers reads from that file first, whatever index lies beside it; a save
    replacing the folder in place passes through such a state)."""
    if (path / _HF_WEIGHTS).is_file():
        return None
    found = sorted(path.glob("*" + INDEX_SUFFIX))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise unreadable(path, NAME, _SEVERAL.format(path=path, names=names))
    return found[0] if found else None


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = [k for k, _ in pairs if k in seen or seen.add(k)]
        raise Malformed(_TWICE.format(names=some(sorted(set(twice)))))
    return out


def _read_index(index: Path, dir_fd: int | None = None) -> tuple[Any, Identity]:
    """The index's JSON and the identity of the file read, read as a shard is (a
    regular file, opened without blocking, of bounded size, unchanged while read)."""
    fd = open_regular(index, NAME, dir_fd=dir_fd)
    try:
        ident = identity(fd)
        if ident.size > INDEX_LIMIT:
            raise Malformed(_TOO_BIG.format(size=ident.size, limit=INDEX_LIMIT))
        text = read_whole(fd, index, NAME)
    finally:
        os.close(fd)
    try:
        return json.loads(text.decode("utf-8"), object_pairs_hook=_unique), ident
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError: not JSON, or an integer of more digits than Python converts
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise Malformed(f"the index is not JSON ({reason[:200]})") from None


def _weight_map(
    index: Path, dir_fd: int | None = None
) -> tuple[dict[Path, list[str]], Identity]:
    """Each shard with the names the index maps to it, in order of first mention,
    and the identity of the index read."""
    data, ident = _read_index(index, dir_fd)
    mapping = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(mapping, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
    ):
        raise Malformed(_BAD_INDEX)
    out: dict[Path, list[str]] = {}
    for name, shard in mapping.items():
        if (
            "\x00" in shard
            or "/" in shard
            or shard in ("", ".", "..")
            or Path(shard).name != shard
        ):
            raise Malformed(_OUTSIDE.format(name=shown(shard)))
        out.setdefault(index.parent / shard, []).append(name)
    return out, ident


class Source(NamedTuple):
    """Each shard's `Contents` with the names read from it; `files` holds every
    shard (closed with the checkpoint)."""

    shards: tuple[tuple[Contents, tuple[str, ...]], ...]
    files: Files

    def close(self) -> None:
        self.files.close()


class _Replaced(Exception):
    """The index was replaced (or its folder swapped) while the shards were opened."""


ATTEMPTS = 5  # reads of a checkpoint replaced while it is read, before refusing
_REPLACED = (
    "it was replaced {n} times while it was read (a save of the same path is "
    "running): load it again once the writer is done"
)


def _same(dir_fd: int, index: Path, ident: Identity) -> bool:
    """Whether the directory opened is still the one at the index's directory, and
    the index at its name in it still the file read."""
    try:
        st = os.stat(index.name, dir_fd=dir_fd, follow_symlinks=True)
        here, opened = os.stat(index.parent), os.fstat(dir_fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (opened.st_dev, opened.st_ino) and (
        st.st_dev,
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
    ) == tuple(ident)


def metadata(path: Path) -> Contents:
    """The `Contents` of the sharded checkpoint whose index is `path`: every shard's
    header read (at most `Files.limit` shards open at once; closed by
    `Contents.close`), through one opened directory; read again if the index was
    replaced meanwhile. A shard written by `bridge.save` keeps its metadata (roles,
    framework, modules, training state)."""
    for _ in range(ATTEMPTS):
        try:
            return _metadata(path)
        except _Replaced:
            continue
        except MissingCheckpoint as e:  # the folder opened was swapped away and
            # emptied meanwhile: read the one there now; else missing
            if isinstance(e, _MissingShard) or not path.exists():
                raise
    raise unreadable(path, NAME, _REPLACED.format(n=ATTEMPTS))


def _metadata(path: Path) -> Contents:
    files = Files(directory=open_directory(path.parent))
    ident: Identity | None = None
    try:
        weight_map, ident = _weight_map(path, files.directory)
        opened: list[tuple[Contents, tuple[str, ...]]] = []
        meta: dict[str, str] | None = None
        shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        for shard, names in weight_map.items():
            try:
                contents = _safetensors.metadata(shard, files)
            except MissingCheckpoint:
                assert files.directory is not None
                if not _same(files.directory, path, ident):
                    raise _Replaced from None  # a shard of the old version, gone
                raise _MissingShard(
                    errno.ENOENT,
                    _NO_SHARD.format(
                        index=path,
                        shard=shown(shard.name),
                        count=len(names),
                        names=some(names),
                    ),
                ) from None
            opened.append((contents, tuple(names)))
            held = {s.key: s for s in contents.tensors}
            missing = [n for n in names if n not in held]
            if missing:
                raise Malformed(
                    _NOT_IN_SHARD.format(
                        count=len(missing), shard=shard.name, names=some(missing)
                    )
                )
            mapped = set(names)
            unmapped = [k for k in held if k not in mapped]
            if unmapped:
                raise Malformed(
                    _NOT_MAPPED.format(
                        shard=shard.name, count=len(unmapped), names=some(unmapped)
                    )
                )
            if meta is None:
                meta = encode(contents) if contents.version else dict(contents.metadata)
            shapes.update({n: (held[n].shape, held[n].dtype) for n in names})
        assert files.directory is not None
        if not _same(files.directory, path, ident):
            raise _Replaced
        return decode(path, NAME, meta or {}, shapes, Source(tuple(opened), files))
    except (Malformed, CheckpointError) as e:
        replaced = (
            ident is not None
            and files.directory is not None
            and not _same(files.directory, path, ident)
        )
        files.close()
        if replaced:  # a shard of the old version is gone, or another's read
            raise _Replaced from None
        if isinstance(e, Malformed):
            raise unreadable(path, NAME, str(e)) from None
        raise
    except BaseException:
        files.close()
        raise


def restore(
    contents: Contents, shardings: Mapping[str, Any]
) -> Iterator[tuple[str, np.ndarray]]:
    """Each array, shard after shard (several at a time: `_safetensors.read_many`)."""
    wanted = {s.key for s in contents.tensors}
    source: Source = contents.source
    for shard, names in source.shards:
        yield from _safetensors.read_many(shard, [n for n in names if n in wanted])


def files(contents: Contents) -> dict[str, str]:
    """`{array name: its shard's file name}`."""
    source: Source = contents.source
    return {name: shard.path.name for shard, names in source.shards for name in names}


_SHARD = re.compile(r"(?P<stem>.+)-\d{5}-of-\d{5}(\.b)?\.safetensors")


def _named(directory: Path) -> set[str]:
    """The shard file names the index files in `directory` map to (an unreadable
    index names none)."""
    named: set[str] = set()
    for index in directory.glob("*" + INDEX_SUFFIX):
        try:
            named |= {p.name for p in _weight_map(index)[0]}
        except (OSError, CheckpointError, Malformed):
            pass
    return named


def _unnamed(
    directory: Path, stem: str, also: AbstractSet[str] = frozenset()
) -> list[Path]:
    """The shards of `stem` (`STEM-0000i-of-0000n[.b].safetensors`), and the files
    `also`, that no index of `directory` names: left by a save that died, or named
    only by the index just replaced."""
    named = _named(directory)
    return [
        p
        for p in directory.iterdir()
        if p.name not in named
        and (p.name in also or ((m := _SHARD.fullmatch(p.name)) and m["stem"] == stem))
    ]


def _save(path: Path, contents: Contents, arrays: Mapping[str, Any]) -> None:
    """One shard (with bridge's metadata) under a name the index at `path` does not
    use, the index naming it, then the old shards removed (see the module's
    docstring): one whole checkpoint at `path` at every moment."""
    stem = path.name[: -len(INDEX_SUFFIX)]
    first = f"{stem}-00001-of-00001.safetensors"
    with turn(path):
        for stale in _unnamed(path.parent, stem):  # left by a save that died
            with contextlib.suppress(OSError):
                stale.unlink()
        try:
            taken = {p.name for p in _weight_map(path)[0]}
        except (OSError, CheckpointError, Malformed):
            taken = set()
        shard = (
            first
            if first not in taken
            else first[: -len(".safetensors")] + ".b.safetensors"
        )
        _safetensors.save(path.parent / shard, contents, arrays)
        total = sum(s.nbytes for s in contents.tensors)
        index = {
            "metadata": {"total_size": total},
            "weight_map": {s.key: shard for s in contents.tensors},
        }
        with atomic_file(path) as tmp, open(tmp, "w") as f:
            json.dump(index, f)
        for old in _unnamed(path.parent, stem, taken):  # the next save retries
            with contextlib.suppress(OSError):
                old.unlink()


FORMAT = register_format(
    Format(
        NAME,
        (INDEX_SUFFIX,),
        "*" + INDEX_SUFFIX + ": a sharded Hugging Face checkpoint, read shard by "
        "shard (written as one shard)",
        _save,
        metadata,
        restore,
        _safetensors.FORMAT.dtypes,
        lazy=lambda contents: _safetensors.lazy(contents, contents.source),
        probe=index_of,
        files=files,
    )
)
