"""An export checked against the model it is for: `save(..., layout="torch",
like=reference)` and `bridge convert --to-layout torch --like REFERENCE`.

The reference is a PyTorch module (a model built from its `config.json`, on the
`meta` device or not), a state dict, or a checkpoint (a safetensors file or a Hugging
Face folder): its names and shapes, read without its values. The export must hold
exactly those names, each with the reference's shape, before anything is written;
a name the reference ties to another (the same tensor under two names, as an
`lm_head.weight` tied to the embeddings) may be left out, as `save_pretrained` does.
A name the reference holds a stored sinusoidal position table under (transformers'
Marian, Pegasus, RoFormer `embed_positions.weight`), which the model computes and has
no array for, is written with the reference's values with `strict=False`; it is an
error otherwise, as every other difference is. Its values are read only then.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from .._adapters._native import to_neutral
from .._families._sinusoid import sinusoid
from .._paths import path_str
from .._tree import map_with_path
from ._read import lazy, open_checkpoint
from ._torch_layout import dotted_torch


LOG = logging.getLogger("bridge")


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


_TABLE = (
    "computed by the model: {name} {shape} is in the reference, a stored "
    "sinusoidal position table ({variant}), which the model computes (it has no "
    "array for it); {fix}"
)
_NAMES_APART = """\
{n} name(s) the export would write are not the reference's but have the shape of a
name of the reference that nothing is written under ({some}): shapes could pair
them, but cannot tell which layer is which (two layers of one shape, a gate and an
up projection, fit either way). {fix}"""
EXAMPLE_FIX = """\
Pass example= inputs of the model with like= the PyTorch module (on the `meta`
device it costs no memory) or the Hugging Face folder: both forward passes then
pair the layers and the reference's names are written, e.g.
bridge.save(path, model, layout="torch", like=module, example=(input_ids,))."""
NO_FORWARD_PASS = """\
example= was given, but `like` here has no forward pass to pair the layers by (a
state dict, or a file without the config.json of its model): pass the PyTorch
module itself (built on the `meta` device it costs no memory) or the Hugging Face
folder with its config.json, with example=."""

STRICT_FIX = "pass strict=False to write the reference's table"
"""The fix `_TABLE` names, for `bridge.save` (`bridge convert` names another)."""

Values = Callable[[list[str]], dict[str, Any]]
"""The reference's arrays of some names, read now (those it cannot give left out)."""


class Reference:
    """The names and shapes an export must have, the names it may leave out, and
    (`values`) the reference's arrays, read when asked; `strict`: whether its
    stored sinusoidal tables the export lacks are errors (else written);
    `pairing`: what pairs layers whose names differ where shapes alone would
    (said when the check finds some)."""

    def __init__(
        self,
        shapes: Shapes,
        ties: Mapping[str, set[str]],
        what: str,
        values: Values | None = None,
        strict: bool = True,
        fix: str = STRICT_FIX,
    ):
        self.shapes = shapes
        self.ties = ties
        self.what = what
        self.values = values
        self.strict = strict
        self.fix = fix
        self.pairing = EXAMPLE_FIX


def reference_of(like: Any, strict: bool = True, fix: str = STRICT_FIX) -> Reference:
    """Read `like`'s names and shapes (its values only when `check` asks); `fix`:
    how a stored table the export lacks is written (`_TABLE`).

    **Raises:**

    `TypeError` when `like` is none of the references above.
    """
    if isinstance(like, str | os.PathLike):
        with open_checkpoint(like) as contents:
            shapes = {s.key: tuple(s.shape) for s in contents.tensors}
        values = _file_values(like)
        return Reference(shapes, {}, os.fspath(like), values, strict, fix)
    state = _state_dict(like) if callable(getattr(like, "state_dict", None)) else like
    if not isinstance(state, Mapping) or not all(
        isinstance(k, str) and hasattr(v, "shape") for k, v in state.items()
    ):
        raise TypeError(_NOT_A_REFERENCE.format(what=type(like).__name__))
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    what = type(like).__name__ + ("" if state is like else ".state_dict()")
    return Reference(shapes, _ties(state), what, _state_values(state), strict, fix)


