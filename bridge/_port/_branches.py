"""Layers used side by side, told apart by what their outputs flow into, not by order.

Two layers of one kind and shapes that read one input (a gated MLP's gate and up;
attention's query, key and value) are *side by side*: neither is computed from the
other, and which one a model computes first is its own choice, so the order of use
(`_trace`) does not pair them across two implementations. What tells them apart is
the computation after each: `silu(gate(x)) * up(x)` applies `logistic` and `mul` to
the gate alone, then merges it with the up; `q @ k.T` takes the query's rows and the
key's columns, and the value meets what the query and key became.

A `Branch` records that, per layer, from the abstract trace of the forward pass
(the `jax.make_jaxpr` program `_trace.first_uses` keeps):

- `alone`: the primitives applied to the layer's output before it meets another
  layer of its group (`logistic`, `mul`), leaving out relayouts (`reshape`,
  `transpose`, casts) and scalings by constants or weights (`q * d ** -0.5` here or
  on the scores is one computation);
- `product`: whether two values computed from it alone are contracted together
  (an attention's scores after one norm: the norm before an attention, not the
  one before an MLP, when both read the residual stream);
- `merges`: where it meets the others: the primitive, its place in it (none for
  `add`, `mul`, `max`, `min`; for a `dot_general`, whether its free axes come first
  in the result, after a transpose that directly follows, as `jnp.einsum` writes
  it; else the operand's index), and how many other layers of the group the other
  operands carry; a model's output it reaches with its group unmerged counts too.

A PyTorch side keeps no program: its recorder notes where activations of
different parameters meet (`Uses.merges`, in these terms: `_torch_merges`) and
whether each layer's output is changed by itself first (`Uses.alone`);
`recorded` reads the same `merges` from that record, and `alone` as that one bit.

Signatures are compared only within one side's group; two sides pair by equal
signatures (`_pairing._Pairing.side_by_side`), and where they cannot tell the
layers apart the port is refused, never paired by order.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp

from .._paths import Path
from ._jaxpr import _SEEN_THROUGH, Program, _literal, _subs
from ._layer import Layer, layer_signature
from ._trace import Trace


_RELAYOUT = _SEEN_THROUGH | {"reduce_precision", "optimization_barrier"}
"""Primitives that move or cast an array without computing with it."""

_COMMUTATIVE = frozenset({"add", "add_any", "mul", "max", "min", "and", "or", "xor"})
"""Primitives whose operands' places do not matter (`a * b` is `b * a`)."""

_SCALING = frozenset({"add", "sub", "mul", "div"})
"""Primitives that, with a constant or weight operand, scale or shift: where they
happen (on the query or on the scores) is an implementation's choice."""


class Branch(NamedTuple):
    """What one layer's output flows into until it meets the other layers of its
    group (module docstring)."""

    alone: frozenset[str]
    merges: frozenset[tuple[str, int | None, int]]
    product: bool = False
    """Whether two values computed from it alone are contracted together (an
    attention's scores: what a norm before the attention feeds, not one before an
    MLP), as both frameworks write it (`dot_general`, `matmul`, `sdpa`)."""

    def words(self) -> str:
        """The signature as a message says it: `logistic, mul, then mul`."""
        alone = ", ".join(sorted(self.alone)) or "nothing"
        if self.product:
            alone += " (two of its values contracted)"
        merges = sorted(
            f"{name}{'' if at is None else f' as operand {at}'} with {n} other(s)"
            for name, at, n in self.merges
        )
        return f"{alone}, then {'; '.join(merges) or 'no merge'}"


class _Value(NamedTuple):
    """What the walk knows of one variable of the program."""

    root: Any  # the value it is computed from with no weight and no other
    # value of the model's inputs (relaid out, `x - mean(x)`): an input variable,
    # or a token per evaluation of the operation that computed it
    leaf: int | None  # the parameter it holds (through relayouts), or None
    fed: bool  # computed from the model's inputs
    mask: int  # the group layers (a bit each) it is computed from


_CONSTANT = _Value(None, None, False, 0)


def inputs(program: Program) -> dict[int, frozenset]:
    """`{leaf index: the variables its first use computes it with}`: the inputs of
    the first operation on the model's inputs that reads the leaf, each seen back
    through what is computed from it alone, with no weight (relayouts, a norm's
    `(x - mean(x)) * rsqrt(var(x) + eps)` before its scale): two layers reading
    one `x` give the same set, and so do two norms of `x`."""
    walk = _Walk({}, [])
    walk.run(program.jaxpr, _start(program))
    return walk.first


