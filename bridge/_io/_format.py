"""The format registry: each checkpoint format is one `Format` record, registered once.

A format is shaped like orbax's `CheckpointHandler` (`save`, `restore` and a cheap
`metadata` read) and lives in one module, as safetensors keeps one module per
framework: `_safetensors.py`, `_msgpack.py` and `_orbax.py` each register theirs. A
path's format is chosen by its file name's suffix (the longest registered suffix
that ends it); a path no suffix claims is a directory checkpoint (orbax).

A format states what it can do in its record (reads lazily, places arrays itself,
holds a training state, writes plain files, finds itself in a directory), and
`save`, `load`, `bridge inspect` and `bridge convert` ask it: no code outside a
format's module names a format. Adding a format is one module that builds a `Format`
and calls `register_format`, imported by `bridge._io._checkpoint` (or, for a format
of a layer above, by that layer: GGUF's by `bridge._quant`); or a
`register_format` call anywhere before use (`tests/test_formats.py` registers a toy
format from inside a test).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from .._lazy import LazyArray
from ._contents import Contents


class Format(NamedTuple):
    """A checkpoint format.

    - `name`: how users and the metadata call it (`"safetensors"`).
    - `suffixes`: file names ending so are in this format (`(".safetensors",)`); `()`
      for the directory format, which every path no suffix claims is in.
    - `summary`: one line for `bridge --help` (`"*.safetensors: one safetensors
      file, read lazily"`).
    - `save(path, contents, arrays)`: write `arrays` (`{dotted name: array}`, typed
      PRNG keys already as their key data) with `contents`' metadata, atomically.
    - `metadata(path)`: the `Contents` of the checkpoint at `path`, from its header
      only (cheap: no array is read), with `source` holding what it opened; raises
      `CheckpointError` naming the file for anything unreadable.
    - `restore(contents, shardings)`: each array as `(name, array)`, one at a time,
      from `contents.source` (a host `numpy` array, or a `jax.Array` already placed
      with `shardings[name]` where the format places arrays itself).
    - `dtypes`: the dtype names it stores and reads back exactly; `None`: any.

    Its capabilities, asked by `save` and `load` (the defaults: a format that reads
    every array when asked, places none, holds a training state, writes no plain
    file and finds nothing in a directory):

    - `lazy(contents)`: `{name: LazyArray}` reading each array from
      `contents.source` only when used (a load of another framework's file then
      ports layer by layer, holding about one array of the file); `None`: the
      arrays are read whole by `restore`.
    - `places`: `restore` gives arrays already placed by `shardings` and reads the
      whole checkpoint at once (orbax): a load into `like` passes it every array,
      the training state's too.
    - `training`: whether it holds a training checkpoint (the optimizer state's
      structure is recorded in its metadata); `False`: arrays only (msgpack).
    - `order`: whether it keeps the order of use a file records
      (`Contents.order`: `save(..., example=...)`), which ports it into a model
      with other names; `False`: no metadata to hold it (msgpack).
    - `save_plain(path, contents, arrays, meta)`: write with `meta` as the whole
      metadata, no bridge keys (a file as another library writes it:
      `save_state_dict`); `None`: it writes no such file.
    - `probe(directory)`: the file of this format inside a directory given as a
      checkpoint (a Hugging Face `save_pretrained` folder's `model.safetensors`),
      else None. Formats are probed longest suffix first, as `format_of` chooses.
    - `files(contents)`: `{array name: file name}` for a checkpoint of several
      files (the shards of a sharded folder; `bridge inspect` shows the column);
      `None`: one file.
    - `rename(contents, target)`: for a format whose files name layers their own
      way, `contents` under the names `target` (a Tree) gives its layers where it
      can (a GGUF Llama file under Hugging Face's names), else as it is; `None`:
      the names are the file's own.
    """

    name: str
    suffixes: tuple[str, ...]
    summary: str
    save: Callable[[Path, Contents, Mapping[str, Any]], None]
    metadata: Callable[[Path], Contents]
    restore: Callable[[Contents, Mapping[str, Any]], Iterable[tuple[str, Any]]]
    dtypes: frozenset[str] | None = None
    lazy: Callable[[Contents], Mapping[str, LazyArray]] | None = None
    places: bool = False
    training: bool = True
    order: bool = True
    save_plain: Callable[[Path, Contents, Mapping[str, Any], dict], None] | None = None
    probe: Callable[[Path], Path | None] | None = None
    files: Callable[[Contents], Mapping[str, str]] | None = None
    rename: Callable[[Contents, Any], Contents] | None = None


_FORMATS: dict[str, Format] = {}

_TAKEN = """\
A checkpoint format named {name!r} is registered already; formats are registered once \
(pick another name)."""

_SUFFIX_TAKEN = "The suffix {suffix!r} is the {other!r} format's already."

_TWO_DIRECTORIES = """\
{name!r} and {other!r} would both be directory formats (no suffixes); only one format \
may claim the paths no suffix claims."""


def register_format(fmt: Format) -> Format:
    """Register `fmt` (refusing a second format of the same name, a suffix another
    format has, or a second directory format) and return it."""
    if not isinstance(fmt, Format):
        raise TypeError(f"`fmt` must be a Format, got {type(fmt).__name__}.")
    if fmt.name in _FORMATS:
        raise ValueError(_TAKEN.format(name=fmt.name))
    for other in _FORMATS.values():
        for suffix in set(fmt.suffixes) & set(other.suffixes):
            raise ValueError(_SUFFIX_TAKEN.format(suffix=suffix, other=other.name))
        if not fmt.suffixes and not other.suffixes:
            raise ValueError(_TWO_DIRECTORIES.format(name=fmt.name, other=other.name))
    _FORMATS[fmt.name] = fmt
    return fmt


_LOADED = False


def load_builtins() -> None:
    """Register every built-in format (once), as importing `bridge`'s public names
    does: their modules register themselves (`_io`'s, and GGUF's from `_quant`), so
    a program that imported a private module first (`bridge._io._read`; `import
    bridge` imports its names on first use) finds them all."""
    global _LOADED
    if not _LOADED:
        _LOADED = True
        importlib.import_module("bridge")._load()


def formats() -> tuple[Format, ...]:
    """Every registered format, by name."""
    load_builtins()
    return tuple(sorted(_FORMATS.values(), key=lambda f: f.name))


def probing() -> tuple[Format, ...]:
    """The formats that find themselves inside a directory (`probe`), in the order a
    directory is probed: longest suffix first."""
    load_builtins()
    found = [f for f in _FORMATS.values() if f.probe is not None]
    return tuple(sorted(found, key=lambda f: -max(map(len, f.suffixes), default=0)))


def format_named(name: str) -> Format:
    """The registered format called `name`."""
    load_builtins()
    return _FORMATS[name]


def format_of(path: Path) -> Format:
    """The format of `path`, by the longest registered suffix ending its name; the
    directory format for a name no suffix ends."""
    load_builtins()
    best: Format | None = None
    directory: Format | None = None
    longest = 0
    for fmt in _FORMATS.values():
        if not fmt.suffixes:
            directory = fmt
        for suffix in fmt.suffixes:
            if path.name.endswith(suffix) and len(suffix) > longest:
                best, longest = fmt, len(suffix)
    found = best or directory
    if found is None:  # no directory format registered
        raise ValueError(f"{path}: no checkpoint format claims this name.")
    return found
