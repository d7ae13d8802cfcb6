"""Finding the layers of a Tree: each node a codec recognises, and each array held
directly by a module that no codec claims (a one-array layer of kind `"Array"`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import jax

from .._adapters._registry import (
    Adapter,
    adapter_named,
    adapter_of_class,
    canonical_adapter,
)
from .._adapters._skeleton import MissingSetting
from .._embed._inside import embedded
from .._lazy import materialise
from .._paths import Path, at, path_str
from .._shown import shown
from .._tree import Tree, framework, items, kind, roles, walk
from . import _errors, _shapes
from ._codec import (
    WRAPPERS,
    WRITTEN,
    Codec,
    Leaves,
    Wrapping,
    codec_of,
    codecs,
    outer_class,
    same,
    same_as_like,
)
from ._general import with_views
from ._weight_norm import with_folded
from .codecs._dense import DENSE_LINEN, by_bias, open_square
from .codecs._weight_norm import LINEN_SCALE, WEIGHT_NORM


NOT_PORTED = frozenset({"rngs", "cache", "intermediates", "losses", "counters"})
"""Roles whose leaves are the running state of one model, never ported."""

_AUTO_NAME = re.compile(r"^(.+)_\d+$")
_FIRST = {"kernel": 0, "embedding": 0, "scale": 1, "bias": 2, "mean": 3, "var": 4}

ARRAY = "Array"
"""The kind of a loose array: held directly by a module, next to its sublayers
(ViT's `pos_embedding`, `cls`), or by a module no codec claims. Its layout is the
same in every framework: one entry, `array`."""
_LOOSE: dict[str, Codec] = {}
_UNSEEN = object()


def _loose(framework: str) -> Codec:
    if framework not in _LOOSE:
        _LOOSE[framework] = Codec(
            ARRAY, framework, lambda cls, leaves: False, same, same_as_like
        )
    return _LOOSE[framework]


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


def _subtree_leaves(node: Tree, roles: Tree) -> tuple[Leaves, dict[str, Path]]:
    leaves: Leaves = {}
    paths: dict[str, Path] = {}

    def visit(n: Any, r: Any, rel: Path, names: str) -> None:
        for (key, child), (_, role) in zip(items(n), items(r)):
            if isinstance(child, Tree):
                visit(child, role, rel + (key,), f"{names}{key}/")
            elif role not in NOT_PORTED:
                leaves[f"{names}{key}"] = child
                paths[f"{names}{key}"] = rel + (key,)

    visit(node, roles, (), "")
    return leaves, paths


def _auto_name(cls: Any, path: Path) -> str | None:
    if not path or cls is not None:  # the root, or a class a checkpoint recorded
        return getattr(cls, "__name__", None)
    match = _AUTO_NAME.match(str(path[-1]))
    return match.group(1) if match else None


def _class_of(node: Tree) -> Any:
    """The class of the module at `node` as codecs recognise it: a `Wrapping` for a
    wrapper (`_codec.WRAPPERS`), naming the class of the layer it wraps."""
    cls = kind(node)
    if not isinstance(cls, type):
        return cls
    for wrapper, name in WRAPPERS.items():
        if issubclass(cls, wrapper):
            child = dict(items(node)).get(name)
            return Wrapping(cls, kind(child) if isinstance(child, Tree) else None)
    return cls


def _inputs_first(adapter: Adapter, node: Any, path: Path) -> bool:
    """Whether a per-head kernel's input axes come first: its class is a
    `DenseGeneral` one (recorded, as NNX's `LinearGeneral`, or a Linen auto-name
    `DenseGeneral_0`); not an `nn.Einsum` or a module nothing names."""
    cls = kind(node) if isinstance(node, Tree) else None
    if adapter.records_classes:
        return True
    return _auto_name(cls, path) == "DenseGeneral"


def _recognise(
    families: dict[str, list[Codec]],
    adapter: Adapter,
    cls: Any,
    path: Path,
    leaves: Leaves,
) -> tuple[tuple[Codec, ...], str | None]:
    """The codecs that recognise this node (empty: not a layer), and the problem
    of a Linen auto-name whose codecs do not recognise its arrays (or None).

    A module class the Tree (or a checkpoint) recorded chooses its framework's codecs:
    an NNX class in a file read back as Flax variables is read by the NNX codecs.
    Where every module's class is known, the first codec that recognises it decides;
    otherwise (Linen) an auto-name (`Dense_0`) picks the codecs named for it, and
    failing that every codec that recognises the arrays is a candidate. `families`:
    the registered codecs by framework, read once per walk."""
    owner = adapter_of_class(outer_class(cls))
    if owner is not None and owner.name != adapter.name:
        adapter = owner
    family = families.get(adapter.name)
    if family is None:
        family = families[adapter.name] = codecs(adapter.name)
    if adapter.records_classes:
        return next(((c,) for c in family if c.recognise(cls, leaves)), ()), None
    found = tuple(c for c in family if c.recognise(cls, leaves))
    name = _auto_name(cls, path)
    named = [c for c in family if name in c.names]
    if not named:
        return found, None
    fitting = tuple(c for c in named if c in found)
    if not fitting and leaves:
        where = path_str(path) or "(root)"
        return fitting, _errors.MISNAMED.format(
            where=where, name=name, names=sorted(leaves)
        )
    return fitting, None


class _Walk:
    """What one walk over a Tree computes once per node and is asked again: each
    node's native module (`module`: `native` at the root), its arrays (`leaves`),
    seen whole or with a stack's layer axis dropped (`axis`), the codecs that
    recognise them (`found`) and whether every array under the node is in a
    recognised layer (`covered`). Asked per node by a walk that also asks for
    every node's ancestors, these make it linear in the nodes (times the depth),
    not quadratic."""

    def __init__(
        self, adapter: Adapter, tree: Tree, role_nodes: dict[Path, Tree], native: Any
    ):
        self.adapter = adapter
        self.nodes = dict(walk(tree))
        self.role_nodes = role_nodes
        self.families: dict[str, list[Codec]] = {}
        self._leaves: dict[Path, tuple[Leaves, dict[str, Path]]] = {}
        self._sliced: dict[tuple[Path, int], Leaves] = {}
        self._found: dict[tuple[Path, int | None], tuple] = {}
        self._covered: dict[tuple[Path, int | None], bool] = {}
        self._modules: dict[Path, Any] = {(): native}

    def module(self, path: Path) -> Any:
        """The native module at `path` (None without a native model)."""
        got = self._modules.get(path, _UNSEEN)
        if got is _UNSEEN:
            got = self._modules[path] = at(self.module(path[:-1]), path[-1:])
        return got

    def arrays(self, path: Path) -> tuple[Leaves, dict[str, Path]]:
        """The arrays under the node at `path` by relative name, and their paths."""
        got = self._leaves.get(path)
        if got is None:
            got = _subtree_leaves(self.nodes[path], self.role_nodes[path])
            self._leaves[path] = got
        return got

    def leaves(self, path: Path, axis: int | None) -> Leaves:
        """The node's arrays, or their shapes with the layer axis `axis` dropped."""
        if axis is None:
            return self.arrays(path)[0]
        got = self._sliced.get((path, axis))
        if got is None:
            got = {k: _drop(v, axis) for k, v in self.arrays(path)[0].items()}
            self._sliced[(path, axis)] = got
        return got

    def found(self, path: Path, axis: int | None) -> tuple:
        """`_recognise` of the node's `leaves(path, axis)`; at a stack's layer axis,
        not a Linen `Dense` read `(out, in)` by its bias alone (`by_bias`: the
        slice of a stack of Dense layers along its other axis reads so too)."""
        got = self._found.get((path, axis))
        if got is None:
            leaves = self.leaves(path, axis)
            got = _recognise(
                self.families, self.adapter, _class_of(self.nodes[path]), path, leaves
            )
            if axis is not None and by_bias(leaves):  # no evidence of a stack
                got = (tuple(c for c in got[0] if c is not DENSE_LINEN), got[1])
            self._found[(path, axis)] = got
        return got

    def covered(self, path: Path, axis: int | None) -> bool:
        """Whether every array under the node (with the layer axis `axis` dropped)
        is in a layer some codec recognises."""
        got = self._covered.get((path, axis))
        if got is None:
            got = self._covers(path, axis)
            self._covered[(path, axis)] = got
        return got

    def _covers(self, path: Path, axis: int | None) -> bool:
        leaves = self.leaves(path, axis)
        if not leaves:
            return True
        found, _ = self.found(path, axis)
        if found and self.adapter.records_classes:
            fits = _fits_flax(found[0], leaves)
            return fits is not False  # None: no shape tells, the siblings decide
        if found:
            return True
        node, roles = self.nodes[path], self.role_nodes[path]
        for (key, child), (_, role) in zip(items(node), items(roles)):
            if not isinstance(child, Tree):
                if role not in NOT_PORTED:
                    return False
            elif not self.covered(path + (key,), axis):
                return False
        return True


def _under(path: Path, taken: set[Path]) -> bool:
    """Whether `path` is in `taken` or under a path in it."""
    return any(path[:n] in taken for n in range(len(path) + 1))


def find_layers(
    tree: Tree,
    problems: list[str],
    loose: bool = True,
    told: bool = False,
    axes: dict[Path, Any] | None = None,
    views: bool = False,
    opened: frozenset[str] = frozenset(),
) -> list[Layer]:
    """Every layer of `tree`, parents before children, in Tree order.

    A node is a layer when a codec recognises all the arrays under it (its subtree
    is then consumed), or only its own arrays (those not in a sublayer: its
    sublayers are walked on). Arrays a module holds directly that no codec claims
    are one-array layers of kind `"Array"` with `loose`, else reported as
    unsupported; so are the arrays of a stack of Linen layers (`nn.scan`). With
    `told`, layers lacking a setting keep it in `Layer.unknown` for the paired side
    to tell (`tell_settings`); otherwise that is a problem. `axes` decides stacks
    whose layer axis the shapes leave open (`{stack path: axis}`); one left open is
    added to it as `{stack path: (candidate axes)}` and read as no stack (the caller
    tries each against the other side: `_plan.make_plan`), or is a problem without
    `axes`. With `views`, a per-head `DenseGeneral` layer is a `Dense` candidate
    too (`_general.py`). A layer of a kind in `opened` is not one: its sublayers are
    (an `nnx.MultiHeadAttention` read as its `query`, `key`, `value` and `out`
    projections, where the other side has separate ones)."""
    name = framework(tree)  # a part: read in the canonical layout (Flax variables)
    adapter = canonical_adapter() if name is None else adapter_named(name)
    role_nodes = dict(walk(roles(tree)))
    native = None if adapter.modules is None else adapter.modules(tree)
    wrapped = embedded(tree, native)  # models of other frameworks in wrappers
    seen = _Walk(adapter, tree, role_nodes, native)
    layers: list[Layer] = []
    taken: set[Path] = set()

    def add(path: Path, found, leaves: Leaves, paths: dict[str, Path]) -> Layer:
        module = None if native is None else seen.module(path)
        ordered = _inputs_first(adapter, seen.nodes.get(path), path)
        # a layer of a file read without its model (an NNX class recorded in a
        # Flax file) has no module: its codecs read their settings from one
        expects = adapter_named(found[0].framework).records_classes
        try:
            hyper = (
                {} if module is None and expects else found[0].hyperparameters(module)
            )
        except MissingSetting as missing:  # a file's metadata naming another class
            problems.append(
                _errors.METADATA.format(
                    path=path_str(path) or "(root)",
                    cls=shown(missing.cls),
                    name=missing.name,
                    found=missing.found,
                )
            )
            return Layer(path, (), leaves, paths, {})
        readings = ()
        if views:
            found, readings = with_views(found, leaves, module, ordered)
            found = with_folded(found)
        layer = Layer(path, found, leaves, paths, hyper, readings=readings)
        read_specs(layer, problems)
        if layer.codecs:
            layers.append(layer)
        return layer

    def add_loose(path: Path, leaf: Any) -> Layer:
        return add(path, (_loose(adapter.name),), {"array": leaf}, {"array": ()})

    for path, node in seen.nodes.items():
        if taken and _under(path, taken):
            continue
        if path in wrapped:
            prefix, inner = wrapped[path]
            inner_layers = find_layers(inner, problems, True, told, axes, views, opened)
            for layer in inner_layers:
                layer.path = prefix + layer.path
                layers.append(layer)
            taken.add(path)
            continue
        leaves, paths = seen.arrays(path)
        if not leaves:
            continue
        cls = kind(node)
        length, axis = _stacked(seen, path, leaves, problems, axes)
        if length and loose:
            layers += _stack_layers(seen, path, (length, axis), problems, native, views)
            taken.add(path)
            continue
        found, misnamed = seen.found(path, None)
        if misnamed is not None:
            problems.append(misnamed)
        if found and found[0].kind in opened:  # read as its sublayers
            continue
        if found:
            add(path, found, leaves, paths)
            taken.add(path)
            continue
        direct = {
            str(k): (k, child)
            for (k, child), (_, role) in zip(items(node), items(role_nodes[path]))
            if not isinstance(child, Tree) and role not in NOT_PORTED
        }
        if not direct:
            continue
        own = {name: child for name, (_, child) in direct.items()}
        if len(own) < len(leaves):  # a module next to its sublayers: its own arrays
            found, _ = _recognise(seen.families, adapter, cls, path, own)
            if found:
                add(path, found, own, {name: (k,) for name, (k, _) in direct.items()})
                continue
        if loose:
            for k, child in direct.values():
                add_loose(path + (k,), child)
            continue
        problems.append(
            _errors.UNSUPPORTED.format(
                where=path_str(path) or "(root)",
                cls=getattr(cls, "__name__", "Linen module"),
                names=list(direct),
            )
        )
        taken.add(path)
    if adapter.name == canonical_adapter().name:
        linen_weight_norms(layers, problems)
    for layer in open_square(layers):  # square kernels of a FlaxConv1D's model
        read_specs(layer, problems)
    if not told:
        tell_settings((layers, []), problems)
    return layers


_LINEN_SCALE_KEY = re.compile(r"^(.+)/([^/]+)/scale$")
"""The key Linen's `nn.WeightNorm` keeps a wrapped layer's scale under, in its own
scope: `<layer name>/<array path>/scale`."""


def linen_weight_norms(layers: list[Layer], problems: list[str]) -> None:
    """Linen layers wrapped by `nn.WeightNorm` made weight-normed layers, in place.

    `nn.WeightNorm(nn.Dense(4))` keeps the `Dense`'s `kernel` (`v`) and `bias` where
    the `Dense` is (`Dense_0`), and the scale (`g`) in its own scope, keyed by the
    `Dense`'s name (`WeightNorm_0/'Dense_0/kernel/scale'`), a loose array by
    itself. The sibling layer of that name becomes a `WeightNorm{Dense,Conv,
    ConvTranspose}` (of its candidate kinds) holding the scale (`Layer.held`), and
    the loose array goes. A wrapper normalising other arrays than the `kernel` (a
    `variable_filter` matching the bias) is a problem; a scale whose layer is not
    a sibling stays a loose array (unpaired: refused, never ported apart)."""
    at_path = {x.path: x for x in layers if x.index is None}
    scales: dict[Path, dict[str, Layer]] = {}
    for x in layers:
        match = _LINEN_SCALE_KEY.match(str(x.path[-1])) if x.path else None
        if x.kinds != (ARRAY,) or x.index is not None or match is None:
            continue
        wrapped = x.path[:-2] + tuple(match.group(1).split("/"))
        if wrapped in at_path:
            scales.setdefault(wrapped, {})[match.group(2)] = x
    for path, found in scales.items():
        layer = at_path[path]
        if set(found) != {"kernel"}:
            problems.append(
                _errors.LINEN_WEIGHT_NORM.format(where=layer.where, names=sorted(found))
            )
            continue
        scale = found["kernel"]
        kinds = [WEIGHT_NORM[k] for k in layer.kinds if k in WEIGHT_NORM]
        wrapped_codecs = tuple(c for k in kinds if (c := codec_of(k, "linen")))
        if not wrapped_codecs or "kernel" not in layer.leaves:
            continue
        new = Layer(
            layer.path,
            with_folded(wrapped_codecs),
            {**layer.leaves, LINEN_SCALE: scale.leaves["array"]},
            {**layer.paths, LINEN_SCALE: (LINEN_SCALE,)},
            {},
            held={LINEN_SCALE: scale.path},
        )
        read_specs(new, problems)
        layers[layers.index(layer)] = new
        layers.remove(scale)


def with_ties(
    tree: Tree,
    layers: list[Layer],
    ties: dict[Path, Path],
    problems: list[str],
    views: bool = False,
) -> list[Layer]:
    """`layers` and, for each module that holds a tied array under a name the Tree
    holds it once (`ties`: `{that name's leaf path: the leaf path the Tree holds
    it at}`: T5's `encoder.embed_tokens.weight` is `shared.weight`; a tied head's
    `lm_head.weight`), a layer of its own: recognised as that module (an
    `nn.Linear` head reads the embedding as `(out, in)`), its arrays the held ones
    (`Layer.held`), and its own arrays beside them (a head's bias). The layers
    sharing an array know it (`Layer.tied`): one array may fill several layers
    of the other side, and several layers of the other side may fill one array
    only with equal values (`_port.run`)."""
    at_leaf = {x.leaf(k): (x, k) for x in layers if x.index is None for k in x.paths}
    modules: dict[Path, dict[str, Path]] = {}
    for alias, held in ties.items():
        if held in at_leaf and alias and alias not in at_leaf:
            modules.setdefault(alias[:-1], {})[str(alias[-1])] = held
    if not modules:
        return layers
    name = framework(tree)
    adapter = canonical_adapter() if name is None else adapter_named(name)
    native = None if adapter.modules is None else adapter.modules(tree)
    families: dict[str, list[Codec]] = {}
    out = list(layers)
    for path, entries in modules.items():
        leaves = {e: at_leaf[h][0].leaves[at_leaf[h][1]] for e, h in entries.items()}
        paths: dict[str, Path] = {e: (e,) for e in entries}
        own = next((x for x in out if x.path == path and x.index is None), None)
        if own is not None:  # arrays of its own beside the tied ones
            leaves, paths = {**own.leaves, **leaves}, {**own.paths, **paths}
        module = None if native is None else at(native, path)
        # the class of a module no node of the Tree stands for: the native node's
        cls = getattr(module, "cls", None)
        found, _ = _recognise(families, adapter, cls, path, leaves)
        if not found:
            continue
        readings = ()
        if views:
            found, readings = with_views(found, leaves, module, False)
        layer = Layer(
            path,
            found,
            leaves,
            paths,
            found[0].hyperparameters(module),
            readings=readings,
            held=dict(entries),
            tied=frozenset(entries.values()),
        )
        read_specs(layer, problems)
        if not layer.codecs:
            continue
        if own is not None:
            out.remove(own)
        for h in entries.values():
            x = at_leaf[h][0]
            x.tied = x.tied | {h}
        out.append(layer)
    return out


def _stack_layers(
    seen: _Walk,
    path: Path,
    stacked: tuple[int, int],
    problems: list[str],
    native: Any = None,
    views: bool = False,
) -> list[Layer]:
    """The layers of a stack, one per index: `.blocks[3].Dense_0` is the fourth
    slice of `.blocks.Dense_0`'s arrays. `native`: the model, for the settings of
    a stack's modules where classes are recorded (one module stands for all).
    `stacked`: the stack's length and layer axis."""
    length, axis = stacked
    out: list[Layer] = []
    taken: set[Path] = set()
    for sub_path, sub in walk(seen.nodes[path], path):
        if taken and _under(sub_path, taken):
            continue
        arrays, paths = seen.arrays(sub_path)
        one = seen.leaves(sub_path, axis)
        found = seen.found(sub_path, axis)[0] if one else ()
        if not found:
            continue
        taken.add(sub_path)
        rel = sub_path[len(path) :]
        module = None if native is None else seen.module(sub_path)
        hyper = {} if module is None else found[0].hyperparameters(module)
        readings = ()
        if views:
            ordered = _inputs_first(seen.adapter, sub, sub_path)
            found, readings = with_views(found, one, module, ordered)
            found = with_folded(found)
        for i in range(length):
            layer = Layer(
                path + (i,) + rel,
                found,
                one,
                paths,
                hyper,
                stack=(path, length),
                readings=readings,
            )
            layer.index, layer.arrays, layer.real = i, arrays, sub_path
            layer.axis = axis
            read_specs(layer, problems)
            if layer.codecs:
                out.append(layer)
    return out


def _drop(x: Any, axis: int) -> jax.ShapeDtypeStruct:
    """The shape of one layer of a stacked array (`axis` dropped)."""
    return jax.ShapeDtypeStruct(x.shape[:axis] + x.shape[axis + 1 :], x.dtype)


def _stacked(
    seen: _Walk,
    path: Path,
    leaves: Leaves,
    problems: list[str],
    axes: dict[Path, Any] | None = None,
) -> tuple[int, int]:
    """`(layer count, layer axis)` of a stack of layers (Linen `nn.scan`, NNX
    modules made under `nnx.vmap`, Equinox modules made by `eqx.filter_vmap`: every
    array has the layer axis at one position, leading unless `variable_axes` put it
    elsewhere), or `(0, 0)`. A stack is what the codecs recognise entirely once that
    axis is dropped. Where classes are recorded (NNX, Equinox), a codec recognises
    its class whatever the shapes: the arrays, decoded to the Flax layout, are then
    judged by the Flax codec of the same kind, which reads shapes.

    A Linen stack whose arrays are also layers with the axis (a bias-free Dense
    stack's `(L, in, out)` kernels read as DenseGeneral or Conv kernels) is a stack
    when it holds several sublayers (a scanned block). A node that is a stack at
    several axes (a bias-free RMSNorm + Dense stack reads at axis 0 and at 1) takes
    its axis from `axes`, else is left open there (see `find_layers`)."""
    if not path:
        return 0, 0
    records = seen.adapter.records_classes
    ranks = {x.ndim for x in leaves.values()}
    least = 1 if records else 2
    if not ranks or min(ranks) < least:
        return 0, 0
    if seen.covered(path, None) and (
        records
        or _sublayers(seen.nodes[path]) < 2
        or max(ranks) < 3  # 2-D layers as they are: their slices would be vectors
        or seen.found(path, None)[0]  # one layer (attention)
    ):
        return 0, 0
    found = []
    for axis in range(min(ranks) if not records else 1):
        lengths = {x.shape[axis] for x in leaves.values()}
        if len(lengths) != 1:
            continue
        if seen.covered(path, axis):
            found.append((lengths.pop(), axis))
    if len(found) > 1:
        chosen = None if axes is None else axes.get(path)
        if isinstance(chosen, int):
            return next((n, a) for n, a in found if a == chosen)
        if axes is not None:
            axes[path] = tuple(a for _, a in found)
            return 0, 0
        problems.append(
            _errors.STACK_AXIS.format(
                where=path_str(path),
                axes=[a for _, a in found],
                lengths=[n for n, _ in found],
            )
        )
        return 0, 0
    return found[0] if found and found[0][0] else (0, 0)


def _sublayers(node: Tree) -> int:
    """How many child modules a node holds (a scanned block holds several)."""
    return sum(isinstance(child, Tree) for _, child in items(node))


def _fits_flax(codec: Codec, leaves: Leaves) -> bool | None:
    """Whether a layer's arrays (shapes), decoded to the Flax layout by its codec,
    are what the Flax (Linen) codec of its kind recognises; False where the arrays do
    not decode; None where the kind has no Flax codec of its own (a
    `Codec.same_layout` norm, a norm only written by hand: `WRITTEN`): its shapes
    tell nothing, and in a stack the other layers decide."""
    flax = codec_of(codec.kind, canonical_adapter().name)
    if flax is None or flax.layout == WRITTEN:  # a norm written by hand: its own
        return None
    try:
        canonical = _shapes.decoded(codec, leaves, {})
    except Exception:  # the codec's own refusal: not this layout
        return False
    return bool(flax.recognise(None, canonical))


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
