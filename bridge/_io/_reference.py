"""An export checked against the model it is for: `save_pretrained(...,
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
error otherwise. With `strict=False` the export writes what fits and reports the
rest (logger `"bridge"`): the model's arrays the reference has no place for, or holds
in another shape, are left out; the reference's names it does not write are listed
(`from_pretrained` initialises them). An export that would write none of the
reference's names is refused whatever `strict` is. Its values are read only for
the tables.

A Hugging Face folder written with a `config.json` and no `like` is checked against
the model that config names (`config_reference`: built on the `meta` device from the
config alone), so that a model with names of its own is never written beside a
config whose model would open it with every weight random.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np

from .._adapters._native import to_neutral
from .._adapters._torch_folder import folder_module
from .._families._sinusoid import sinusoid
from .._paths import path_str
from .._shown import shown, some
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
reference_module), then save that. With strict=False the names that fit are
written and the others reported."""
_MOST_LINES = 12
"""The most problems of each kind a refusal lists (then how many more)."""

NOT_A_REFERENCE = """\
`like` (of a PyTorch-layout export) must be a PyTorch module (anything with a
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
bridge.save_pretrained(folder, model, like=module, example=(input_ids,))."""
NO_FORWARD_PASS = """\
example= was given, but `like` here has no forward pass to pair the layers by (a
state dict, or a file without the config.json of its model): pass the PyTorch
module itself (built on the `meta` device it costs no memory) or the Hugging Face
folder with its config.json, with example=."""

CONFIG_FIX = """\
These names are not those of {what}: from_pretrained would open the folder with
those weights random. If the model has names of its own, pass like= the folder the
weights came from (or the PyTorch module) and example= inputs of the model: both
forward passes pair the layers, and the folder's names are written:
bridge.save_pretrained(path, model, config={folder}, like={folder},
example=(x,))."""
_UNCHECKED = (
    "%s: the names written are not checked against the model its config.json names (%s)"
)
_NOTHING_IN_COMMON = """\
Cannot write the PyTorch layout: none of the {n} name(s) the export would write is
one of the reference's ({reference}); nothing was written. The export's are {ours};
the reference's {theirs}.
{fix}"""
_NOTHING_FITS = """\
none of the {n} name(s) the export would write is the reference's: strict=False
writes what fits, and nothing does"""

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
        self.loose: frozenset[str] = frozenset()
        """Names the export may write whatever their shapes, which the reference
        makes one of its tensors from (per-expert weights transformers packs on
        load)."""
        self.heads = False
        """Whether names the reference lacks may be written (a config.json that
        names no class: the base model it builds is checked, its heads cannot
        be)."""


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
        raise TypeError(NOT_A_REFERENCE.format(what=type(like).__name__))
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    what = "`like`, " + type(like).__name__
    what += "" if state is like else ".state_dict()"
    return Reference(shapes, _ties(state), what, _state_values(state), strict, fix)


def config_reference(
    config: str, names: list[str], where: Any, strict: bool = True, folder: Any = None
) -> Reference | None:
    """The reference of a Hugging Face folder written with `config` (its
    `config.json` text) and no `like`: the names and shapes of the model the config
    names, built from it on the `meta` device (`folder_module`), each under the
    name of the file's `names` that transformers loads it from (its renaming on
    load, the `base_model_prefix`); a tensor it packs from several of `names`
    (per-expert weights) takes them whatever their shapes. A config naming no
    class (`architectures`) builds the base model: names it lacks are then a
    head's, and written. `folder`: the folder the config came from, named in the
    fix. None, logged (`where`: the folder written), when the model cannot be
    built (torch or transformers not installed, a config naming code of its own, a
    model type transformers does not know): the names are then not checked."""
    try:
        raw = json.loads(config)
    except json.JSONDecodeError as error:
        LOG.warning(_UNCHECKED, where, f"it is not JSON: {error}")
        return None
    built = folder_module(raw, keys=names) if isinstance(raw, Mapping) else None
    if built is None or built.module is None:
        reason = "it is not an object" if built is None else built.reason
        LOG.warning(_UNCHECKED, where, reason)
        return None
    model = reference_of(built.module, strict)
    merged = built.merged  # module names several of the keys make
    named = {n: built.keys.get(n, n) for n in model.shapes if n not in merged}
    what = f"{type(built.module).__name__}, the model its config.json names"
    reference = Reference(
        {named[n]: shape for n, shape in model.shapes.items() if n in named},
        {
            named[n]: {named[o] for o in others if o in named}
            for n, others in model.ties.items()
            if n in named
        },
        what,
        None,
        strict,
    )
    named_folder = "FOLDER" if folder is None else shown(os.fspath(folder))
    reference.pairing = CONFIG_FIX.format(what=what, folder=named_folder)
    reference.heads = not raw.get("architectures")
    reference.loose = frozenset(k for keys in merged.values() for k in keys)
    return reference


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


