"""A layer as the port sees it: a path, the codecs that read its arrays (its
candidate kinds), the arrays and the settings; a loose array is a layer of kind
`Array`. `read_specs` gives each candidate kind's canonical shapes; `tell_settings`
fills a setting one side lacks from the other side's layers of that kind."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax

from .._lazy import materialise
from .._paths import Path, path_str
from . import _errors, _shapes
from ._codec import Codec, Leaves


NOT_PORTED = frozenset({"rngs", "cache", "intermediates", "losses", "counters"})
"""Roles whose leaves are the running state of one model, never ported."""


_FIRST = {"kernel": 0, "embedding": 0, "scale": 1, "bias": 2, "mean": 3, "var": 4}


ARRAY = "Array"
"""The kind of a loose array: held directly by a module, next to its sublayers
(ViT's `pos_embedding`, `cls`), or by a module no codec claims. Its layout is the
same in every framework: one entry, `array`."""


_LOOSE: dict[str, Codec] = {}


def _loose(framework: str) -> Codec:
    if framework not in _LOOSE:
        _LOOSE[framework] = Codec(
            ARRAY, framework, lambda cls, leaves: False, _squeezed, _unsqueezed
        )
    return _LOOSE[framework]


def _squeezed(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
    """A loose array without its leading axes of length 1: `(1, 1, D)` and `(1,
    D)` are one array wherever the computation broadcasts it (a cls token, a
    position table `(1, N, D)` against `(N, D)`); trailing ones are kept (`(C, 1,
    1)`, a channels-first scale, is not `(C,)`)."""
    array = leaves["array"]
    shape = tuple(array.shape)
    first = next((i for i, n in enumerate(shape) if n != 1), len(shape))
    return {"array": array.reshape(shape[first:]) if first else array}


def _unsqueezed(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
    array, shape = canonical["array"], tuple(like["array"].shape)
    return {"array": array if tuple(array.shape) == shape else array.reshape(shape)}


def loose_layer(path: Path, framework: str, leaf: Any) -> Layer:
    """A one-array layer of kind `Array` (a loose array) at the leaf path `path`."""
    layer = Layer(path, (_loose(framework),), {"array": leaf}, {"array": ()}, {})
    read_specs(layer, [])
    return layer


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
    stack: tuple[Path, int] | None = None
    """For one layer of a stack (`nn.scan`): the stack's path and length. Its `path`
    is then `stack path + (index,) + path in a layer`, its `leaves` the shapes of one
    layer, `arrays` the stacked arrays and `real` the path without the index."""
    index: int | None = None
    arrays: Leaves | None = None
    real: Path = ()
    axis: int = 0
    """For one layer of a stack: the layer axis of its arrays (`nn.scan`'s
    `variable_axes={"params": 1}`, MaxText's `param_scan_axis=1`, puts it at 1)."""
    readings: tuple = ()
    """For a per-head kernel with a `Dense` view: every reading its shapes allow
    (`_general.readings`), the view's first; `_general.choose` picks one."""
    undecided: tuple = ()
    """Readings left after `choose` when several fit: a port through the view is
    refused (the example inputs decide)."""
    unknown: dict[str, str] = field(default_factory=dict)
    """`{kind: setting}`: a setting the kind's codec needs that the layer's module
    did not give (a part of a model, a state dict): the paired side tells it."""
    held: dict[str, Path] = field(default_factory=dict)
    """`{entry: leaf path}` for entries the Tree holds at another layer's path (a
    tied array, held once: `with_ties`): read and written there."""
    tied: frozenset[Path] = frozenset()
    """The leaf paths of this layer's arrays that other layers hold too (a tie):
    layers whose `tied` meet are one array under several names."""
    part: tuple[int, int, Layer] | None = None
    """For one part of a fused layer (`_split`): `(its index, how many, the fused
    layer)`; its arrays are the fused layer's (`held`)."""

    def leaf(self, entry: str) -> Path:
        """The leaf path of one of the layer's entries (a stack's: the stacked
        array's; a tied one: where the Tree holds it)."""
        if entry in self.held:
            return self.held[entry]
        return (self.real if self.index is not None else self.path) + self.paths[entry]

    def own_leaves(self) -> Leaves:
        """The layer's arrays (the `index`-th slice of a stack's)."""
        if self.index is None or self.arrays is None:
            return self.leaves
        at = (slice(None),) * self.axis + (self.index,)
        return {k: materialise(v)[at] for k, v in self.arrays.items()}

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


_OWN_SETTINGS = frozenset({"feature_axes", "reduction_axes"})
"""Settings only the layer's own computation tells, never the other side's modules
(a Linen `nn.WeightNorm`'s `feature_axes`: which axis of this kernel its scale
spans; a Linen norm's `reduction_axes`; another model's say nothing of them)."""


def tell_settings(
    sides: tuple[list[Layer], list[Layer]], problems: list[str]
) -> list[str]:
    """Settings a layer lacks (`Layer.unknown`: a part of a model such as
    `bridge.from_equinox(vit).blocks[0]`, whose modules are not at hand) told by the
    other side, where every layer of that kind there agrees on it; otherwise a
    problem naming the setting. Layers left unreadable are dropped from `sides`.
    Returns a warning per setting told (it is the other side's, not read)."""
    told: list[str] = []
    for side, other in ((sides[0], sides[1]), (sides[1], sides[0])):
        for layer in side:
            for kind_, name in list(layer.unknown.items()):
                values = {  # a setting the other side lacks too tells nothing
                    repr(x.hyper[name]): x.hyper[name]
                    for x in other
                    if kind_ in x.kinds
                    and x.hyper.get(name) is not None
                    and name not in _OWN_SETTINGS
                }
                if len(values) == 1:
                    layer.hyper[name] = next(iter(values.values()))
                    read_specs(layer, problems)
                    told.append(
                        _errors.TOLD.format(
                            where=layer.where,
                            kind=kind_,
                            name=name,
                            value=layer.hyper[name],
                        )
                    )
                    continue
                problems.append(
                    _errors.SETTINGS.get(name, _errors.SETTING).format(
                        where=layer.where,
                        kind=kind_,
                        name=name,
                        values=sorted(values) or "none",
                        shape=next(
                            (
                                tuple(layer.leaves[k].shape)
                                for k in ("weight", "kernel", "scale", "bias")
                                if k in layer.leaves
                            ),
                            (),
                        ),
                    )
                )
                layer.unknown.pop(kind_, None)
                layer.codecs = tuple(c for c in layer.codecs if c.kind != kind_)
    for side in sides:
        side[:] = [x for x in side if x.codecs]
    return told


def read_specs(layer: Layer, problems: list[str]) -> None:
    """The canonical shapes and dtypes of the layer, for each candidate kind (a
    kind whose codec needs a setting the layer lacks goes to `layer.unknown`)."""
    layer.unknown.clear()
    for codec in layer.codecs:
        try:
            layer.specs[codec.kind] = _shapes.decoded(codec, layer.leaves, layer.hyper)
        except KeyError as error:  # a setting the module did not give
            name = error.args[0] if error.args else None
            if isinstance(name, str) and layer.hyper.get(name) is None:
                layer.unknown[codec.kind] = name
            else:
                problems.append(
                    _errors.UNREADABLE.format(
                        where=layer.where, kind=codec.kind, error=repr(error)
                    )
                )
        except Exception as error:  # a codec's own message, reported with the path
            problems.append(
                _errors.UNREADABLE.format(
                    where=layer.where, kind=codec.kind, error=error
                )
            )
    layer.codecs = tuple(
        c for c in layer.codecs if c.kind in layer.specs or c.kind in layer.unknown
    )


def common_kind(a: Layer, b: Layer) -> str | None:
    """The kind two layers share (a Linen layer may have several candidates)."""
    for k in a.kinds:
        if k in b.kinds:
            return k
    return None


def same_shapes(a: Layer, b: Layer, kind: str) -> bool:
    sa, sb = a.specs[kind], b.specs[kind]
    return all(sa[k].shape == sb[k].shape for k in sa.keys() & sb.keys())


def layer_signature(layer: Layer) -> tuple:
    """The canonical entries and shapes (a group pairs only where every source and
    target in it share a kind: a Linen layer may have several candidates)."""
    spec = layer.specs[layer.kinds[0]]
    return tuple(sorted((k, v.shape) for k, v in spec.items()))
