"""Finding the layers of a Tree: each node a codec recognises, in definition order."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import jax

from .._adapters._registry import Adapter, adapter_named, adapter_of_class
from .._embed._inside import embedded
from .._paths import Path, at, path_str
from .._tree import Tree, framework, items, kind, roles, walk
from . import _errors
from ._codec import Codec, Leaves, codecs


NOT_PORTED = frozenset({"rngs", "cache", "intermediates", "losses", "counters"})
"""Roles whose leaves are the running state of one model, never ported."""

_AUTO_NAME = re.compile(r"^(.+)_\d+$")
_FIRST = {"kernel": 0, "embedding": 0, "scale": 1, "bias": 2, "mean": 3, "var": 4}


@dataclass(eq=False)
class Layer:
    """One recognised layer: its path, candidate codecs (several only for a Linen
    layer that neither its name nor its arrays pin to one kind), arrays, settings."""

    path: Path
    codecs: tuple[Codec, ...]
    leaves: Leaves
    paths: dict[str, Path]
    hyper: dict[str, Any]
    specs: dict[str, dict[str, jax.ShapeDtypeStruct]] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return path_str(self.path) or "(root)"

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(c.kind for c in self.codecs)

    def codec(self, kind: str) -> Codec:
        return next(c for c in self.codecs if c.kind == kind)

    def shapes(self, kind: str | None = None) -> str:
        spec = self.specs[kind or self.kinds[0]]
        names = sorted(spec, key=lambda k: (_FIRST.get(k.split("/")[-1], 9), k))
        return ", ".join(f"{k} {tuple(spec[k].shape)}" for k in names)


def _subtree_leaves(node: Tree, roles: Tree) -> tuple[Leaves, dict[str, Path]]:
    leaves: Leaves = {}
    paths: dict[str, Path] = {}

    def visit(n: Any, r: Any, rel: Path) -> None:
        for (key, child), (_, role) in zip(items(n), items(r)):
            if isinstance(child, Tree):
                visit(child, role, rel + (key,))
            elif role not in NOT_PORTED:
                name = "/".join(str(k) for k in rel + (key,))
                leaves[name] = child
                paths[name] = rel + (key,)

    visit(node, roles, ())
    return leaves, paths


def _auto_name(cls: Any, path: Path) -> str | None:
    if not path or cls is not None:  # the root, or a class a checkpoint recorded
        return getattr(cls, "__name__", None)
    match = _AUTO_NAME.match(str(path[-1]))
    return match.group(1) if match else None


def _recognise(
    adapter: Adapter, cls: Any, path: Path, leaves: Leaves, problems: list[str]
):
    """The codecs that recognise this node (empty: not a layer).

    A module class the Tree (or a checkpoint) recorded chooses its framework's codecs:
    an NNX class in a file read back as Flax variables is read by the NNX codecs.
    Where every module's class is known, the first codec that recognises it decides;
    otherwise (Linen) an auto-name (`Dense_0`) picks the codecs named for it, and
    failing that every codec that recognises the arrays is a candidate."""
    owner = adapter_of_class(cls)
    if owner is not None and owner.name != adapter.name:
        adapter = owner
    family = codecs(adapter.name)
    found = tuple(c for c in family if c.recognise(cls, leaves))
    if adapter.records_classes:
        return found[:1]
    name = _auto_name(cls, path)
    named = [c for c in family if name in c.names]
    if not named:
        return found
    fitting = tuple(c for c in named if c in found)
    if not fitting and leaves:
        problems.append(
            _errors.MISNAMED.format(
                where=path_str(path) or "(root)", name=name, names=sorted(leaves)
            )
        )
    return fitting


def find_layers(tree: Tree, problems: list[str]) -> list[Layer]:
    """Every layer of `tree`, parents before children, in the Tree's (definition)
    order. Arrays under no recognised layer are reported as unsupported."""
    adapter = adapter_named(framework(tree) or "linen")  # a part: as Flax variables
    all_roles = roles(tree)
    role_nodes = dict(walk(all_roles))
    native = None if adapter.modules is None else adapter.modules(tree)
    layers: list[Layer] = []
    taken: list[Path] = []
    for path, node in walk(tree):
        if any(path[: len(p)] == p for p in taken):
            continue
        inside = None if native is None else embedded(at(native, path), node, path)
        if inside is not None:  # a model of another framework in a wrapper
            prefix, inner = inside
            for layer in find_layers(inner, problems):
                layer.path = prefix + layer.path
                layers.append(layer)
            taken.append(path)
            continue
        leaves, paths = _subtree_leaves(node, role_nodes[path])
        if not leaves:
            continue
        cls = kind(node)
        found = _recognise(adapter, cls, path, leaves, problems)
        if found:
            module = None if native is None else at(native, path)
            # a layer of a file read without its model (an NNX class recorded in a
            # Flax file) has no module: its codecs read their settings from one
            expects = adapter_named(found[0].framework).records_classes
            hyper = (
                {} if module is None and expects else found[0].hyperparameters(module)
            )
            layer = Layer(path, found, leaves, paths, hyper)
            read_specs(layer, problems)
            if layer.codecs:
                layers.append(layer)
            taken.append(path)
            continue
        direct = [
            str(k)
            for (k, child), (_, role) in zip(items(node), items(role_nodes[path]))
            if not isinstance(child, Tree) and role not in NOT_PORTED
        ]
        if direct:
            problems.append(
                _errors.UNSUPPORTED.format(
                    where=path_str(path) or "(root)",
                    cls=getattr(cls, "__name__", "Linen module"),
                    names=direct,
                )
            )
            taken.append(path)
    return layers


def read_specs(layer: Layer, problems: list[str]) -> None:
    """The canonical shapes and dtypes of the layer, for each candidate kind."""
    structs = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in layer.leaves.items()
    }
    for codec in layer.codecs:
        try:
            layer.specs[codec.kind] = jax.eval_shape(
                lambda leaves, c=codec: c.decode(leaves, layer.hyper), structs
            )
        except Exception as error:  # a codec's own message, reported with the path
            problems.append(
                _errors.UNREADABLE.format(
                    where=layer.where, kind=codec.kind, error=error
                )
            )
    layer.codecs = tuple(c for c in layer.codecs if c.kind in layer.specs)
