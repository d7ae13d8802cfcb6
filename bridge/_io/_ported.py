"""An export named by both computations: `save_pretrained(..., like=module,
example=inputs)`.

The model is ported into the reference's layout as `bridge.port(model, module,
example=inputs)` ports it (`bridge._port._planning.make_plan`, then `run`): layers of
the same name on both sides (case and separators aside) pair by it, the others by
the order in which the two forward passes use them and by what each computes, never
by a name that only resembles another (`_torch_layout.fitted`) or by shape alone;
the layouts are the reference module's own (its classes: GPT-2's `Conv1D`). The
names written are then the reference's: a JAX rewrite with names of its own
(`attn.query` for `self_attn.q_proj`) is written under the names its PyTorch model
loads.

The reference must have a forward pass to trace: a `torch.nn.Module` (its tensors
on the `meta` device or not), or a Hugging Face folder (or a safetensors file) with
its `config.json`, whose model is built from the config at no memory cost
(`bridge._adapters._torch_folder.folder_module`). A state dict, or a file without a
config, has none: the export is then named as without `example` (`_torch_layout`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from .._adapters._native import placeholders, to_neutral
from .._adapters._registry import adapter_for, ties_of
from .._paths import parse, path_str
from .._port._errors import CAST, PortError, PortWarning
from .._port._find import find_layers
from .._port._layer import NOT_PORTED
from .._port._planning import make_plan
from .._port._report import warn
from .._port._reverse import reverse_rules
from .._port._run import run
from .._port._side import read_side
from .._port._trace import Example
from .._tree import Tree, roles
from ._config import CONFIG
from ._model import file_tree
from ._read import lazy, open_checkpoint
from ._reference import NOT_A_REFERENCE
from ._torch_layout import LAYOUT, _writer, dotted_torch


class Ported(NamedTuple):
    """A model in the reference's layout and names: `state`, `{name: array}` in the
    reference's order (a name the reference ties to an earlier one left out, as
    `save_pretrained` leaves it), and `linear`, the dotted names of its `Linear`
    layers (what `quantize=` quantizes)."""

    state: dict[str, np.ndarray]
    linear: frozenset[str]


LOG = logging.getLogger("bridge")


_PREFIX = """\
`prefix` ({prefix!r}) with `like` and `example`: the names written are `like`'s own
(its layers paired with the model's by both forward passes), which a prefix would
change. Leave `prefix` out (a head model's names already hold its
`base_model_prefix`)."""

_UNEXPECTED = (
    "unexpected: {where} of the model pairs with no layer of `like`; give the "
    "model `like`'s layers, or give `like` the model's, or leave it out: "
    "rules={{r'{pattern}': None}}, or strict=False for every such layer"
)
_MISMATCHED = "shape: {line}"
_HOW = """\
(while pairing the model's layers with those of `like` by both forward passes, as
bridge.port(model, like, example=...) does: bridge.port_plan(model, like,
example=...) shows the pairing)"""


def computed_target(like: Any) -> Tree | None:
    """`like` as an abstract PyTorch-layout Tree (shapes and dtypes, no values) that
    records a forward pass to trace: a `torch.nn.Module`'s own, or the model of a
    Hugging Face folder's (or a safetensors file's) `config.json`, keyed by the
    file's names. None where `like` has none (a state dict, a file without a
    config, a checkpoint of another layout)."""
    if isinstance(like, str | os.PathLike):
        path = Path(like)
        folder = path if path.is_dir() else path.parent
        if not (folder / CONFIG).is_file():
            return None
        with open_checkpoint(path) as contents:
            if contents.layout != LAYOUT:
                return None
            arrays = lazy(contents)
            if arrays is None:
                return None
            return _abstract(file_tree(contents, arrays))
    if isinstance(like, Mapping):
        return None
    adapter = adapter_for(like)
    if adapter is None or adapter.layout != LAYOUT:
        return None
    return _abstract(to_neutral(placeholders(like)))


def _abstract(tree: Tree) -> Tree:
    """`tree` with shapes and dtypes for arrays: a layer the port leaves unfilled
    keeps no value of the reference's, and nothing of a file is read."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _fresh(tree: Tree) -> Tree:
    """`tree` with its unfilled arrays of a role never ported (BatchNorm's
    `num_batches_tracked`: a count of one model's steps) as a fresh module holds
    them: zeros."""

    def made(x: Any, role: str) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct) and role in NOT_PORTED:
            return np.zeros(x.shape, x.dtype)
        return x

    return jax.tree.map(made, tree, roles(tree))


def _port_rules(
    tree: Tree, rules: Mapping[str, str | None] | None
) -> dict[str, str | None]:
    """`save`'s `rules` (import rules, read backwards: `bridge._port._reverse`) as
    `bridge.port`'s: each layer of `tree` a rule names, to the reference's layer of
    that name (`{its path: the reference's}`), as the export without `example`
    names it (`_torch_layout._name`), a dotted name or a `keystr` path alike. A
    rule to None leaves out the layers of `tree` it matches (`{pattern: None}`, as
    `bridge.port` reads it)."""
    if not rules:
        return {}
    out: dict[str, str | None] = {p: None for p, r in rules.items() if r is None}
    backwards = reverse_rules({p: r for p, r in rules.items() if r is not None})
    # problems: the plan's to report
    for layer in find_layers(read_side(tree, 0, []), []):
        for pattern, replacement in backwards.items():
            match = re.fullmatch(pattern, layer.where)
            if match:
                name = dotted_torch(match.expand(replacement))
                out[re.escape(layer.where)] = path_str(parse(name))
                break
    return out


