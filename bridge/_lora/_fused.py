"""A fused PyTorch layer whose parts are separate layers of the JAX model: GPT-2's
`c_attn` (queries, keys and values in one `Conv1D`, weight `(E, 3E)`) split into
`query`, `key` and `value` layers, as `bridge.from_torch(..., split=)` splits it.

PEFT puts one adapter on the fused layer, `lora_A (r, E)` and `lora_B (3E, r)`.

- Read (`load_peft`): each part gets the whole `lora_A` and its rows of `lora_B`,
  with the fused layer's rank and alpha. The parts together compute exactly the
  fused adapter's output.
- Written (`save_peft`): the parts' adapters become one. When every part holds one,
  with one `lora_A` and the same settings (an adapter read from PEFT), it is that
  `lora_A` and the parts' `lora_B`s stacked: rank `r` again. Otherwise (adapters
  trained apart, or on some parts only) it has the rank of the parts' together:
  `lora_A` their `lora_A`s stacked, `lora_B` block-diagonal, each part's block
  scaled to the first part's scaling (zero rows for a part without adapter), again
  exactly the parts' output.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ._settings import Settings


Split = Mapping[str, Sequence[str]]

_LEAF = re.compile(r"(?:^|\\\.)([A-Za-z_]\w*)$")
_BAD_SPLIT = """\
`split` must map regular expressions to part names, as bridge.from_torch takes it \
({{r"h\\.\\d+\\.attn\\.c_attn": ("query", "key", "value")}}); {problem}."""
_NO_LEAF = (
    "split pattern {pattern!r}: the fused layer's own name must end the pattern "
    "literally (r'h\\.\\d+\\.attn\\.c_attn'), so that the parts' adapters can be "
    "written under it"
)


def check_split(split: Any) -> dict[str, tuple[str, ...]]:
    """`split` as a dict of compiled-checked patterns to part names (`{}` for None)."""
    if split is None:
        return {}
    if not isinstance(split, Mapping):
        raise TypeError(_BAD_SPLIT.format(problem=f"got {type(split).__name__}"))
    out = {}
    for pattern, parts in split.items():
        if not isinstance(pattern, str) or isinstance(parts, str):
            raise TypeError(_BAD_SPLIT.format(problem=f"got {pattern!r}: {parts!r}"))
        parts = tuple(parts)
        if len(parts) < 2 or not all(isinstance(p, str) and p for p in parts):
            raise ValueError(_BAD_SPLIT.format(problem=f"{pattern!r} has {parts!r}"))
        try:
            re.compile(pattern)
        except re.error as e:
            problem = f"{pattern!r} is no regular expression ({e})"
            raise ValueError(_BAD_SPLIT.format(problem=problem)) from None
        out[pattern] = parts
    return out


def _bare(name: str, prefix: str) -> str | None:
    return name[len(prefix) :] if name.startswith(prefix) else None


def parts_of(name: str, split: Split, prefix: str) -> list[str] | None:
    """The names of the parts of the fused layer `name` (a PEFT module name, with
    `prefix`), when a pattern fully matches it without the prefix (as `from_torch`
    matches the names it strips the prefix from); else None."""
    bare = _bare(name, prefix)
    for pattern, parts in split.items():
        if bare is not None and re.fullmatch(pattern, bare):
            head = name.rsplit(".", 1)[0] + "." if "." in name else ""
            return [head + p for p in parts]
    return None


class Part(NamedTuple):
    """A layer that is a part of a fused PyTorch layer."""

    fused: str  # the fused layer's name, with the prefix
    position: int
    parts: tuple[str, ...]  # the names of all the parts, with the prefix


def part_of(name: str, split: Split, prefix: str, problems: list[str]) -> Part | None:
    """Where the layer `name` (with `prefix`) goes when the adapters are written: a
    part of a fused layer, or None (a layer of its own)."""
    bare = _bare(name, prefix)
    if bare is None:
        return None
    head, _, leaf = bare.rpartition(".")
    for pattern, parts in split.items():
        if leaf not in parts:
            continue
        found = _LEAF.search(pattern)
        if found is None:
            problems.append(_NO_LEAF.format(pattern=pattern))
            continue
        fused = (head + "." if head else "") + found.group(1)
        if re.fullmatch(pattern, fused):
            siblings = tuple(prefix + (head + "." if head else "") + p for p in parts)
            return Part(prefix + fused, parts.index(leaf), siblings)
    return None


def split_b(b: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """The fused `lora_B (sum(sizes), r)` cut into each part's rows."""
    return np.split(b, np.cumsum(sizes)[:-1].tolist(), axis=0)


def fuse(
    pieces: Sequence[tuple[np.ndarray, np.ndarray, Settings] | None],
    sizes: Sequence[int],
) -> tuple[np.ndarray, np.ndarray, Settings]:
    """One adapter `(lora_A, lora_B, settings)` computing what the parts' adapters
    compute (PEFT orientation; `None` for a part without adapter; `sizes`: each
    part's output features)."""
    present = [p for p in pieces if p is not None]
    a0, _, first = present[0]
    if len(present) == len(pieces) and all(
        s == first and np.array_equal(a, a0) for a, _, s in present
    ):
        return a0, np.concatenate([b for _, b, _ in present]), first
    rank = sum(s.rank for _, _, s in present)
    scaling = first.scaling
    alpha = scaling * (math.sqrt(rank) if first.rslora else rank)
    settings = Settings(rank, alpha, first.rslora, first.dropout)
    dtype = present[0][1].dtype
    b = np.zeros((sum(sizes), rank), dtype)
    row = col = 0
    for piece, size in zip(pieces, sizes):
        if piece is not None:
            _, pb, s = piece
            ratio = s.scaling / scaling
            block = pb if ratio == 1.0 else pb.astype(np.float32) * ratio
            b[row : row + size, col : col + s.rank] = block.astype(dtype)
            col += s.rank
        row += size
    return np.concatenate([a for a, _, _ in present]), b, settings
