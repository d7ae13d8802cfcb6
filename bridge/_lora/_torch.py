"""LoRA on PyTorch-layout Trees (`bridge.from_torch` of a module or a state dict, a
Hugging Face folder read in PyTorch layout): adapters in PEFT's orientation.

A layer with an adapter holds `lora_a (rank, in)` and `lora_b (out, rank)` beside
its `weight`, as PEFT's `lora_A.weight` and `lora_B.weight` (an embedding's
`lora_a (rank, num)`, `lora_b (dim, rank)`, as `lora_embedding_A`/`_B`); its settings
are in the node's kind, a class made once per (layer class, settings). Layers:
`nn.Linear` (`weight (out, in)`), Hugging Face's `Conv1D` (`weight (in, out)`) and
`nn.Embedding`; in a state dict without classes, a 2-D `weight` is read as
`bridge.from_torch` and the PyTorch codecs read it (a `Conv1D` by its GPT-2 name or its
bias, an embedding by its name: `emb...`, `wte`, `wpe`, `shared`).

A state dict has no forward pass: `bridge.to_torch` (and `to_native`) gives the state
dict of the PyTorch model with PEFT's LoRA layers in it, as
`peft.inject_adapter_in_model(config, model)` makes it (adapter `"default"`): the
base arrays under `<layer>.base_layer.`, the adapters under
`<layer>.lora_A.default.weight` and `<layer>.lora_B.default.weight`
(`lora_embedding_A.default`, `lora_embedding_B.default`).
"""

from __future__ import annotations

import threading
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from .._adapters._build import build, native_leaves
from .._adapters._native import like
from .._paths import Path
from .._port.codecs._torch import CONV1D_NAMES, kinds_by_name
from .._tree import Tree, items, kind, leaf_roles, walk
from ._settings import A, B, Frame, Injection, Settings, Target, register_frame


BASE = "base_layer"
"""The name PEFT gives the wrapped layer under a LoRA layer."""

_CLASSES: dict[tuple[Any, Settings], type] = {}
_LOCK = threading.Lock()


def _marker(base: Any, settings: Settings) -> type:
    """The kind of a layer with an adapter: `_lora_base` (the layer's class, or None
    in a state dict) and `lora_settings` (made once per pair)."""
    with _LOCK:
        cls = _CLASSES.get((base, settings))
        if cls is None:
            name = "LoRA" + getattr(base, "__name__", "Layer")
            cls = _CLASSES[(base, settings)] = type(
                name,
                (),
                {"_lora_base": base, "lora_settings": settings, "__module__": __name__},
            )
    return cls


def _class_kind(cls: Any) -> str | None:
    """`"linear"`, `"conv1d"`, `"embed"` for a PyTorch layer class, `""` for another
    class, None for no class (a state dict)."""
    if not isinstance(cls, type):
        return None
    for c in cls.__mro__:
        module = getattr(c, "__module__", "")
        if c.__name__ == "Conv1D" and module.startswith("transformers"):
            return "conv1d"
        if module.startswith("torch.nn"):
            if c.__name__ == "Linear":
                return "linear"
            if c.__name__ == "Embedding":
                return "embed"
    return ""


def _name_kind(name: str, weight: Any, bias: Any) -> str:
    """A class-less 2-D `weight`'s kind, read as `from_torch` and the codecs read it."""
    if bias is not None and weight.shape[0] != weight.shape[1]:
        return "conv1d" if bias.shape[0] == weight.shape[1] else "linear"
    if name in CONV1D_NAMES:
        return "conv1d"
    if bias is None and kinds_by_name(name, ("Embed", "Dense")) == ("Embed",):
        return "embed"
    return "linear"


def _target(path: Path, node: Tree) -> Target | None:
    cls = kind(node)
    base = getattr(cls, "_lora_base", cls)
    settings = getattr(cls, "lora_settings", None)
    children = dict(items(node))
    weight, bias = children.get("weight"), children.get("bias")
    if weight is None or isinstance(weight, Tree) or np.ndim(weight) != 2:
        return None
    if set(children) - {"weight", "bias", A, B} or isinstance(bias, Tree):
        return None
    what = _class_kind(base)
    if what is None:
        what = _name_kind(str(path[-1]) if path else "", weight, bias)
    rows, cols = weight.shape
    name = getattr(base, "__name__", None)
    if what == "linear":
        return Target(
            path, "linear", "weight", "peft", (), (cols,), rows, name or "Linear",
            settings,
        )  # fmt: skip
    if what == "conv1d":
        return Target(
            path, "linear", "weight", "conv1d", (), (rows,), cols, name or "Conv1D",
            settings,
        )  # fmt: skip
    if what == "embed":
        return Target(
            path, "embed", "weight", "peft", (), (rows,), cols, name or "Embedding",
            settings,
        )  # fmt: skip
    return None


def targets(tree: Tree) -> list[Target]:
    found = (_target(path, node) for path, node in walk(tree))
    return [t for t in found if t is not None]


class _Entry:
    """One array of the state dict: its name (without a stripped prefix), path,
    role and value."""

    __slots__ = ("name", "path", "role", "value")

    def __init__(self, name: str, path: Path, role: Any, value: Any):
        self.name, self.path, self.role, self.value = name, path, role, value