class Checked(NamedTuple):
    """What `check` lets an export write: `tables`, `{name: array}` of the
    reference's stored sinusoidal tables to write as well; `left_out`, the names it
    leaves out (`strict=False`: the reference has no place for them, or holds them
    in another shape)."""

    tables: dict[str, Any]
    left_out: frozenset[str]


def check(
    written: Iterable[tuple[str, tuple[int, ...]]], reference: Reference
) -> Checked:
    """Compare the names and shapes an export would write with the reference's.

    With `reference.strict` (the default), raise `ValueError` listing every name
    the export would write that the reference lacks, every name of the reference
    it would not write (but for tied ones), every shape that differs and every
    stored sinusoidal table the model computes; nothing is written by then. With
    `strict=False` the tables are written from the reference, the names it lacks
    and those whose shapes differ are left out, and all of it is logged (logger
    `"bridge"`, WARNING; the tables INFO); an export that would write none of the
    reference's names is refused.
    """
    out = dict(written)
    unexpected = [
        (n, s)
        for n, s in out.items()
        if n not in reference.shapes
        and n not in reference.loose
        and not reference.heads
    ]
    differ = [
        (n, s, reference.shapes[n])
        for n, s in out.items()
        if n in reference.shapes and reference.shapes[n] != s
    ]
    lacking = {
        name: shape
        for name, shape in reference.shapes.items()
        if name not in out and not reference.ties.get(name, set()) & out.keys()
    }
    tables = _tables(lacking, reference)
    missing = [(n, s) for n, s in lacking.items() if n not in tables]
    left_out = frozenset(n for n, *_ in (*unexpected, *differ))
    if out and not out.keys() & reference.shapes.keys():  # names of its own
        raise ValueError(
            _NOTHING_IN_COMMON.format(
                n=len(out),
                reference=reference.what,
                ours=some(out, most=3, show=str),
                theirs=some(reference.shapes, most=3, show=str),
                fix=reference.pairing,
            )
        )
    if reference.strict or not out.keys() - left_out:
        problems = [
            *(f"unexpected: {n} {s} is not in the reference" for n, s in unexpected),
            *(
                f"shape: {n} would be written with {s}, the reference holds {held}"
                for n, s, held in differ
            ),
            *(
                _TABLE.format(name=n, shape=lacking[n], variant=v, fix=reference.fix)
                for n, (_, v) in tables.items()
                if reference.strict
            ),
            *(f"missing: {n} {s} is in the reference, not written" for n, s in missing),
        ]
        if not reference.strict:
            problems.insert(0, _NOTHING_FITS.format(n=len(out)))
        if problems:
            raise ValueError(
                _MISMATCH.format(
                    n=len(problems), reference=reference.what, problems=_lines(problems)
                )
                + _apart(out, lacking, reference)
            )
        return Checked({}, frozenset())
    _told(reference.what, unexpected, differ, missing)
    if tables:
        LOG.info(
            "Written from the reference (stored sinusoidal position tables, which "
            "the model computes): %s",
            sorted(tables),
        )
    return Checked({name: array for name, (array, _) in tables.items()}, left_out)


def _lines(problems: list[str]) -> str:
    """The problems one a line, each kind at most `_MOST_LINES` times (then how
    many more of that kind)."""
    kinds: dict[str, list[str]] = {}
    for p in problems:
        kinds.setdefault(p.split(":", 1)[0], []).append(p)
    lines = []
    for same in kinds.values():
        lines += [f"  - {p}" for p in same[:_MOST_LINES]]
        if len(same) > _MOST_LINES:
            lines.append(f"  - ... and {len(same) - _MOST_LINES} more like these")
    return "\n".join(lines)


def _told(
    reference: str,
    unexpected: list[tuple[str, tuple[int, ...]]],
    differ: list[tuple[str, tuple[int, ...], tuple[int, ...]]],
    missing: list[tuple[str, tuple[int, ...]]],
) -> None:
    """Log (WARNING) what a non-strict export left out and what it lacks."""
    if unexpected:
        LOG.warning(
            "Not written (strict=False): %d array(s) of the model that %s has no "
            "place for: %s",
            len(unexpected),
            reference,
            some([f"{n} {s}" for n, s in unexpected], show=str),
        )
    if differ:
        LOG.warning(
            "Not written (strict=False): %d array(s) whose shapes differ from %s's: %s",
            len(differ),
            reference,
            some(
                [f"{n} {s}, the reference's {held}" for n, s, held in differ], show=str
            ),
        )
    if missing:
        LOG.warning(
            "Not in the export: %d array(s) of %s (from_pretrained initialises them: "
            "train them): %s",
            len(missing),
            reference,
            some([f"{n} {s}" for n, s in missing], show=str),
        )


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
