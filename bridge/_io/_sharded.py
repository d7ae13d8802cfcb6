"""The sharded Hugging Face format: `model.safetensors.index.json` maps each array's
name to the shard file holding it (`model-00001-of-00003.safetensors`, ...), all in
one directory. Opening reads every shard's header (no array); arrays are read shard
after shard, each shard's file closed once its arrays are read. Saving to a
`*.safetensors.index.json` path writes one shard and its index.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .._lazy import LazyArray
from . import _safetensors
from ._atomic import atomic_file
from ._contents import Contents, Malformed, decode
from ._errors import CheckpointError, unreadable
from ._format import Format, register_format


NAME = "sharded"
INDEX_SUFFIX = ".safetensors.index.json"

_SEVERAL = "{path} holds several index files ({names}): point at the one to load."
_BAD_INDEX = "its 'weight_map' does not map array names to shard file names"
_OUTSIDE = "shard {name!r} is not a file name in the index's directory"
_NOT_IN_SHARD = "the index maps {names} to {shard}, which does not hold them"


def index_of(path: Path) -> Path | None:
    """The index file of the sharded checkpoint in directory `path`, else None."""
    found = sorted(path.glob("*" + INDEX_SUFFIX))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise unreadable(path, NAME, _SEVERAL.format(path=path, names=names))
    return found[0] if found else None


def _weight_map(index: Path) -> dict[Path, list[str]]:
    """Each shard with the names the index maps to it, in order of first mention."""
    try:
        data = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise Malformed(f"the index is not JSON ({e})") from None
    mapping = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(mapping, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
    ):
        raise Malformed(_BAD_INDEX)
    out: dict[Path, list[str]] = {}
    for name, shard in mapping.items():
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise Malformed(_OUTSIDE.format(name=shard))
        out.setdefault(index.parent / shard, []).append(name)
    return out


class Source(NamedTuple):
    """Each shard's `Contents` (its file open) with the names read from it, and the
    positions of the shards closed already (each file is closed once: a closed
    descriptor's number may belong to another file by then)."""

    shards: tuple[tuple[Contents, tuple[str, ...]], ...]
    closed: set[int]

    def close_shard(self, i: int) -> None:
        if i not in self.closed:
            self.closed.add(i)
            self.shards[i][0].close()

    def close(self) -> None:
        for i in range(len(self.shards)):
            self.close_shard(i)


def metadata(path: Path) -> Contents:
    """The `Contents` of the sharded checkpoint whose index is `path`: every shard's
    header read, every shard open (closed by `Contents.close`)."""
    opened: list[tuple[Contents, tuple[str, ...]]] = []
    try:
        weight_map = _weight_map(path)
        meta: dict[str, str] = {}
        shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        for shard, names in weight_map.items():
            contents = _safetensors.metadata(shard)
            opened.append((contents, tuple(names)))
            held = {s.key: s for s in contents.tensors}
            missing = [n for n in names if n not in held]
            if missing:
                raise Malformed(_NOT_IN_SHARD.format(names=missing, shard=shard.name))
            if not meta:
                meta = dict(contents.metadata)
            shapes.update({n: (held[n].shape, held[n].dtype) for n in names})
        return decode(path, NAME, meta, shapes, Source(tuple(opened), set()))
    except Malformed as e:
        Source(tuple(opened), set()).close()
        raise unreadable(path, NAME, str(e)) from None
    except CheckpointError:
        Source(tuple(opened), set()).close()
        raise


def restore(
    contents: Contents, shardings: Mapping[str, Any]
) -> Iterator[tuple[str, np.ndarray]]:
    """Each array, shard after shard; a shard's file is closed once it is read."""
    wanted = {s.key for s in contents.tensors}
    source: Source = contents.source
    for i, (shard, names) in enumerate(source.shards):
        for name in names:
            if name in wanted:
                yield name, _safetensors.read_one(shard, name)
        source.close_shard(i)


class _Pending:
    """One shard's file, closed once each of its arrays has been read (a single file
    stays open: its `Contents` closes it)."""

    def __init__(self, contents: Contents, names: tuple[str, ...], close):
        self.contents = contents
        self.pending = set(names)
        self.close = close

    def read(self, name: str) -> np.ndarray:
        array = _safetensors.read_one(self.contents, name, own_pages=True)
        self.pending.discard(name)
        if not self.pending and self.close is not None:
            self.close()
        return array


def lazy(contents: Contents) -> dict[str, LazyArray]:
    """`{name: LazyArray}` for a safetensors or sharded checkpoint: each array read
    from its file when used, shard by shard (`LazyArray.order` is the shard's
    position)."""
    source = contents.source if contents.format == NAME else None
    if source is not None:
        shards = source.shards
    else:
        shards = ((contents, tuple(s.key for s in contents.tensors)),)
    stored = {s.key: s for s in contents.tensors}
    out = {}
    for order, (shard, names) in enumerate(shards):
        close = None if source is None else lambda i=order: source.close_shard(i)
        pending = _Pending(shard, names, close)
        for name in names:
            s = stored[name]
            out[name] = LazyArray(
                s.shape, s.dtype, order, lambda p=pending, n=name: p.read(n)
            )
    return out


def _save(path: Path, contents: Contents, arrays: Mapping[str, Any]) -> None:
    """One shard (`NAME-00001-of-00001.safetensors`, with bridge's metadata) and the
    index naming it, each written atomically, the shard first."""
    stem = path.name[: -len(INDEX_SUFFIX)]
    shard = f"{stem}-00001-of-00001.safetensors"
    _safetensors.save(path.parent / shard, contents, arrays)
    total = sum(s.nbytes for s in contents.tensors)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {s.key: shard for s in contents.tensors},
    }
    with atomic_file(path) as tmp, open(tmp, "w") as f:
        json.dump(index, f)


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
    )
)