def branches(program: Program, groups: Sequence[Sequence[frozenset[int]]]) -> list:
    """For each group (each layer's leaf indices), each layer's `Branch`.

    **Arguments:**

    - `program`: the traced forward pass.
    - `groups`: layers side by side, as the sets of leaf indices they hold; a
      layer holding no leaf of the program gets an empty `Branch`.

    **Returns:**

    A list per group of one `Branch` per layer, in the groups' order.
    """
    bits, sets, bit = {}, [], 0
    for group in groups:
        mask = 0
        for layer in group:
            for leaf in layer:
                bits[leaf] = bit
            mask |= 1 << bit
            bit += 1
        sets.append(mask)
    walk = _Walk(bits, sets)
    outs = walk.run(program.jaxpr, _start(program))
    for k, value in enumerate(outs):  # an output its group reaches unmerged
        for group in sets:
            part = value.mask & group
            if part and part != group:
                for b in _bits(part):
                    walk.merges[b].add(("output", k, 0))
    out, bit = [], 0
    for group in groups:
        found = []
        for _ in group:
            found.append(
                Branch(
                    frozenset(walk.alone[bit]),
                    frozenset(walk.merges[bit]),
                    bit in walk.products,
                )
            )
            bit += 1
        out.append(found)
    return out


CHANGED = "changed by itself"
"""A PyTorch layer's `Branch.alone` where `Uses.alone` says it is."""


def reads(trace: Trace) -> Mapping[Path, frozenset] | None:
    """`{leaf path: what its first use computes it with}` (`inputs`, or PyTorch's
    `Uses.reads`: equal for layers that read one input) of a traced side, or None
    where it was not traced here (a file's recorded order)."""
    if not trace():
        return None
    if not trace.read and trace.program:
        program, paths = trace.program[0]
        trace.read.append({paths[i]: x for i, x in inputs(program).items()})
    return trace.read[0] if trace.read else None


def signatures(trace: Trace, groups: list[list[list[Path]]]) -> list | None:
    """For each group of layers side by side (each layer as its leaf paths), each
    layer's `Branch` in `trace`'s program (or PyTorch's record: `recorded`); None
    where it was not traced here."""
    if not trace():
        return None
    if not trace.program:
        return recorded(trace, groups) if trace.merges else None
    program, paths = trace.program[0]
    index = {p: i for i, p in enumerate(paths)}
    sets = [
        tuple(frozenset(index[p] for p in layer if p in index) for layer in group)
        for group in groups
    ]
    # a stack's layers share their arrays: each group of them once
    unique = list(dict.fromkeys(sets))
    found = dict(zip(unique, branches(program, unique)))
    return [found[group] for group in sets]


def recorded(trace: Trace, groups: list[list[list[Path]]]) -> list:
    """`signatures` from a PyTorch side's record: per group, each layer's `Branch`,
    its `merges` read from `Uses.merges` as `branches` reads them from a program
    (an output without its index: which is which is each model's own order), its
    `alone` `{CHANGED}` where `Uses.alone` says so.

    Each merge is read for the groups it can change, found by the parameter bits
    that differ between its operands and between one product and the next
    (`_Meets`), not for every group: linear in the merges, but for a model's
    outputs (read for every group)."""
    needs = trace.upstream()
    meets = _Meets([[_mask(needs, layer) for layer in group] for group in groups])
    for name, operands in trace.merges:
        for k in meets.reached(name, operands):
            meets.meet(k, name, operands)
    return [
        [
            Branch(
                frozenset({CHANGED} if masks[j] and _changed(trace, x) else ()),
                frozenset(f),
                j in products,
            )
            for j, (x, f) in enumerate(zip(group, found))
        ]
        for group, masks, found, products in zip(
            groups, meets.masks, meets.found, meets.products
        )
    ]


