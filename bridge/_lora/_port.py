"""Adapters carried through `bridge.port`: the base weights are ported as they are,
then each adapter goes to the layer its own layer was paired with, through PEFT's
orientation (the source framework's layout to PEFT's, PEFT's to the target's)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import jax.tree_util as jtu

from .._adapters._native import to_neutral
from .._adapters._registry import adapter_for
from .._paths import Path, at
from .._port._carry import Carrier, register_carrier
from .._tree import Tree, framework
from ._peft import from_peft, layer_paths, to_peft
from ._settings import _FRAMES, A, B, Injection, Target, frame_of


class Carried(NamedTuple):
    """A source model's adapters, set aside while its base weights are ported."""

    tree: Tree
    found: list[Target]


_NO_LORA_TARGET = """\
bridge.port: the source model has LoRA adapters ({layers}) but the target is a \
{framework} model, whose arrays would then no longer fit its plain model. Fold them \
into the weights first (bridge.merge_lora(source)), or write them for PEFT \
(bridge.save_peft); for a PyTorch-layout Tree with adapters, port the plain model \
and put them on with bridge.lora or bridge.load_peft."""


def split(source: Any) -> tuple[Any, Carried | None]:
    """`source` without its adapters, and the adapters (None: it has none)."""
    adapter = None if isinstance(source, Tree) else adapter_for(source)
    if isinstance(source, Tree) or (adapter is not None and adapter.name in _FRAMES):
        tree = source if isinstance(source, Tree) else to_neutral(source)
        name = framework(tree)
        if name not in _FRAMES or not _has_adapters(tree):
            return tree, None
        frame = _FRAMES[name]
        found = [t for t in frame.targets(tree) if t.settings is not None]
        if found:
            return frame.strip(tree, {}), Carried(tree, found)
    return source, None


def _has_adapters(tree: Tree) -> bool:
    """Whether any array of `tree` is a LoRA factor (a cheap look at the paths, so a
    model without adapters is never asked for what only adapters need, e.g. a Linen
    module)."""
    leaves = jtu.tree_flatten_with_path(tree)[0]
    return any(
        getattr(path[-1], "name", getattr(path[-1], "key", None)) in (A, B)
        for path, _ in leaves
        if path
    )


def join(carried: Carried, steps: Any, ported: Any) -> Any:
    """`ported` with the carried adapters on the layers the plan's `steps` paired
    their layers with."""
    tree = to_neutral(ported)
    name = framework(tree)
    if name not in _FRAMES or not _FRAMES[name].carried:
        layers = ", ".join(t.where for t in carried.found)
        raise ValueError(_NO_LORA_TARGET.format(layers=layers, framework=name))
    frame = frame_of(name)
    paired = {row.source: row.target for row in steps}
    per_layer: dict[str, tuple[Target, int | None]] = {}
    for t in frame.targets(tree):
        for where, index in layer_paths(tree, t):
            per_layer[where] = (t, index)
    pieces: dict[Path, dict[int | None, tuple[Any, Any]]] = {}
    owners: dict[Path, tuple[Target, Target]] = {}
    for source in carried.found:
        node = at(carried.tree, source.path)
        for where, index in layer_paths(carried.tree, source):
            a, b = getattr(node, A), getattr(node, B)
            if index is not None:
                a, b = a[index], b[index]
            target, t_index = per_layer[paired[where]]
            pieces.setdefault(target.path, {})[t_index] = from_peft(
                target, *to_peft(source, a, b)
            )
            owners[target.path] = (source, target)
    injections = []
    for path, per in pieces.items():
        source, target = owners[path]
        if target.stack:
            a = jnp.stack([per[i][0] for i in range(target.stack[0])])
            b = jnp.stack([per[i][1] for i in range(target.stack[0])])
        else:
            a, b = per[None]
        settings = source.settings
        assert settings is not None
        injections.append(Injection(target, a, b, settings, None))
    out = frame.inject(tree, injections)
    return out if isinstance(ported, Tree) else frame.native(ported, out)


register_carrier(Carrier(split, join))
