"""The checks a save makes before it writes anything, so that what `save` writes
`load` reads back: the names a file holds (`check_names`: bridge's own metadata;
`check_plain_names`: a PyTorch-layout file or folder, by dotted names alone)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .._shown import shown, some
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
