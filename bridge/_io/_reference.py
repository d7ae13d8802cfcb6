"""An export checked against the model it is for: `save(..., layout="torch",
like=reference)` and `bridge convert --to-layout torch --like REFERENCE`.

The reference is a PyTorch module (a model built from its `config.json`, on the
`meta` device or not), a state dict, or a checkpoint (a safetensors file or a Hugging
Face folder): its names and shapes, read without its values. The export must hold
exactly those names, each with the reference's shape, before anything is written;
a name the reference ties to another (the same tensor under two names, as an
`lm_head.weight` tied to the embeddings) may be left out, as `save_pretrained` does.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from ._read import open_checkpoint


Shapes = dict[str, tuple[int, ...]]

_MISMATCH = """\
Cannot write the PyTorch layout: {n} name(s) or shape(s) differ from the reference
({reference}); nothing was written.
{problems}
Fix: give the model whose layers the reference has (the same config), name its
layers as the reference does (rules=, prefix=, as bridge.port's rules read
backwards), or port the model into the reference first: bridge.port(model,
reference_module), then save that."""

_NOT_A_REFERENCE = """\
`like` (with layout="torch") must be a PyTorch module (anything with a
`state_dict()`), a state dict (names -> arrays or tensors), or the path of a
checkpoint in the PyTorch layout (a safetensors file, a Hugging Face folder); got
{what}."""


class Reference:
    """The names and shapes an export must have, and the names it may leave out."""

    def __init__(self, shapes: Shapes, ties: Mapping[str, set[str]], what: str):
        self.shapes = shapes
        self.ties = ties
        self.what = what


def reference_of(like: Any) -> Reference:
    """Read `like`'s names and shapes (no values).

    **Raises:**

    `TypeError` when `like` is none of the references above.
    """
    if isinstance(like, str | os.PathLike):
        with open_checkpoint(like) as contents:
            shapes = {s.key: tuple(s.shape) for s in contents.tensors}
        return Reference(shapes, {}, os.fspath(like))
    state = like.state_dict() if callable(getattr(like, "state_dict", None)) else like
    if not isinstance(state, Mapping) or not all(
        isinstance(k, str) and hasattr(v, "shape") for k, v in state.items()
    ):
        raise TypeError(_NOT_A_REFERENCE.format(what=type(like).__name__))
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    what = type(like).__name__ + ("" if state is like else ".state_dict()")
    return Reference(shapes, _ties(state), what)


def _ties(state: Mapping[str, Any]) -> dict[str, set[str]]:
    """`{name: the other names of the same tensor}` (PyTorch tensors sharing their
    storage, as tied weights do; tensors on the `meta` device hold none)."""
    owners: dict[tuple, list[str]] = {}
    for name, value in state.items():
        pointer = getattr(value, "data_ptr", None)
        at = pointer() if callable(pointer) else 0
        if at:
            owners.setdefault((at, tuple(value.shape)), []).append(name)
    return {n: set(names) - {n} for names in owners.values() for n in names}


def check(written: Iterable[tuple[str, tuple[int, ...]]], reference: Reference) -> None:
    """Raise `ValueError` listing every name the export would write that the
    reference lacks, every name of the reference it would not write (but for tied
    ones), and every shape that differs; nothing is written by then."""
    out = dict(written)
    problems = []
    for name, shape in out.items():
        if name not in reference.shapes:
            problems.append(f"unexpected: {name} {shape} is not in the reference")
        elif reference.shapes[name] != shape:
            problems.append(
                f"shape: {name} would be written with {shape}, the reference "
                f"holds {reference.shapes[name]}"
            )
    for name, shape in reference.shapes.items():
        if name in out or reference.ties.get(name, set()) & out.keys():
            continue
        problems.append(f"missing: {name} {shape} is in the reference, not written")
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            _MISMATCH.format(n=len(problems), reference=reference.what, problems=lines)
        )
