"""What one side says about the order of its layers: the order its forward pass
first uses them (given example inputs), else the order it created them in where that
is known (indices, Equinox fields, NNX attributes not sorted, numbered names), never
a dict's order. `normalised` reads a path's words (`layers_3` = `layers[3]`)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

from .._adapters._registry import APART, creation_order
from .._tree import Key, Path, Tree, items, kind, native_order, walk
from . import _errors
from ._branches import Branch, reads, signatures
from ._jaxpr import Position
from ._layer import ARRAY, Layer
from ._trace import Trace, layer_position


_WORDS = re.compile(r"[A-Za-z]+|[0-9]+|[^\x00-\x7f]+")
"""A name's words: ASCII letters, ASCII digits (numbers), and runs of other
characters kept as they are (`"layer١"` is not `"layer1"`)."""


_NUMBERED = re.compile(r"^(.*?)[_.\-]?(\d+)$")


def normalised(path: Path) -> tuple:
    """A path's words, lower case, numbers as ints: `.layers_3.Attn` and
    `.layers[3].attn` and `layers.3.attn` all give `("layers", 3, "attn")`."""
    words = _WORDS.findall("/".join(str(k) for k in path))
    return tuple(int(w) if w.isascii() and w.isdigit() else w.lower() for w in words)


def _number(key: Key) -> tuple[tuple, int] | None:
    if isinstance(key, int):
        return (), key
    match = _NUMBERED.match(key)
    if match is None:
        return None
    return normalised((match.group(1),)), int(match.group(2))


def _counted(path: Path | tuple) -> bool:
    """Whether a path (or its normalised words) holds a number (an index, `Dense_3`,
    `layers_2`): a count of positions more than a name."""
    return any(isinstance(w, int) for w in normalised(tuple(map(str, path))))


class Order:
    """What one Tree's order says about the creation order of its layers.

    A node's child order is the creation order when its keys are indices, when it is
    an Equinox module (fields in class order), or an NNX module whose attributes are
    not sorted (NNX sorts them when order is lost: `nnx.jit`, `eval_shape`,
    `nnx.merge`). A dict's order is never trusted (Linen's come back sorted from
    optax, or in any order from user code). Otherwise only numbered names of one
    prefix (`Dense_2` < `Dense_10`, natural order) say which came first."""

    def __init__(
        self,
        tree: Tree,
        stacks: set[Path] | frozenset = frozenset(),
        trace: Callable[[], Mapping[Path, Position] | None] | None = None,
        auto_named: frozenset[Path] = frozenset(),
    ):
        self._trace = trace
        self._auto = auto_named
        self._uses: Mapping[Path, Position] | None = None
        self._nodes: dict[Path, tuple[dict[Key, int], bool]] = {}
        # nodes whose arrays and submodules are each in creation order, but not
        # one against the other (`APART`): the keys of their arrays
        self._apart: dict[Path, frozenset[Key]] = {}
        self._kinds: dict[Path, object] = {}
        self._stacks = stacks  # layer i of stack `.blocks` is at `.blocks[i]...`
        native = native_order(tree)  # the Tree's own order is canonical
        for path, node in walk(tree):
            keys = list(native.get(path, ())) or [k for k, _ in items(node)]
            known = _known(node, keys)
            if known == APART:
                arrays = [k for k, v in items(node) if not isinstance(v, Tree)]
                self._apart[path] = frozenset(arrays)
            self._nodes[path] = ({k: i for i, k in enumerate(keys)}, bool(known))
            self._kinds[path] = kind(node)

    def unused(self, layers: list[Layer]) -> list[Layer]:
        """Of `layers`, names of a tied array (`Layer.tied`) that the traced
        forward pass never uses while another name of that array is used
        (transformers' `shared`, whose module T5 never calls: it looks the array
        up as `encoder.embed_tokens` and `decoder.embed_tokens`); none without a
        trace."""
        tied = [x for x in layers if x.tied]
        if not tied or self._trace is None:
            return []
        if self._uses is None:
            self._uses = self._trace() or {}
        if not self._uses:
            return []
        # a bias another name adds to a product (BERT's `cls.predictions.bias`,
        # added as `decoder.bias`) is used: it pairs as the loose array it is
        added = getattr(self._trace, "biases", frozenset)()
        used = [
            x
            for x in tied
            if any(
                x.path + p in self._uses
                or (x.kinds == (ARRAY,) and x.path + p in added)
                for p in x.paths.values()
            )
        ]
        arrays = {h for x in used for h in x.tied}
        return [x for x in tied if x not in used and not x.tied - arrays]

    def named(self, x: Layer) -> bool:
        """Whether `x`'s name is its model's own: no module on its path was named
        by its framework from what the process built before (`Adapter.auto_named`:
        Keras's `dense_1`), which pairs nothing by name."""
        base = x.real if x.index is not None else x.path
        return not any(base[:n] in self._auto for n in range(1, len(base) + 1))

    def idle(self, layers: list[Layer]) -> list[Layer]:
        """Of `layers`, those none of whose arrays the traced forward pass uses (a
        contact head only run when asked, a head a backbone never calls): left out
        of the pairing by shapes and order, never paired with a layer that is
        used; none without a trace. Names of a tied array are `unused`'s."""
        if self._trace is None or not self.was_traced():
            return []
        if self._uses is None:
            self._uses = self._trace() or {}
        return [x for x in layers if not x.tied and idle(x, self._uses)]

    def tracer(self) -> Any:
        """The side's trace where its forward pass was traced, else None."""
        return self._trace if self.was_traced() else None

    def was_traced(self) -> bool | None:
        """None without example inputs; else whether the forward pass was traced
        (a file or a state dict has none to trace)."""
        return None if self._trace is None else bool(self._trace())

    def _real(self, prefix: Path) -> Path:
        """The node's path in the Tree: a stack's layer index dropped."""
        return tuple(
            k
            for j, k in enumerate(prefix)
            if not (isinstance(k, int) and prefix[:j] in self._stacks)
        )

    def _node(self, prefix: Path) -> tuple[dict[Key, int], bool]:
        # a tied name's module may be no node of the Tree (it holds the array once)
        return self._nodes.get(self._real(prefix), ({}, False))

    def compare(self, a: Path, b: Path) -> int | None:
        """-1, 0 or 1 when the creation order of `a` and `b` is known, else None."""
        n = 0
        while n < len(a) and n < len(b) and a[n] == b[n]:
            n += 1
        if n == len(a) or n == len(b):  # a module before its own sublayers
            return (len(a) > len(b)) - (len(a) < len(b))
        if a[:n] in self._stacks:  # two layers of one stack: by index
            i, j = cast(int, a[n]), cast(int, b[n])
            return (i > j) - (i < j)
        positions, known = self._node(a[:n])
        if self._mixed(a[:n], (a[n], b[n])):
            return None
        if known and a[n] in positions and b[n] in positions:
            return (positions[a[n]] > positions[b[n]]) - (
                positions[a[n]] < positions[b[n]]
            )
        na, nb = _number(a[n]), _number(b[n])
        if na is None or nb is None or na[0] != nb[0]:
            return None
        return (na[1] > nb[1]) - (na[1] < nb[1])

    def _unknown(self, layers: list[Layer]) -> list[Path]:
        """The nodes where two of `layers` part and `compare` does not know which
        came first (not a stack, an order not known, names not numbered alike):
        found per node from the keys the layers take there, not per pair."""
        parting: dict[Path, set[Key]] = {}
        for x in layers:
            for n in range(len(x.path)):
                parting.setdefault(x.path[:n], set()).add(x.path[n])
        out = []
        for prefix, keys in parting.items():
            if len(keys) < 2 or prefix in self._stacks:
                continue
            positions, known = self._node(prefix)
            every = all(k in positions for k in keys)
            if known and every and not self._mixed(prefix, keys):
                continue
            numbers = [_number(k) for k in keys]
            if None in numbers or len({n[0] for n in numbers if n}) > 1:
                out.append(prefix)
        return out

    def _mixed(self, prefix: Path, keys: Iterable[Key]) -> bool:
        """Whether `keys` of the node at `prefix` are arrays and submodules of a
        node that orders each but not one against the other (`APART`)."""
        arrays = self._apart.get(self._real(prefix))
        return arrays is not None and len({k in arrays for k in keys}) > 1

    def why(self, layers: list[Layer]) -> str:
        """Why the creation order of `layers` is not known, for an error message."""
        for prefix in self._unknown(layers):
            # a module whose framework keeps creation order: sorted
            if creation_order(self._kinds.get(prefix), ()) is not None:
                return _errors.ORDER_SORTED
        return _errors.ORDER_DICT

    def traced(self, layers: list[Layer]) -> list[Layer] | None:
        """`layers` in the order the forward pass first uses them (`_trace`), or
        None without example inputs, or when it does not tell them all apart."""
        if self._trace is None:
            return None
        if self._uses is None:
            self._uses = self._trace() or {}
        keys = []
        for x in layers:
            base = x.real if x.index is not None else x.path
            leaf_paths = [base + p for p in x.paths.values()]
            if x.part is not None:  # a part of a fused layer: the fused arrays
                leaf_paths = [x.leaf(e) for e in x.paths]
            key = layer_position(self._uses, leaf_paths, x.index)
            if key is None:
                return None
            keys.append(key if x.part is None else key + (x.part[0],))
        if len(set(keys)) != len(keys):
            return None
        return [x for _, x in sorted(zip(keys, layers), key=lambda kx: kx[0])]

    def reads(self, layers: list[Layer]) -> list[tuple | None] | None:
        """Per layer, what its first use reads: `(stack index, the input's
        variables)`, equal for layers used side by side (`_branches`), None for a
        layer the pass does not use; None where the pass was not traced here (a
        file's recorded order)."""
        if not isinstance(self._trace, Trace):
            return None
        read = reads(self._trace)
        if read is None:
            return None
        if self._uses is None:
            self._uses = self._trace() or {}
        uses, out = self._uses, []
        for x in layers:
            used = [p for p in self._leaves(x) if p in uses]
            got = read.get(min(used, key=lambda p: uses[p])) if used else None
            out.append((x.index, got) if got else None)
        return out

    def branches(self, groups: list[list[Layer]]) -> list[list[Branch]] | None:
        """For each group of layers side by side, what each one's output flows
        into (`_branches.Branch`); None where the pass was not traced here."""
        if not isinstance(self._trace, Trace):
            return None
        if self._uses is None:
            self._uses = self._trace() or {}
        return signatures(self._trace, [[self._leaves(x) for x in g] for g in groups])

    def _leaves(self, x: Layer) -> list[Path]:
        """The paths a trace knows `x`'s arrays by: the Tree's leaves, or where a
        name of a tied tensor is a layer of its own (`Uses.tied`), that name's."""
        own = [x.path + p for p in x.paths.values()]
        if x.index is None and any(p in (self._uses or {}) for p in own):
            return own
        return [x.leaf(e) for e in x.paths]

    def sorted(self, layers: list[Layer]) -> list[Layer] | None:
        """`layers` in creation order, or None when that order is not known."""
        if self._unknown(layers):
            return None
        return sorted(
            layers,
            key=functools.cmp_to_key(lambda a, b: self.compare(a.path, b.path) or 0),
        )


def _known(node: Tree, keys: list[Key]) -> bool | str:
    cls = kind(node)
    if len(keys) <= 1 or all(isinstance(k, int) for k in keys):
        return True
    # a module of a framework that keeps creation order (the adapter's
    # `creation_order`: Equinox's fields, NNX's attributes unless sorted); else
    # a dict (Linen's): JAX and optax give them back sorted, and user code may
    # build them in any order, so its order is never trusted as creation order (a
    # shuffled dict then ports wrongly: tests/test_port_property.py); example inputs
    # give the order instead
    known = creation_order(cls, keys)
    return known if known == APART else bool(known)


def idle(x: Layer, uses: Mapping[Path, Position]) -> bool:
    """Whether the forward pass (its first uses, `uses`) reads none of `x`'s
    arrays."""
    base = x.real if x.index is not None else x.path
    return all(base + p not in uses for p in x.paths.values()) and all(
        x.leaf(e) not in uses for e in x.paths
    )
