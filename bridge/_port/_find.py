"""Finding the layers of a Tree: each node a codec recognises, and each array held
directly by a module that no codec claims (a one-array layer of kind `"Array"`); a
stack's layers one per index; a layer per name of a tied array (`with_ties`)."""

from __future__ import annotations

import re
from typing import Any

import jax

from .._adapters._registry import (
    Adapter,
    adapter_named,
    adapter_of_class,
    canonical_adapter,
)
from .._adapters._skeleton import MissingSetting
from .._paths import Path, at, path_str
from .._shown import shown
from .._tree import Tree, items, kind, roles, walk
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
)
from ._general import with_views
from ._layer import NOT_PORTED, Layer, _loose, read_specs, tell_settings
from ._side import Side
from ._weight_norm import linen_weight_norms, with_folded
from .codecs._dense import DENSE_LINEN, by_bias, open_square


_AUTO_NAME = re.compile(r"^(.+)_\d+$")

_UNSEEN = object()


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
    side: Side,
    problems: list[str],
    loose: bool = True,
    told: bool = False,
    axes: dict[Path, Any] | None = None,
    views: bool = False,
    opened: frozenset[str] = frozenset(),
) -> list[Layer]:
    """Every layer of the side's Tree, parents before children, in Tree order.

    A node is a layer when a codec recognises all the arrays under it (its subtree
    is then consumed), or only its own arrays (those not in a sublayer: its
    sublayers are walked on). Arrays a module holds directly that no codec claims
    are one-array layers of kind `"Array"` with `loose`, else reported as
    unsupported; so are the arrays of a stack of Linen layers (`nn.scan`). With
    `told`, layers lacking a setting keep it in `Layer.unknown` for the paired side
    to tell (`tell_settings`); otherwise that is a problem. `axes` decides stacks
    whose layer axis the shapes leave open (`{stack path: axis}`); one left open is
    added to it as `{stack path: (candidate axes)}` and read as no stack (the caller
    tries each against the other side: `_planning.make_plan`), or is a problem without
    `axes`. With `views`, a per-head `DenseGeneral` layer is a `Dense` candidate
    too (`_general.py`). A layer of a kind in `opened` is not one: its sublayers are
    (an `nnx.MultiHeadAttention` read as its `query`, `key`, `value` and `out`
    projections, where the other side has separate ones)."""
    tree, adapter, native = side.tree, side.adapter, side.native
    role_nodes = dict(walk(roles(tree)))
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
        if path in side.wrapped:  # a model of another framework in a wrapper
            prefix, inner = side.wrapped[path]
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
        length, axis = _scanned(seen, path, side.trace) or _stacked(
            seen, path, leaves, problems, axes
        )
        if length and loose:
            layers += _stack_layers(
                seen, path, (length, axis), problems, native, views, opened
            )
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
    if adapter.name == canonical_adapter().name:  # Linen's nn.WeightNorm scales
        linen_weight_norms(layers, adapter.name, problems)
    for layer in open_square(layers):  # square kernels of a FlaxConv1D's model
        read_specs(layer, problems)
    if not told:
        tell_settings((layers, []), problems)
    return layers


def with_ties(
    side: Side,
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
    only with equal values (`_run.run`)."""
    at_leaf = {x.leaf(k): (x, k) for x in layers if x.index is None for k in x.paths}
    modules: dict[Path, dict[str, Path]] = {}
    for alias, held in ties.items():
        if held in at_leaf and alias and alias not in at_leaf:
            modules.setdefault(alias[:-1], {})[str(alias[-1])] = held
    if not modules:
        return layers
    adapter, native = side.adapter, side.native
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
    opened: frozenset[str] = frozenset(),
) -> list[Layer]:
    """The layers of a stack, one per index: `.blocks[3].Dense_0` is the fourth
    slice of `.blocks.Dense_0`'s arrays. `native`: the model, for the settings of
    a stack's modules where classes are recorded (one module stands for all).
    `stacked`: the stack's length and layer axis; a layer of a kind in `opened`
    is read as its sublayers, as `find_layers` does."""
    length, axis = stacked
    out: list[Layer] = []
    taken: set[Path] = set()
    for sub_path, sub in walk(seen.nodes[path], path):
        if taken and _under(sub_path, taken):
            continue
        arrays, paths = seen.arrays(sub_path)
        one = seen.leaves(sub_path, axis)
        found = seen.found(sub_path, axis)[0] if one else ()
        if not found or found[0].kind in opened:
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


def _scanned(seen: _Walk, path: Path, trace: Any) -> tuple[int, int] | None:
    """`(layer count, layer axis)` of a node whose arrays the traced forward pass
    all iterates over at one stored axis (a `scan` over a stack of layers: Equinox
    blocks made by `eqx.filter_vmap`, run by `lax.scan`), where the codecs
    recognise the node's layers with that axis dropped; None otherwise, or without
    a trace. A stack is a stack whatever the framework: the computation says it, not
    the shapes alone (an `eqx.nn.LayerNorm` reads a `(layers, D)` scale as its own
    shape)."""
    if not path or trace is None:
        return None
    arrays, paths = seen.arrays(path)
    ranks = {x.ndim for x in arrays.values()}
    if not arrays or min(ranks) < 1:
        return None
    lengths = {x.shape[0] for x in arrays.values()}
    if len(lengths) != 1 or lengths.pop() < 2 or not trace():
        return None
    scanned = trace.layer_axes()
    found = {scanned.get(path + paths[k]) for k in arrays}
    if len(found) != 1 or None in found:
        return None
    (axis,) = found
    counts = {x.shape[axis] for x in arrays.values() if x.ndim > axis}
    if len(counts) != 1 or not seen.covered(path, axis):
        return None
    return counts.pop(), axis


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
    except KeyError:  # a setting the module gives (heads, an equation): no answer
        return None
    except Exception:  # the codec's own refusal: not this layout
        return False
    return bool(flax.recognise(None, canonical))