def ported_state(
    tree: Tree,
    target: Tree,
    example: Example,
    rules: Mapping[str, str | None] | None = None,
    prefix: str = "",
    strict: bool = True,
) -> Ported:
    """`tree` ported into `target` (`computed_target`) by the plan both forward
    passes on `example` decide, in `target`'s layout and names; the arrays keep
    `tree`'s dtypes (a bfloat16 model is written bfloat16 whatever the reference's
    dtype). `example`'s keyword arguments go to both calls, as `bridge.port`'s do
    (a PyTorch `forward` takes those it names), or a pair, one per side. `rules`,
    the import rules `save` takes, are read backwards and pair the layers they
    match first (`bridge._port._reverse`).

    Layers of `target` nothing fills are not written (the reference check lists
    them, or writes a stored table with `strict=False`). A rule to None leaves
    the layers of `tree` it matches out (`{r"\\.classifier": None}`: a new head the
    reference has not).

    **Raises:**

    `ValueError` for a `prefix`; `bridge.PortError` listing every problem of the
    pairing, and with `strict` every layer of `tree` that pairs with none of
    `target` and every pair whose shapes differ (with `strict=False` these are
    left out, logged). A `bridge.PortWarning` lists the settings that differ
    between paired layers (an epsilon), as `bridge.port` does.
    """
    if prefix:
        raise ValueError(_PREFIX.format(prefix=prefix))
    backwards = _port_rules(tree, rules)
    # strict=False: a layer of the target left unfilled is the reference check's
    # to report (or to write, a stored table); dtypes are not cast (below)
    plan, problems = make_plan(tree, target, backwards, False, None, example)
    lone = (*plan.unexpected, *plan.computed_by_target)
    if strict:
        problems += [
            _UNEXPECTED.format(where=where, pattern=re.escape(where)) for where in lone
        ]
        problems += [_MISMATCHED.format(line=line) for line in plan.mismatched]
    if problems:
        error = PortError(problems)
        error.add_note(_HOW)
        raise error
    if lone:
        LOG.warning(
            "Not written (strict=False): the model's layers that pair with no layer "
            "of `like`: %s",
            list(lone),
        )
    if plan.mismatched:
        LOG.warning(
            "Not written (strict=False): the model's layers whose shapes differ from "
            "their pair's in `like`: %s",
            list(plan.mismatched),
        )
    if plan.dropped:
        LOG.info("Left out by rules: %s", list(plan.dropped))
    cast = CAST.split("{", 1)[0]
    told = [w for w in plan.warnings if not w.startswith(cast)]
    if told:
        warn("Port warnings:\n  " + "\n  ".join(told), PortWarning)
    steps = tuple(dataclasses.replace(s, cast={}) for s in plan.steps)
    filled = _fresh(run(dataclasses.replace(plan, steps=steps)))
    # a tie's second name left out, as `save_pretrained` leaves it out
    tied = {tie[0] for tie in ties_of(filled)}
    state = {
        name: np.asarray(array)
        for name, array in _writer()[1].own(filled, "").items()
        if name not in tied and array.dtype != object  # object: left unfilled
    }
    linear = frozenset(dotted_torch(s.target) for s in steps if s.kind == "Dense")
    return Ported(state, linear)


_NO_TARGET = """\
`like` has no forward pass to pair the layers by (a state dict, or a file without
the config.json of its model): pass the PyTorch module (on the `meta` device it
costs no memory) or the Hugging Face folder with its config.json."""


def paired_names(
    tree: Tree,
    like: Any,
    example: Example,
    rules: Mapping[str, str | None] | None = None,
) -> dict[str, str]:
    """`{layer path of tree (keystr): the dotted name of the layer of like it pairs
    with}`, paired as `ported_state` pairs them (both forward passes on `example`,
    `rules` read backwards); layers of `tree` that pair with none are left out
    (the caller says which of them it needed).

    **Raises:**

    `ValueError` when `like` has no forward pass (`_NO_TARGET`);
    `bridge.PortError` listing every problem of the pairing.
    """
    if not isinstance(like, str | os.PathLike) and adapter_for(like) is None:
        raise TypeError(NOT_A_REFERENCE.format(what=type(like).__name__))
    target = computed_target(like)
    if target is None:
        raise ValueError(_NO_TARGET)
    plan, problems = make_plan(
        tree, target, _port_rules(tree, rules), False, None, example
    )
    if problems:
        error = PortError(problems)
        error.add_note(_HOW)
        raise error
    return {step.source: dotted_torch(step.target) for step in plan.steps}
