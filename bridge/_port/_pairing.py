"""Pairing source layers with target layers, never trusting an order that may be lost.

Precedence: explicit `rules`; identical paths; names equal after normalisation
(`layers_3` = `layers[3]` = `layers.3`, case and separators ignored); then kind and
shapes, using order only where it is known to be the creation order (`Order`). A
choice that is not unique is an `ambiguous` problem, never a guess.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from . import _errors
from ._align import _align
from ._branches import _described, _matched, _parts
from ._feeds import alike, repaired
from ._layer import Layer, common_kind, layer_signature, same_shapes
from ._order import Order, _counted, normalised
from ._split import SPLIT


ONE_SIDE = "one side"
"""`_Pairing.in_order`'s answer where only one side was traced and that side uses
its layers in another order than it created them."""


class Pair(NamedTuple):
    """A source layer, the target layer it fills, and what paired them: `"rule"`,
    `"path"`, `"name"`, `"shape"` (the only layer of its kind and shapes), `"trace"`
    (the order of use of both forward passes, or the only layer of its kind and
    shapes that both use), `"order"`
    (kind, shapes and creation order), `"kind"` (the only layer of its kind)."""

    source: Layer
    target: Layer
    by: str


def undecided(traced: Sequence[bool | None]) -> str:
    """What would decide a choice names, shapes and order leave open, given
    whether each side was traced (`Order.was_traced`): example inputs when none
    were given, else which side's forward pass could not be traced (never "give
    example inputs" when they were given)."""
    if traced == [None, None]:
        return _errors.GIVE_EXAMPLE
    untraced = [side for side, t in zip(("source", "target"), traced) if not t]
    if untraced:
        return _errors.UNTRACED.format(sides=" and the ".join(untraced))
    return _errors.TRACED_ALIKE


def _share_kinds(a: list[Layer], b: list[Layer]) -> bool:
    """Whether every layer of `a` shares a kind with every layer of `b` (asked once
    per distinct candidate kinds on each side, not per pair)."""
    kinds_a = {x.kinds: x for x in a}.values()
    kinds_b = {y.kinds: y for y in b}.values()
    return all(common_kind(x, y) for x in kinds_a for y in kinds_b)


def _fits(a: Layer, b: Layer) -> bool:
    k = common_kind(a, b)
    return k is not None and same_shapes(a, b, k)


def _sortable(words: tuple) -> tuple:
    """Normalised words made comparable whatever their types (`("decoder", 0, "key")`
    beside `("decoder", "key")`): numbers before words at one position."""
    return tuple((isinstance(w, str), w) for w in words)


def _indexed_name(x: Layer) -> tuple:
    """A layer's indices and last name: `.model.layers[1].mlp.up_proj` and
    `.layers[1].mlp.up_proj` both give `((1,), ("up", "proj"))`."""
    words = normalised(x.path)
    last = normalised(x.path[-1:])
    return tuple(w for w in words[: len(words) - len(last)] if isinstance(w, int)), last


