"""The checks a save makes before it writes anything: that what `save` writes `load`
reads back (`check_names`: the names in bridge's own metadata; `check_plain_names`:
a PyTorch-layout file or folder, by dotted names alone), and that the destination
can take it (`check_place`: its directory exists, a file is not a directory
nor read-only), each an error in bridge's words naming the path."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .._shown import shown, some
from ._atomic import check_writable
from ._contents import Contents, plain_name, unreadable


_NOT_NAMES = """\
{path}: a checkpoint names each array by its role (a Linen collection) and its path,
each a non-empty name or an index (at most 400 deep), and `load` reads nothing else
back; these (role, path) are not: {where}. Rename the empty keys (e.g.
`{{'params': {{'': x}}}}` -> `{{'params': {{'x': x}}}}`). Nothing was written."""

_NOT_PLAIN_NAMES = """\
{path}: a PyTorch-layout checkpoint names each array by dotted names, none empty (as
`module.state_dict()` does), and readers split the names at the dots; these names
are not: {names}. Rename the model's empty keys (a Linen `{{'': ...}}`), or the
layers with `rules=`. Nothing was written."""


def check_names(path: Path, contents: Contents) -> None:
    """`ValueError` naming every array (and empty mapping) of `contents` that
    `load` would refuse by its role or path (an empty key)."""
    unnamed = unreadable(contents)
    if unnamed:
        raise ValueError(_NOT_NAMES.format(path=path, where=some(unnamed, show=str)))


def check_plain_names(path: Path, names: Iterable[str]) -> None:
    """`ValueError` naming every name of a PyTorch-layout file that its readers
    would not split into names (an empty segment: `''`, `'a.'`, `'.weight'`)."""
    bad = [n for n in names if not plain_name(n)]
    if bad:
        raise ValueError(
            _NOT_PLAIN_NAMES.format(path=path, names=some(bad, show=shown))
        )


_NO_DIRECTORY = "{parent}: no such directory to save {name} in."
_A_DIRECTORY = """\
{path} is a directory: a {kind} is one file; pick a file name (or, for a Hugging Face
folder, a path without a suffix: bridge.save_pretrained)."""


def check_place(path: Path, kind: str | None) -> None:
    """Before anything is written: `FileNotFoundError` where `path`'s directory does
    not exist; for one file (`kind` names it: `"safetensors checkpoint"`), an
    `IsADirectoryError` where `path` is a directory and a `PermissionError` where
    the file there is read-only (`_atomic.check_writable`); `kind=None`: a
    directory checkpoint, which `_atomic.atomic_dir` checks."""
    if not path.parent.is_dir():
        raise FileNotFoundError(
            _NO_DIRECTORY.format(parent=path.parent, name=path.name)
        )
    if kind is None:
        return
    if path.is_dir():
        raise IsADirectoryError(_A_DIRECTORY.format(path=path, kind=kind))
    check_writable(path)