class _Meets:
    """What `recorded` gathers per group of layers (each layer's parameter bits,
    `masks`): each layer's merges (`found`) and product (`products`)."""

    def __init__(self, masks: list[list[int]]):
        self.whole: list[int] = []
        self.owners: dict[int, list[tuple[int, int]]] = defaultdict(list)
        """`{parameter bit: (group, layer) for each layer holding it}`."""
        for k, group in enumerate(masks):
            whole = 0
            for m in group:
                if whole & m:  # one tensor for two of them (a tie): not told apart
                    masks[k] = [0] * len(group)
                    whole = 0
                    break
                whole |= m
            self.whole.append(whole)
            for j, m in enumerate(masks[k]):
                for b in _set_bits(m):
                    self.owners[b].append((k, j))
        self.masks = masks
        self.found: list[list[set]] = [[set() for _ in group] for group in masks]
        self.products: list[set[int]] = [set() for _ in masks]
        # the layers present in the last product's operands (`reached`): per
        # layer its bits there, per group its layers there, and the groups with
        # one layer there that is not yet its `Branch.product`
        self.union = 0
        self.bits = [[0] * len(group) for group in masks]
        self.present = [0] * len(masks)
        self.single: set[int] = set()

    def reached(self, name: str, operands: tuple) -> set[int]:
        """The groups that a merge can change: with a layer in some operands and
        not in others; for a product, also with one layer in its operands (in
        all: its `Branch.product`, once); for an output, all (they are few)."""
        if name == "output":
            return {k for k, whole in enumerate(self.whole) if whole}
        union, common = 0, -1
        for _, bits in operands:
            union |= bits
            common &= bits
        reached = set()
        for b in _set_bits(union & ~common):
            reached.update(k for k, _ in self.owners.get(b, ()))
        if name == "dot_general":
            self._present(union)
            reached |= self.single
        return reached

    def _present(self, union: int) -> None:
        """Move `present` and `single` to a product whose operands hold `union`,
        from the last one's (the bits that differ only: linear in the merges
        where each product adds the layers since the last)."""
        touched = set()
        for b in _set_bits(union ^ self.union):
            step = 1 if union >> b & 1 else -1
            for k, j in self.owners.get(b, ()):
                before = self.bits[k][j]
                self.bits[k][j] += step
                if not before or not self.bits[k][j]:
                    self.present[k] += step
                    touched.add(k)
        self.union = union
        for k in touched:
            self._single(k)

    def _single(self, k: int) -> None:
        if self.present[k] == 1:
            j = next(j for j, n in enumerate(self.bits[k]) if n)
            if j not in self.products[k]:
                self.single.add(k)
                return
        self.single.discard(k)

    def meet(self, k: int, name: str, operands: tuple) -> None:
        """Read one merge for group `k`, as `branches` reads a program."""
        masks, found = self.masks[k], self.found[k]
        parts = [
            frozenset(j for j, m in enumerate(masks) if bits & m)
            for _, bits in operands
        ]
        met = frozenset().union(*parts)
        if name == "dot_general" and len(met) == 1 and all(parts):
            self.products[k] |= met
            self.single.discard(k)
        if name == "output":
            for j in met if len(met) < len(masks) else ():
                found[j].add(("output", None, 0))
            return
        for (place, _), part in zip(operands, parts):
            if part and part != met:
                for j in part:
                    found[j].add((name, place, len(met - part)))


def _changed(trace: Trace, layer: list[Path]) -> bool:
    return any(trace.alone.get(p) for p in layer)


def _mask(needs: Mapping[Path, tuple[int, int]], layer: list[Path]) -> int:
    """The bits of a layer's parameters (`Uses.needs`)."""
    mask = 0
    for p in layer:
        if p in needs:
            mask |= needs[p][0]
    return mask


def _start(program: Program) -> dict[Any, _Value]:
    invars = program.jaxpr.invars
    env = {v: _Value(v, i, False, 0) for i, v in enumerate(invars[: program.leaves])}
    env.update({v: _Value(v, None, True, 0) for v in invars[program.leaves :]})
    return env


def _bits(mask: int) -> list[int]:
    return [b for b in range(mask.bit_length()) if mask >> b & 1]