class _Pairing:
    def __init__(self, sources, targets, source_order, target_order, problems):
        self.sources, self.targets = sources, targets
        self.orders = (source_order, target_order)
        self.problems = problems
        self.pairs: list[Pair] = []
        self.ambiguous: set[int] = set()
        self.paired: set[int] = set()
        self.left: list[Layer] = []  # names of a tied array the pass does not use

    def add(self, s: Layer, t: Layer, by: str) -> None:
        self.pairs.append(Pair(s, t, by))
        self.paired.update((id(s), id(t)))

    def rest(self, side: int) -> list[Layer]:
        layers = self.targets if side else self.sources
        done = self.paired | self.ambiguous | {id(x) for x in self.left}
        return [x for x in layers if id(x) not in done]

    def idle(self) -> None:
        """Leave out of the pairing by shapes and order the layers neither name
        paired that their side's forward pass does not use (`Order.idle`); two
        such layers, one a side, of one last name each side holds once and of one
        kind and shapes, pair by that name (DINOv2's `embeddings.mask_token` and
        a rewrite's `mask_token`: nothing else tells, and no guess by order)."""
        found = [self.orders[side].idle(self.rest(side)) for side in (0, 1)]
        last: list[dict[tuple, list[Layer]]] = [{}, {}]
        for side in (0, 1):
            for x in found[side]:
                if self.orders[side].named(x):
                    last[side].setdefault(normalised(x.path[-1:]), []).append(x)
        for name, xs in last[0].items():
            ys = last[1].get(name, [])
            if len(xs) == 1 == len(ys) and _fits(xs[0], ys[0]) and name:
                self.add(xs[0], ys[0], "name")
        for side in (0, 1):
            self.left += [x for x in found[side] if id(x) not in self.paired]

    def unused_ties(self) -> None:
        """Leave out of the pairing by shapes and order the names of a tied
        array that names did not pair and the forward pass does not use (`Order.
        unused`): the used names pair in the order of their uses."""
        for side in (0, 1):
            self.left += self.orders[side].unused(self.rest(side))

    def rules(self, rules: Mapping[str, str]) -> None:
        by_where = {t.where: t for t in self.targets}
        ruled: dict[int, list[Layer]] = {}
        for pattern, replacement in rules.items():
            used = False
            for s in self.sources:
                match = re.fullmatch(pattern, s.where)
                if match is None or id(s) in self.paired:
                    continue
                used = True
                where = match.expand(replacement)
                t = by_where.get(where)
                if t is None:
                    self.problems.append(
                        _errors.RULE_TARGET.format(
                            pattern=pattern,
                            source=s.where,
                            target=where,
                            layers=[t.where for t in self.targets],
                        )
                    )
                    continue
                if common_kind(s, t) is None:
                    self.problems.append(
                        _errors.KIND.format(
                            source=s.where,
                            source_kind="/".join(s.kinds),
                            target=t.where,
                            target_kind="/".join(t.kinds),
                        )
                    )
                ruled.setdefault(id(t), []).append(s)
                self.add(s, t, "rule")
            if not used:
                self.problems.append(
                    _errors.RULE_UNUSED.format(
                        pattern=pattern, layers=[s.where for s in self.sources]
                    )
                )
        for t in self.targets:
            if len(ruled.get(id(t), ())) > 1:
                self.problems.append(
                    _errors.RULE_TWICE.format(
                        target=t.where, sources=[s.where for s in ruled[id(t)]]
                    )
                )

    def names(self) -> list[tuple[Layer, Layer]]:
        """Identical paths, then names equal after normalisation (each name once on
        each side). A match whose shapes differ binds only between names without
        numbers: an index (`layers[1]`) or a Linen auto-name (`Dense_0`) counts
        positions, and a model with one layer more or fewer shifts them; those
        matches are kept for the end (`fallback`)."""
        fallback = []
        for how, name in (("path", tuple), ("name", normalised)):
            found: list[dict] = [{}, {}]
            for side in (0, 1):
                for x in self.rest(side):
                    if self.orders[side].named(x):
                        found[side].setdefault(name(x.path), []).append(x)
            for key, (s, *more) in found[0].items():
                ts = found[1].get(key, [])
                if more or len(ts) != 1 or common_kind(s, ts[0]) is None:
                    continue
                t = ts[0]
                if _fits(s, t) or not (_counted(s.path) or _counted(t.path)):
                    self.add(s, t, how)
                else:
                    fallback.append((s, t))
        return fallback

    def shapes(self) -> None:
        """Groups of one kind and shapes: one on each side pair; several pair in
        their orders of use (layers side by side by what follows them: `decide`,
        once for every group) or creation order when both sides know it, else
        they are ambiguous."""
        groups: dict[tuple, tuple[list[Layer], list[Layer]]] = {}
        for side in (0, 1):
            for x in self.rest(side):
                groups.setdefault(layer_signature(x), ([], []))[side].append(x)
        pending: list[tuple[Layer, Layer]] = []  # traced: paired once all are seen
        side_by_side: list[tuple[list[Layer], list[Layer]]] = []
        for a, b in groups.values():
            if not _share_kinds(a, b):
                continue
            if len(a) > 1 and len(b) > 1:
                a, b = self._last_names(a, b)
            if len(a) != len(b) or not a:
                continue
            if len(a) == 1:  # both forward passes use it: `_contradicted` checks
                traced = all(o.traced(x) for o, x in zip(self.orders, (a, b)))
                self.add(a[0], b[0], "trace" if traced else "shape")
                continue
            oa, ob, by = self.in_order(a, b)
            if by == ONE_SIDE:
                self._one_side(a, b)
                continue
            if oa is None or ob is None:
                self._unordered(a, b, 0 if oa is None else 1)
                continue
            if by != "trace":
                for s, t in zip(oa, ob):
                    self.add(s, t, by)
                continue
            paired, found = self.side_by_side(oa, ob)
            pending += paired
            side_by_side += found
        for s, t in pending + self.decide(side_by_side):
            self.add(s, t, SPLIT if s.part or t.part else "trace")

    def side_by_side(
        self, a: list[Layer], b: list[Layer]
    ) -> tuple[list[tuple[Layer, Layer]], list[tuple[list[Layer], list[Layer]]]]:
        """`(pairs, groups)`: `a[i]` with `b[i]` (both sides' layers in their
        orders of use), except layers used side by side (one kind and shapes, one
        input: `_branches`), given apart as groups for `decide`, and refused where
        only one side uses them so: never paired by the order in which each pass
        happens to compute them."""
        pairs = list(zip(a, b))
        reads = [o.reads(x) for o, x in zip(self.orders, (a, b))]
        if reads[0] is None or reads[1] is None:  # a file's recorded order
            return pairs, []
        parts = [_parts(r, x) for r, x in zip(reads, (a, b))]
        groups, left, seen = [], [], set()
        for i in range(len(pairs)):
            if i in seen:
                continue
            together, grown = {i}, True
            while grown:
                more = {j for k in together for side in parts for j in side[k]}
                grown = not more <= together
                together |= more
            seen |= together
            at = sorted(together)
            if len(at) == 1:
                left.append(pairs[i])
            elif parts[0][i] == parts[1][i] == frozenset(at):
                groups.append(at)
            else:  # side by side on one side only
                side = 0 if len(parts[0][i]) > 1 else 1
                self._ambiguous(
                    [a[j] for j in at],
                    [b[j] for j in at],
                    _errors.SIDE_BY_SIDE,
                    why=_errors.SIDE_BY_SIDE_ONE.format(
                        side=("source", "target")[side],
                        other=("source", "target")[1 - side],
                    ),
                )
        return left, [([a[j] for j in at], [b[j] for j in at]) for at in groups]

    def named(self) -> None:
        """Layers paired by their names (`names`) that both sides use side by side
        (`side_by_side`): where what their outputs flow into pairs them otherwise
        on both sides (`_matched`), a problem. Names are a model's word, the
        computation is what it does (an NNX MLP naming its SiLU branch `up_proj`
        against Llama's `gate_proj`)."""
        named = [x for x in self.pairs if x.by in ("path", "name")]
        a, b = [x.source for x in named], [x.target for x in named]
        reads = [o.reads(x) for o, x in zip(self.orders, (a, b))]
        if len(named) < 2 or reads[0] is None or reads[1] is None:
            return
        parts = [_parts(r, x) for r, x in zip(reads, (a, b))]
        groups = sorted(
            {g for i, g in enumerate(parts[0]) if len(g) > 1 and parts[1][i] == g},
            key=min,
        )
        groups = [sorted(g) for g in groups if all(parts[1][i] == g for i in g)]
        if not groups:
            return
        found = [
            o.branches([[x[i] for i in g] for g in groups])
            for o, x in zip(self.orders, (a, b))
        ]
        if found[0] is None or found[1] is None:
            return
        for g, ba, bb in zip(groups, found[0], found[1]):
            matched = _matched(ba, bb)
            if matched is None or all(i == j for i, j in matched):
                continue
            computed = [(a[g[i]].where, b[g[j]].where) for i, j in matched]
            self.problems.append(
                _errors.CONTRADICTED_SIDE_BY_SIDE.format(
                    pairs=", ".join(f"{a[i].where} -> {b[i].where}" for i in g),
                    by=", ".join(sorted({named[i].by for i in g})),
                    computed=", ".join(f"{s} -> {t}" for s, t in computed),
                    sources=_described([a[i] for i in g], ba),
                    targets=_described([b[i] for i in g], bb),
                    rules="{"
                    + ", ".join(f"r'{re.escape(s)}': '{t}'" for s, t in computed)
                    + "}",
                )
            )

    def decide(
        self, groups: list[tuple[list[Layer], list[Layer]]]
    ) -> list[tuple[Layer, Layer]]:
        """Layers side by side (`side_by_side`'s groups), paired by what their
        outputs flow into (`_branches`, one walk of each side's program for all
        the groups) where that tells each from the others alike on both sides,
        and refused otherwise."""
        if not groups:
            return []
        found = [
            o.branches([g[side] for g in groups]) for side, o in enumerate(self.orders)
        ]
        if found[0] is None or found[1] is None:
            return [st for sa, sb in groups for st in zip(sa, sb)]
        left = []
        for (sa, sb), ba, bb in zip(groups, found[0], found[1]):
            if all(x.part for x in sa) or all(x.part for x in sb):
                left += list(zip(sa, sb))  # the parts of one fused layer: which is
                continue  # which the example inputs check (`_split`)
            matched = _matched(ba, bb)
            if matched is not None:
                left += [(sa[i], sb[j]) for i, j in matched]
                continue
            alike = [
                (side, layers, branches)
                for side, layers, branches in (("source", sa, ba), ("target", sb, bb))
                if len(set(branches)) < len(branches)
            ]
            if alike:
                side, layers, branches = alike[0]
                why = _errors.SIDE_BY_SIDE_ALIKE.format(
                    side=side, layers=_described(layers, branches)
                )
            else:
                why = _errors.SIDE_BY_SIDE_DIFFER.format(
                    sources=_described(sa, ba), targets=_described(sb, bb)
                )
            self._ambiguous(sa, sb, _errors.SIDE_BY_SIDE, why=why)
        return left

    def in_order(
        self, a: list[Layer], b: list[Layer]
    ) -> tuple[list[Layer] | None, list[Layer] | None, str]:
        """Both sides' layers in the order their forward passes use them (given
        example inputs, both sides traced), else in creation order where both sides
        know it (None where a side does not), and what ordered them (`"trace"` or
        `"order"`). One side's order of use is never matched with the other's
        order of creation: a model may create its layers in any order (an NNX
        file's creation order against a rewrite's order of use ported wrongly)."""
        ta, tb = self.orders[0].traced(a), self.orders[1].traced(b)
        if (ta is None) != (tb is None):
            # one side traced (a file, a state dict: the other has no forward pass),
            # the other's known order the order its layers were created in: paired
            # with the traced side's order of use only where that side was created
            # in that order too, or its creation order is not known
            side = 0 if ta is not None else 1
            created = self.orders[side].sorted((a, b)[side])
            other = self.orders[1 - side].sorted((a, b)[1 - side])
            used = ta if side == 0 else tb
            if None not in (created, other) and created != used:
                return None, None, ONE_SIDE
        oa = ta if ta is not None else self.orders[0].sorted(a)
        ob = tb if tb is not None else self.orders[1].sorted(b)
        return oa, ob, "trace" if ta is not None or tb is not None else "order"

    def _last_names(self, a: list[Layer], b: list[Layer]):
        """Within a group of one kind and shapes, pair the layers whose last names
        match, each once (`.ResNetBlock_1.norm_proj` and `.blocks[1].norm_proj`);
        return the others. Numbered names are left to order: `Conv_1` counts from
        0, `conv1` often from 1. Where the last names repeat (one per block) and
        both sides were traced, the layers pair by their indices and last name
        when that names every layer of the group once, alike on both sides
        (`.model.layers[1].mlp.up_proj` and `.layers[1].mlp.up_proj`): two
        implementations may compute a block's
        parallel branches in either order (`silu(gate(x)) * up(x)`), so neither
        order of use nor creation says which is which there; the names do."""
        last = [{}, {}]
        for side, layers in ((0, a), (1, b)):
            for x in layers:
                last[side].setdefault(normalised(x.path[-1:]), []).append(x)
        for name, found in last[0].items():
            other = last[1].get(name, [])
            if name and not _counted(name) and len(found) == 1 and len(other) == 1:
                self.add(found[0], other[0], "name")
        return self._by_index(
            [x for x in a if id(x) not in self.paired],
            [x for x in b if id(x) not in self.paired],
        )

    def _one_side(self, a: list[Layer], b: list[Layer]) -> None:
        """The problem of layers that one side's forward pass uses in another order
        than it created them, where the other side has no forward pass (`in_order`)."""
        side = [o.was_traced() for o in self.orders].index(True)
        self._ambiguous(
            a,
            b,
            _errors.ONE_SIDE_TRACED,
            traced=("source", "target")[side],
            other=("source", "target")[1 - side],
        )

    def _by_index(self, a: list[Layer], b: list[Layer]):
        """Pair the layers of `a` and `b` whose indices and last name
        (`_indexed_name`) each side gives one layer, where both forward passes were
        traced (their orders of use would pair them otherwise, and differ only
        where a block's branches run in another order: a Griffin block's
        `linear_x` and `linear_y`; without traces a prefix that names do not
        explain stays a problem, with its fix); return the others. Names made up by
        a framework (`Order.named`) pair nothing."""
        if not all(o.was_traced() for o in self.orders):
            return a, b
        keys: list[dict[tuple, list[Layer]]] = [{}, {}]
        for side, layers in ((0, a), (1, b)):
            for x in layers:
                if self.orders[side].named(x):
                    keys[side].setdefault(_indexed_name(x), []).append(x)
        every = (
            keys[0].keys() == keys[1].keys()
            and all(len(v) == 1 for side in keys for v in side.values())
            and sum(map(len, keys[0].values())) == len(a)
        )
        for key, xs in keys[0].items():
            ys = keys[1].get(key, [])
            # a numbered last name (`Conv_1`, `conv1`) counts positions: it pairs
            # only where every layer's name pairs so
            if (
                len(xs) == 1 == len(ys)
                and len(a) > 1
                and (every or not _counted(key[1]))
            ):
                self.add(xs[0], ys[0], "name")
        return (
            [x for x in a if id(x) not in self.paired],
            [x for x in b if id(x) not in self.paired],
        )

    def indexed(self) -> None:
        """The layers left, in groups of one common kind and equal shapes in it
        (a file's layer may read as several kinds, so `shapes` may have grouped it
        apart), paired by `_by_index` before any order aligns them."""
        rest_s, rest_t = self.rest(0), self.rest(1)
        kinds = {k for x in rest_s for k in x.kinds} & {
            k for x in rest_t for k in x.kinds
        }
        for kind_ in sorted(kinds):
            groups: dict[tuple, tuple[list[Layer], list[Layer]]] = {}
            for side in (0, 1):
                for x in self.rest(side):
                    if kind_ in x.kinds:
                        spec = x.specs[kind_]
                        key = tuple(sorted((k, v.shape) for k, v in spec.items()))
                        groups.setdefault(key, ([], []))[side].append(x)
            for a, b in groups.values():
                if len(a) > 1 and len(a) == len(b):
                    self._by_index(a, b)

    def _unordered(self, a: list[Layer], b: list[Layer], side: int) -> None:
        self._ambiguous(
            a,
            b,
            _errors.AMBIGUOUS_ORDER,
            side=("source", "target")[side],
            why=self.orders[side].why((a, b)[side]),
            decide=undecided([o.was_traced() for o in self.orders]),
        )

    def _ambiguous(
        self, a: list[Layer], b: list[Layer], message: str, **fields: str
    ) -> None:
        """`message` for same-kind, same-shape layers that cannot be paired, all
        marked ambiguous."""
        a = sorted(a, key=lambda x: _sortable(normalised(x.path)))
        b = sorted(b, key=lambda x: _sortable(normalised(x.path)))
        self.ambiguous.update(map(id, a + b))
        self.problems.append(
            message.format(
                kind="/".join(a[0].kinds),
                shapes=a[0].shapes(),
                sources=[s.where for s in a],
                targets=[t.where for t in b],
                source_re=re.escape(a[0].where),
                **fields,
            )
        )

    def preceded(self) -> None:
        """Re-pair what the orders of use paired against what feeds each layer
        (`_feeds.repaired`), both forward passes traced."""
        traces = [o.tracer() for o in self.orders]
        if traces[0] is not None and traces[1] is not None:
            self.pairs = repaired(self.pairs, traces)

    def loose_alike(self) -> None:
        """Refuse loose arrays a forward pass computes side by side, which the
        orders of use paired (`_feeds.alike`), both forward passes traced."""
        traces = [o.tracer() for o in self.orders]
        if traces[0] is None or traces[1] is None:
            return
        gone: set[int] = set()
        for at in alike(self.pairs, traces):
            gone.update(at)
            self._ambiguous(
                [self.pairs[k].source for k in at],
                [self.pairs[k].target for k in at],
                _errors.SIDE_BY_SIDE,
                why=_errors.LOOSE_ALIKE,
            )
        for k in gone:
            p = self.pairs[k]
            self.paired.difference_update((id(p.source), id(p.target)))
        self.pairs = [p for k, p in enumerate(self.pairs) if k not in gone]

    def remainder(self) -> None:
        """What names and equal-shape groups left: an alignment in creation order
        (most equal-shape pairs, then most pairs) when both sides know it, else
        only layers that are each other's single candidate of their kind."""
        rest_s, rest_t = self.rest(0), self.rest(1)
        if not any(common_kind(s, t) for s in rest_s for t in rest_t):
            return
        oa, ob, by = self.in_order(rest_s, rest_t)
        if by == ONE_SIDE:
            self._one_side(rest_s, rest_t)
            return
        if oa is not None and ob is not None:
            aligned = _align(
                oa,
                ob,
                self.problems,
                self.ambiguous,
                undecided([o.was_traced() for o in self.orders]),
            )
            if by == "trace":
                aligned, found = self.side_by_side(
                    [s for s, _ in aligned], [t for _, t in aligned]
                )
                aligned += self.decide(found)
            for s, t in aligned:
                self.add(s, t, by)
            return
        for s in rest_s:
            candidates = [t for t in rest_t if common_kind(s, t)]
            if len(candidates) == 1:
                t = candidates[0]
                if [x for x in rest_s if common_kind(x, t)] == [s]:
                    self.add(s, t, "kind")


def pair(
    sources: list[Layer],
    targets: list[Layer],
    rules: Mapping[str, str] | None,
    problems: list[str],
    orders: tuple[Order, Order],
) -> tuple[list[Pair], list[Layer], list[Layer]]:
    """`(pairs, unpaired sources, unpaired targets)`, pairs in target order; layers
    left unpaired by an ambiguity are reported as such, not as unpaired."""
    p = _Pairing(sources, targets, orders[0], orders[1], problems)
    p.rules(rules or {})
    fallback = p.names()
    p.unused_ties()
    p.idle()
    p.shapes()
    for s, t in fallback:
        if id(s) not in p.paired and id(t) not in p.paired:
            p.add(s, t, "name")
    p.indexed()
    p.remainder()
    p.preceded()
    p.loose_alike()
    p.named()
    position = {id(t): i for i, t in enumerate(targets)}
    pairs = sorted(p.pairs, key=lambda st: position[id(st.target)])
    p.left = []  # unpaired: delivered through another name, or unexpected
    return pairs, p.rest(0), p.rest(1)