def _entries(tree: Tree) -> tuple[Any, list[_Entry]]:
    """The Tree's record and its arrays in the state dict's order."""
    src, leaves = native_leaves(tree, "torch")
    roles = leaf_roles(tree)
    paths: list[Any] = [None] * len(leaves)
    role_at: list[Any] = [None] * len(leaves)
    for i, (path, position) in enumerate(zip(src.paths, src.order)):
        paths[position], role_at[position] = path, roles[i]
    record = src.record
    return record, [
        _Entry(n, p, r, v) for n, p, r, v in zip(record.names, paths, role_at, leaves)
    ]


def _adapter_names(layer: str, target: Target) -> tuple[str, str]:
    if target.kind == "embed":
        return f"{layer}.lora_embedding_A.default", f"{layer}.lora_embedding_B.default"
    return f"{layer}.lora_A.default.weight", f"{layer}.lora_B.default.weight"


def _rebuild(
    record: Any,
    entries: list[_Entry],
    renamed: dict[str, str],
    kinds: dict[Path, Any],
    added: AbstractSet[str] = frozenset(),
) -> Tree:
    """A PyTorch-layout Tree of `entries` (in state dict order), the record's names,
    stripped prefix and ties following `renamed` (`{old name: new name}`); `added`:
    new names that get the stripped prefix back."""
    stripped = set(record.stripped) | set(added)
    for old, new in renamed.items():
        if old in stripped:
            stripped.add(new)
    names = tuple(e.name for e in entries)
    ties = tuple((n, renamed.get(same, same)) for n, same in record.ties)
    new_record = record._replace(
        names=names, ties=ties, stripped=frozenset(stripped & set(names))
    )
    return build(
        [(e.path, e.role, e.value, i) for i, e in enumerate(entries)],
        kinds,
        "torch",
        new_record,
    )


def _base_name(name: str) -> str:
    """`q_proj.base_layer.weight` -> `q_proj.weight`."""
    head, _, last = name.rpartition(".")
    return f"{head.removesuffix('.' + BASE)}.{last}" if head.endswith(BASE) else name


def _wrapped_name(name: str) -> str:
    """`q_proj.weight` -> `q_proj.base_layer.weight`."""
    head, _, last = name.rpartition(".")
    return f"{head}.{BASE}.{last}" if head else f"{BASE}.{last}"


_SPLIT_PART = (
    "{where}: a part of the fused layer {fused!r} that bridge.from_torch(split=...) "
    "split; a PyTorch-layout model writes that layer fused again, and PEFT adapts it "
    "whole: put the adapter on {fused!r} (from_torch without split=), or on a JAX "
    "model with the parts (bridge.save_peft(..., split=...) writes them as one)"
)


def inject(tree: Tree, adapters: list[Injection]) -> Tree:
    record, entries = _entries(tree)
    parts = {p: s.module for s in record.splits for p in s.parts}
    kinds = {path: kind(node) for path, node in walk(tree)}
    chosen = {inj.target.path: inj for inj in adapters}
    problems = []
    renamed: dict[str, str] = {}
    added: set[str] = set()
    out: list[_Entry] = []
    by_layer: dict[Path, list[_Entry]] = {}
    for e in entries:
        layer = e.path[:-1]
        if layer in chosen and e.path[-1] in (A, B):
            continue  # replaced below
        if layer in chosen:
            by_layer.setdefault(layer, []).append(e)
        out.append(e)
    final: list[_Entry] = []
    for e in out:
        layer = e.path[:-1]
        if layer not in chosen:
            final.append(e)
            continue
        inj = chosen[layer]
        wrapped = e.name if _base_name(e.name) != e.name else _wrapped_name(e.name)
        renamed[_base_name(e.name)] = wrapped
        final.append(_Entry(wrapped, e.path, e.role, e.value))
        if e is not by_layer[layer][-1]:
            continue
        name = _base_name(e.name).rpartition(".")[0]
        if name in parts:
            problems.append(
                _SPLIT_PART.format(where=inj.target.where, fused=parts[name])
            )
        na, nb = _adapter_names(name, inj.target)
        if {e.name, _base_name(e.name)} & record.stripped:  # the prefix: on them too
            added |= {na, nb}
        final += [
            _Entry(na, layer + (A,), "params", inj.a),
            _Entry(nb, layer + (B,), "params", inj.b),
        ]
        base = getattr(kinds.get(layer), "_lora_base", kinds.get(layer))
        kinds[layer] = _marker(base, inj.settings)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            f"LoRA adapters cannot go on this PyTorch-layout model: {len(problems)} "
            f"problem(s), nothing was changed.\n{lines}"
        )
    return _rebuild(record, final, renamed, kinds, added)


def strip(tree: Tree, weights: dict[Path, Any]) -> Tree:
    record, entries = _entries(tree)
    kinds = {path: kind(node) for path, node in walk(tree)}
    adapted = {p for p, cls in kinds.items() if hasattr(cls, "_lora_base")}
    renamed: dict[str, str] = {}
    final: list[_Entry] = []
    for e in entries:
        layer = e.path[:-1]
        if layer not in adapted:
            final.append(e)
            continue
        if e.path[-1] in (A, B):
            continue
        name = _base_name(e.name)
        renamed[e.name] = name
        value = (
            weights[layer] if e.path[-1] == "weight" and layer in weights else e.value
        )
        final.append(_Entry(name, e.path, e.role, value))
    for layer in adapted:
        kinds[layer] = kinds[layer]._lora_base
    return _rebuild(record, final, renamed, kinds)


register_frame("torch", Frame(targets, inject, strip, like, carried=False))