def _set_bits(mask: int) -> list[int]:
    """`_bits(mask)` in time proportional to the bits set (a mask of all the
    parameters upstream has hundreds of bits, few set where it matters)."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class _Walk:
    """One pass over the program in equation order, entering sub-computations
    (`pjit`, `custom_jvp_call`, `scan`'s body once, each `cond` branch)."""

    def __init__(self, bits: dict[int, int], sets: list[int]):
        self.bits = bits  # {leaf index: its layer's bit}
        self.sets = sets  # each group's bits
        self.first: dict[int, frozenset] = {}
        self.alone: dict[int, set[str]] = defaultdict(set)
        self.merges: dict[int, set[tuple[str, int | None, int]]] = defaultdict(set)
        self.single: dict[int, list[int]] = {}
        self.products: set[int] = set()  # `Branch.product`'s layers
        self.group = {
            b: k for k, group in enumerate(sets) for b in _bits(group)
        }  # {bit: its group's index}

    def run(self, jaxpr: Any, env: dict[Any, _Value]) -> list[_Value]:
        for n, eqn in enumerate(jaxpr.eqns):
            ins = [
                _CONSTANT if _literal(v) else env.get(v, _CONSTANT) for v in eqn.invars
            ]
            subs = _subs(eqn)
            outs = self._call(eqn, subs, ins) if subs else None
            if outs is None:
                outs = self._op(jaxpr, n, eqn, ins)
            for v, value in zip(eqn.outvars, outs):
                env[v] = value
        return [
            _CONSTANT if _literal(v) else env.get(v, _CONSTANT) for v in jaxpr.outvars
        ]

    def _call(
        self, eqn: Any, subs: list[Any], ins: list[_Value]
    ) -> list[_Value] | None:
        outs: list[_Value] | None = None
        for sub in subs:
            skip = len(eqn.invars) - len(sub.invars)
            if skip < 0:
                continue
            env = {v: ins[j + skip] for j, v in enumerate(sub.invars)}
            found = self.run(sub, env)
            if len(found) != len(eqn.outvars):
                continue
            if outs is None:
                outs = list(found)
            else:  # another branch of a `cond`
                outs = [
                    _Value(object(), None, a.fed or b.fed, a.mask | b.mask)
                    for a, b in zip(outs, found)
                ]
        return outs

    def _op(self, jaxpr: Any, n: int, eqn: Any, ins: list[_Value]) -> list[_Value]:
        name = eqn.primitive.name
        live = [x for v, x in zip(eqn.invars, ins) if not _literal(v)]
        if name in _RELAYOUT and len(live) == 1:
            return [live[0]] * len(eqn.outvars)
        fed = any(x.fed for x in ins)
        mask = 0
        for x in ins:
            mask |= x.mask
        leaves = [x.leaf for x in ins if x.leaf is not None]
        if not fed:  # a weight computed from weights: still that weight (a norm's)
            shape = tuple(eqn.outvars[0].aval.shape) if eqn.outvars else None
            same = [
                x.leaf
                for v, x in zip(eqn.invars, ins)
                if x.leaf is not None and tuple(v.aval.shape) == shape
            ]
            held = same[0] if same else None
            return [_Value(v, held, False, mask) for v in eqn.outvars]
        for leaf in leaves:
            if leaf not in self.first:
                self.first[leaf] = frozenset(
                    x.root for x in ins if x.fed and x.leaf is None
                )
        mask |= self._own(ins)
        if mask and self.sets:
            self._record(jaxpr, n, eqn, ins, mask)
        # computed from one input alone (a norm's `x - mean(x)`, `x / 255`: not
        # indices, `(ids + 1) % n` looks up other rows), that input; else a token
        # of its own per evaluation (a sub-computation called twice, one
        # `jnp.take` for two embeddings, has the same variables)
        roots = {x.root for x in ins if x.fed}
        same = len(roots) == 1 and not leaves and _floating(eqn)
        root = next(iter(roots)) if same else object()
        return [_Value(root, None, True, mask) for _ in eqn.outvars]

    def _own(self, ins: list[_Value]) -> int:
        """The bits of the group layers whose parameters are operands."""
        mask = 0
        for x in ins:
            if x.leaf is not None and x.leaf in self.bits:
                mask |= 1 << self.bits[x.leaf]
        return mask

    def _record(
        self, jaxpr: Any, n: int, eqn: Any, ins: list[_Value], mask: int
    ) -> None:
        """Merges of group layers this operation makes, and what it applies to one
        layer's output alone."""
        name = eqn.primitive.name
        own = self._own(ins)
        masks = [x.mask for x in ins]
        if name == "dot_general" and all(x.fed for x in ins):
            self.products.update(_product(masks, self.sets))
        merged = 0
        if len({m for m in masks if m} | ({own} if own else set())) > 1:
            for group in self._groups(mask):
                met = mask & group
                for j, m in enumerate(masks):
                    part = m & group
                    if part and part != met:
                        merged |= group
                        at = _place(jaxpr, n, j)
                        for b in _bits(part):
                            self.merges[b].add((name, at, bin(met & ~part).count("1")))
        if name in _SCALING and any(not x.fed for x in ins):
            return
        for b in self._alone(mask):
            if not (merged | own) & self.sets[self.group[b]]:
                self.alone[b].add(name)

    def _groups(self, mask: int) -> list[int]:
        """The groups `mask` holds layers of."""
        return [group for group in self.sets if mask & group]

    def _alone(self, mask: int) -> list[int]:
        """The layers that `mask` holds alone of their group (a value computed
        from one layer of a group and none of the others), once per mask."""
        found = self.single.get(mask)
        if found is None:
            found = [
                _bits(mask & group)[0]
                for group in self._groups(mask)
                if mask & group & (mask & group) - 1 == 0
            ]
            self.single[mask] = found
        return found


def _floating(eqn: Any) -> bool:
    return all(
        jnp.issubdtype(getattr(v.aval, "dtype", jnp.int32), jnp.floating)
        for v in eqn.outvars
    )


def _product(masks: list[int], groups: list[int]) -> list[int]:
    """The layers whose values alone both operands of a product are (`q @ k.T`
    after one norm: `Branch.product`), each operand's mask given per group."""
    out = []
    for group in groups:
        parts = {m & group for m in masks}
        (part,) = parts if len(parts) == 1 else (0,)
        if part and part & (part - 1) == 0:
            out.append(part.bit_length() - 1)
    return out


def _place(jaxpr: Any, n: int, j: int) -> int | None:
    """Operand `j`'s place in the operation `jaxpr.eqns[n]`: None where places do
    not matter; for a `dot_general`, 0 if its free axes come first in the result
    (after a transpose that directly follows), else 1; else `j`."""
    eqn = jaxpr.eqns[n]
    name = eqn.primitive.name
    if name in _COMMUTATIVE:
        return None
    if name != "dot_general" or j > 1:
        return j
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs = len(eqn.invars[0].aval.shape) - len(lc) - len(lb)
    rhs = len(eqn.invars[1].aval.shape) - len(rc) - len(rb)
    if not lhs or not rhs:
        return j
    free = (range(len(lb), len(lb) + lhs), range(len(lb) + lhs, len(lb) + lhs + rhs))
    places = [list(free[0]), list(free[1])]
    out = eqn.outvars[0]
    for later in jaxpr.eqns[n + 1 :]:
        if any(v is out for v in later.invars):
            if later.primitive.name == "transpose":
                perm = list(later.params["permutation"])
                places = [[perm.index(p) for p in side] for side in places]
            break
    return 0 if min(places[j]) < min(places[1 - j]) else 1


def _parts(reads: list[tuple | None], layers: list[Layer]) -> list[frozenset[int]]:
    """For each layer, the positions of the layers used side by side with it (one
    kind and shapes, one input: `Order.reads`), itself included."""
    together: dict[tuple, set[int]] = {}
    for i, (read, x) in enumerate(zip(reads, layers)):
        if read is not None:
            together.setdefault((read, x.kinds, layer_signature(x)), set()).add(i)
    out = []
    for i, (read, x) in enumerate(zip(reads, layers)):
        key = (read, x.kinds, layer_signature(x))
        out.append(frozenset(together[key]) if read is not None else frozenset({i}))
    return out


def _portable(b: Branch) -> frozenset:
    """Where a layer meets the others, as two frameworks both show it: outputs left
    out (which is which is each model's own order), `add_any` as `add`."""
    return frozenset(
        ("add" if name == "add_any" else name, at, n)
        for name, at, n in b.merges
        if name != "output"
    )


_VIEWS = (
    lambda b: b,
    lambda b: b.merges,
    lambda b: b.alone,
    lambda b: bool(b.alone),
    lambda b: (_portable(b), bool(b.alone), b.product),
    lambda b: (_portable(b), b.product),
    _portable,
    lambda b: b.product,
)
"""What of a `Branch` may pair layers side by side, most first: all of it; where
each meets the others (the same on both sides when what each applies alone is
written otherwise: `jnp.square` or `x * x` in a query's norm); what each applies
alone (a silu on the gate: the merge is the same product); whether it applies
anything alone (a silu written `x / (1 + exp(-x))` on one side, or a PyTorch
side's one bit: `_branches.recorded`); then, as a PyTorch side records them too,
where each meets the others (`_portable`) and whether two of its values are
contracted (the norm before an attention, not the one before an MLP)."""


def _matched(a: list[Branch], b: list[Branch]) -> list[tuple[int, int]] | None:
    """`[(i, j)]` pairing `a[i]` with `b[j]` by the views (`_VIEWS`) that tell each
    layer from the others on both sides and take the same values on both; None
    where none does, or two such views pair them otherwise (one side's facts
    read otherwise than the other's: nothing is guessed)."""
    found = None
    for view in _VIEWS:
        va, vb = [view(x) for x in a], [view(x) for x in b]
        if len(set(va)) == len(va) == len(set(vb)) and set(va) == set(vb):
            pairs = [(i, vb.index(v)) for i, v in enumerate(va)]
            if found is not None and pairs != found:
                return None
            found = pairs
    return found


def _described(layers: list[Layer], branches: list[Branch]) -> str:
    return "; ".join(f"{x.where}: {b.words()}" for x, b in zip(layers, branches))