def _state_dict(module: Any) -> Any:
    """A module's state dict, its tensors as the module holds them where it can
    (`keep_vars=True`: a tied parameter is one object under each of its names,
    which tells the tie where the tensors hold no memory, on the `meta` device)."""
    try:
        return module.state_dict(keep_vars=True)
    except TypeError:  # a `state_dict()` of another kind
        return module.state_dict()


def _file_values(path: Any) -> Values:
    def values(names: list[str]) -> dict[str, Any]:
        with open_checkpoint(path) as contents:
            arrays = lazy(contents) or {}
            return {n: np.asarray(arrays[n].read()) for n in names if n in arrays}

    return values


def _state_values(state: Mapping[str, Any]) -> Values:
    def values(names: list[str]) -> dict[str, Any]:
        try:  # as bridge reads a state dict: numpy views (none on `meta`)
            tree = to_neutral({n: state[n] for n in names})
        except (TypeError, ValueError):
            return {}
        out: dict[str, Any] = {}
        map_with_path(lambda p, x: out.__setitem__(dotted_torch(path_str(p)), x), tree)
        return out

    return values


def _ties(state: Mapping[str, Any]) -> dict[str, set[str]]:
    """`{name: the other names of the same tensor}` (PyTorch tensors sharing their
    storage, as tied weights do; tensors on the `meta` device hold none: one
    object under several names is a tie there)."""
    owners: dict[tuple, list[str]] = {}
    for name, value in state.items():
        pointer = getattr(value, "data_ptr", None)
        at = pointer() if callable(pointer) else 0
        if at:
            owners.setdefault((at, tuple(value.shape)), []).append(name)
        elif getattr(getattr(value, "device", None), "type", None) == "meta":
            owners.setdefault(("object", id(value)), []).append(name)
    return {n: set(names) - {n} for names in owners.values() for n in names}


def check(
    written: Iterable[tuple[str, tuple[int, ...]]], reference: Reference
) -> dict[str, Any]:
    """Raise `ValueError` listing every name the export would write that the
    reference lacks, every name of the reference it would not write (but for tied
    ones and, with `reference.strict` False, its stored sinusoidal tables), and
    every shape that differs; nothing is written by then.

    **Returns:**

    `{name: array}`: the reference's sinusoidal tables to write as well (empty
    with `reference.strict`)."""
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
    lacking = {
        name: shape
        for name, shape in reference.shapes.items()
        if name not in out and not reference.ties.get(name, set()) & out.keys()
    }
    tables = _tables(lacking, reference)
    for name, shape in lacking.items():
        if name in tables and reference.strict:
            variant = tables[name][1]
            problems.append(
                _TABLE.format(
                    name=name, shape=shape, variant=variant, fix=reference.fix
                )
            )
        elif name not in tables:
            problems.append(f"missing: {name} {shape} is in the reference, not written")
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            _MISMATCH.format(n=len(problems), reference=reference.what, problems=lines)
            + _apart(out, lacking, reference)
        )
    if reference.strict or not tables:
        return {}
    LOG.info(
        "Written from the reference (stored sinusoidal position tables, which the "
        "model computes): %s",
        sorted(tables),
    )
    return {name: array for name, (array, _) in tables.items()}


def _apart(written: Shapes, lacking: Shapes, reference: Reference) -> str:
    """`_NAMES_APART` (after a new line) where names written that the reference
    lacks have the shapes of names of the reference nothing is written under:
    shapes could pair them, names do not; else empty."""
    free = set(lacking.values())
    extra = [
        f"{n} {s}"
        for n, s in written.items()
        if n not in reference.shapes and s in free
    ]
    if not extra:
        return ""
    some = ", ".join(extra[:3]) + (", ..." if len(extra) > 3 else "")
    return "\n" + _NAMES_APART.format(n=len(extra), some=some, fix=reference.pairing)


def _tables(lacking: Shapes, reference: Reference) -> dict[str, tuple[Any, str]]:
    """`{name: (array, variant)}` for the names the export lacks whose reference
    arrays are stored sinusoidal position tables (`bridge._families._sinusoid`)."""
    names = [n for n, shape in lacking.items() if len(shape) == 2]
    if not names or reference.values is None:
        return {}
    found = {}
    for name, array in reference.values(names).items():
        variant = sinusoid(array)
        if variant is not None:
            found[name] = (array, variant)
    return found
