"""Reading a traced JAX program: where the forward pass first uses each array, and
what it does with it there.

`first_uses` runs a Tree's model under `jax.make_jaxpr` (no FLOPs, no weights
materialised) and walks the program once, equation by equation, into nested
computations (`pjit`, `scan`, `cond`, `custom_jvp`, ...), following each array
through operations that only relayout it or compute with it alone (`1 + w`,
`exp(-softplus(a))`: its first use is where it meets an activation, as PyTorch's
recorder reads it): its first use, how a product contracts
it, a convolution's kernel axes, a scan's layer axis, what it depends on, whether it
is added to a product (a bias), a scale's axis, a kernel applied transposed, and the
norm it scales (`_jaxpr_norms`). `_trace.Trace` asks it when a step first needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.extend.core

from .._adapters._native import adapter_of_tree, infer, to_native
from .._adapters._skeleton import Skeleton
from .._paths import Path
from .._tree import Tree, map_with_path
from .._uses import Contraction
from ._jaxpr_norms import Norms


_SEEN_THROUGH = frozenset(
    {
        "transpose",
        "reshape",
        "convert_element_type",
        "copy",
        "copy_p",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "device_put",
    }
)
"""Primitives that only relayout one array: its first use is that of their output."""


def first_uses(
    tree: Tree,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    contracted: dict[Path, Contraction] | None = None,
    scanned: dict[Path, int] | None = None,
    needs: dict[Path, tuple[int, int]] | None = None,
    convolved: dict[Path, tuple[int, ...]] | None = None,
    classes: dict[Path, Any] | None = None,
    program: list[tuple[Program, list[Path]]] | None = None,
    attended: dict[Path, tuple[Position, Contraction]] | None = None,
    added: set[Path] | None = None,
    placed: dict[Path, int] | None = None,
    turned: dict[Path, frozenset[int]] | None = None,
    adapter: Any = None,
    normalised: dict[Path, str] | None = None,
    eps: dict[Path, float] | None = None,
    looked_up: set[Path] | None = None,
) -> dict[Path, Position]:
    """`{leaf path: position of its first use}` in `tree`'s forward pass on `inputs`,
    traced abstractly; leaves the pass never reads are absent. With `contracted`,
    also fills it with `{leaf path: Contraction}` for every leaf whose first use is
    a `dot_general` on the leaf as stored, or only transposed or scanned over (a
    kernel's input axes: the layout the computation gives it). With `scanned`, fills
    it with `{leaf path: stored axis}` for every leaf a `scan` iterates over (a
    stack's layer axis, wherever `variable_axes` put it). With `needs`, fills it
    with `{leaf path: (its bit, the bits of the leaves its first use's other
    operands are computed from)}` (the layers upstream of the leaf's, through every
    operation: an order of dependence, which no two implementations of one model
    can disagree on). With `convolved`, fills it with `{leaf path: its stored axes
    as (out, in, *spatial)}` for every leaf first used as a convolution's kernel.
    With `classes`, fills it with `{module path: module}` for every submodule the
    pass calls, where the framework records them only then (Linen's compact
    submodules: `Adapter.called`). With `program`, appends the traced program
    and the leaf paths its first inputs are (`_branches`: layers side by side).
    With `attended`, fills it with `{leaf path:
    (position, Contraction)}` for every leaf first used as the table of a `gather`
    (an embedding looked up) that a later `dot_general` contracts (the same array
    read as a head's kernel: `nn.Embed.attend`, a tied LM head).
    With `added`, fills it with the leaves whose first
    use adds them to a product's result (`dot_general`'s, only relaid out between):
    a bias, whatever module holds it (a masked-LM head's `bias` after a product with
    the tied embedding). With `placed`, fills it with `{leaf path: axis}` for the
    1-D leaves first used in a `mul` after a reshape that puts their one axis at
    `axis` (the others of length 1): a scale over that axis of a weight (Linen
    `nn.WeightNorm`'s `scale`, its `feature_axes`). With `turned`, fills it with
    `{leaf path: the stored axes the pass reverses}` for every convolution kernel
    it applies transposed: reversed (a `rev`) before the convolution (as
    `jax.lax.conv_transpose(..., transpose_kernel=True)` does: PyTorch's
    `ConvTranspose`), or over an input dilated by the strides (`lhs_dilation`, as
    `nn.ConvTranspose` does: nothing reversed).

    **Arguments:**

    - `tree`: a whole-model Tree (its adapter runs it: `bridge.compare`'s way).
    - `inputs`: batched example inputs (arrays or `jax.ShapeDtypeStruct`s).
    - `kwargs`: keyword arguments of the call (`{"train": False}`).
    - `contracted`: optional, filled as said above.

    **Raises:**

    Whatever the model's forward pass raises on these inputs.
    """
    paths: list[Path] = []
    map_with_path(lambda p, _: paths.append(p), tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    # the inputs as pytrees: a cache object the pass writes into (an NNX module)
    # is rebuilt inside the trace from its arrays, as nnx.jit does, never mutated
    given_leaves, given_tree = jax.tree_util.tree_flatten((tuple(inputs), kwargs))
    examples = [
        jax.ShapeDtypeStruct(x.shape, x.dtype)
        if hasattr(x, "shape") and hasattr(x, "dtype")
        else x
        for x in given_leaves
    ]
    arrays = [i for i, x in enumerate(examples) if isinstance(x, jax.ShapeDtypeStruct)]

    def run(leaves: list[Any], given: list[Any]) -> Any:
        xs = list(examples)
        for i, x in zip(arrays, given):
            xs[i] = x
        args, kw = jax.tree_util.tree_unflatten(given_tree, xs)
        model = to_native(jax.tree_util.tree_unflatten(treedef, leaves))
        first = model[0] if isinstance(model, tuple) and model else model
        if isinstance(model, Mapping) or isinstance(first, Skeleton):
            raise NoModel  # arrays without a model to run, or without its code
        if called is None or classes is None:
            return infer(model, args, kw)
        out, seen = called(lambda: infer(model, args, kw))
        classes.update(seen)
        return out

    called = (adapter or adapter_of_tree(tree)).called

    closed = jax.make_jaxpr(run)(structs, [examples[i] for i in arrays])
    jaxpr = closed.jaxpr
    tracked = {v: (i, ()) for i, v in enumerate(jaxpr.invars[: len(structs)])}
    found: dict[int, Position] = {}
    axes: dict[int, Contraction] = {}
    layer_axes: dict[int, int] = {}
    upstream: dict[int, int] = {}
    kernels: dict[int, tuple[int, ...]] = {}
    later: dict[int, tuple[Position, Contraction]] = {}
    gathered: set[int] = set()
    stored = {v: tuple(range(len(s.shape))) for v, s in zip(jaxpr.invars, structs)}
    taint = {v: 1 << i for i, v in enumerate(jaxpr.invars[: len(structs)])}
    biases: set[int] = set()
    scales: dict[int, int] = {}
    turns: dict[int, frozenset[int]] = {}
    sums = (set(), biases, {}, scales, {}, turns)
    norms = Norms()
    records = (axes, layer_axes, upstream, kernels, later, gathered, sums, norms)
    fed = set(jaxpr.invars[len(structs) :])
    relayed: dict[int, Position] = {}
    _visit(jaxpr, tracked, found, stored, records, taint, fed, relayed)
    for leaf, position in relayed.items():  # never met an activation
        found.setdefault(leaf, position)
    if program is not None:
        program.append((Program(jaxpr, len(structs)), paths))
    if convolved is not None:
        convolved.update({paths[i]: a for i, a in kernels.items()})
    if needs is not None:
        needs.update({p: (1 << i, upstream.get(i, 0)) for i, p in enumerate(paths)})
    if contracted is not None:
        contracted.update({paths[i]: a for i, a in axes.items()})
    if added is not None:
        added.update(paths[i] for i in biases)
    if placed is not None:
        placed.update({paths[i]: a for i, a in scales.items()})
    if turned is not None:
        turned.update({paths[i]: a for i, a in turns.items()})
    if scanned is not None:
        scanned.update({paths[i]: a for i, a in layer_axes.items()})
    if attended is not None:
        attended.update({paths[i]: later[i] for i in gathered if i in later})
    if looked_up is not None:
        looked_up.update(paths[i] for i in gathered)
    if normalised is not None:
        normalised.update({paths[i]: kind for i, kind in norms.found.items()})
    if eps is not None:
        eps.update({paths[i]: value for i, value in norms.eps.items()})
    return {paths[i]: pos for i, pos in found.items()}


class Program(NamedTuple):
    """A traced forward pass: the `jax.extend.core.Jaxpr` and how many of its first
    inputs are the Tree's leaves (the rest are the model's inputs)."""

    jaxpr: Any
    leaves: int


_SIDE_BY_SIDE = frozenset({"concatenate", "pad", "select_n"})
"""Primitives whose operands are placed side by side, not computed from each other
(a cls token concatenated with the patch embeddings): no dependence between them."""


_SAME_LAYOUT = frozenset({"convert_element_type", "copy", "copy_p", "device_put"})
"""Seen-through primitives that keep an array's axes as they are."""


_ELEMENTWISE = frozenset({"mul", "div", "add", "sub", "neg", "max", "min"})
"""Primitives that compute an array element by element: one computed from weights
alone, of the shape of one of them, is that weight changed (weight normalisation's
`v * g / ||v||`), and the product or convolution it feeds tells that weight's layout."""


def _visit(
    jaxpr: Any,
    tracked: dict[Any, tuple[int, Position]],
    found: dict[int, Position],
    stored: dict[Any, tuple[int, ...]],
    records: tuple[
        dict[int, Contraction],
        dict[int, int],
        dict[int, int],
        dict[int, tuple],
        dict[int, tuple[Position, Contraction]],
        set[int],
        tuple[
            set[Any],
            set[int],
            dict[Any, int],
            dict[int, int],
            dict[Any, frozenset[int]],
            dict[int, frozenset[int]],
        ],
    ],
    taint: dict[Any, int],
    fed: set[Any],
    relayed: dict[int, Position],
    changed: set[Any] | None = None,
) -> None:
    """Record in `found` the first use of every leaf a `tracked` variable holds
    (`{var: (leaf, its prefix)}`), in equation order, entering sub-computations;
    in `axes`, how a leaf first used by a `dot_general` is contracted, where the
    variable's axes are known in the leaf's stored axes (`stored`: `{var: stored
    axis of each of its axes}`, through transposes and a scan's slicing); in
    `scanned`, the stored axis a `scan` first iterates over; in `upstream`, the
    leaves (a bit each) the other operands of a leaf's first use depend on
    (`taint`: `{var: the leaves it depends on}`); in `later`, how a leaf is
    contracted by the first `dot_general` after its first use, and where; in
    `gathered`, the leaves first used as a `gather`'s table. `fed`: the
    variables computed from the inputs (the others are computed from weights
    alone); `changed`: the variables that are a weight changed element by
    element (`_changed`); `relayed`: the first operation on each leaf alone, its
    first use where the pass never computes it with an activation. `records`
    also holds the variables that hold a product's result (`dot_general`'s, only
    relaid out since), the leaves first
    used added to one (a bias), the variables that are a 1-D leaf reshaped to one
    axis (`{var: axis}`), the leaves first used so in a `mul` (`{leaf: axis}`), the
    variables that are a weight with some stored axes reversed (`{var: those
    axes}`) and the kernels convolved transposed (`{leaf: stored axes reversed}`)."""
    axes, scanned_axes, upstream, kernels, later, gathered, sums, norms = records
    products, biases, placed, scales, flips, turns = sums
    changed = set() if changed is None else changed
    for n, eqn in enumerate(jaxpr.eqns):
        ins = [0 if _literal(v) else taint.get(v, 0) for v in eqn.invars]
        every = 0
        for t in ins:
            every |= t
        for v in eqn.outvars:
            taint[v] = every
        if any(not _literal(v) and v in fed for v in eqn.invars):
            fed.update(eqn.outvars)
        name = eqn.primitive.name
        if name == "dot_general" or (
            name in _SEEN_THROUGH
            and any(not _literal(v) and v in products for v in eqn.invars)
        ):
            products.update(eqn.outvars)
        used = [
            (i, tracked[v])
            for i, v in enumerate(eqn.invars)
            if not _literal(v) and v in tracked
        ]
        if not _subs(eqn):  # a sub-computation's equations are read inside it
            norms.step(eqn, {i: leaf for i, (leaf, _) in used}, fed)
        elif not used:  # no weight inside: only what it does to activations
            _norms_only(eqn, norms, fed)
        if not used:
            continue
        if name == "add" and len(eqn.invars) == 2:
            for i, (leaf, _) in used:
                other = eqn.invars[1 - i]
                if leaf not in found and not _literal(other) and other in products:
                    biases.add(leaf)
        if name == "mul":
            for i, (leaf, _) in used:
                if leaf not in found and eqn.invars[i] in placed:
                    scales.setdefault(leaf, placed[eqn.invars[i]])
        if name in _SEEN_THROUGH and len(eqn.outvars) == 1:
            others = [v for v in eqn.invars if not _literal(v)]
            if len(others) == 1:
                tracked[eqn.outvars[0]] = used[0][1]
                _place(eqn, stored.get(others[0]), placed)
                known = stored.get(others[0])
                if known is not None and name in _SAME_LAYOUT:
                    stored[eqn.outvars[0]] = known
                elif known is not None and name == "transpose":
                    perm = eqn.params["permutation"]
                    stored[eqn.outvars[0]] = tuple(known[a] for a in perm)
                if eqn.invars[0] in changed:
                    changed.add(eqn.outvars[0])
                if others[0] in flips:
                    flips[eqn.outvars[0]] = flips[others[0]]
                continue
        if name == "rev" and used[0][0] == 0:  # a weight reversed, its axes kept
            known = stored.get(eqn.invars[0])
            tracked[eqn.outvars[0]] = used[0][1]
            if known is not None:
                stored[eqn.outvars[0]] = known
                turn = frozenset(known[d] for d in eqn.params["dimensions"])
                flips[eqn.outvars[0]] = flips.get(eqn.invars[0], frozenset()) ^ turn
            if eqn.invars[0] in changed:
                changed.add(eqn.outvars[0])
            continue
        if name in _ELEMENTWISE and eqn.outvars[0] not in fed:
            _changed(eqn, used, stored, tracked, changed)
        if name == "dot_general":
            for i, (leaf, prefix) in used:
                known = stored.get(eqn.invars[i])
                first = leaf not in found or eqn.invars[i] in changed
                if first and known is not None and i < 2:
                    axes.setdefault(leaf, _contraction(jaxpr, n, i, known))
                elif known is not None and i < 2 and leaf not in axes:
                    read = _contraction(jaxpr, n, i, known)
                    later.setdefault(leaf, (prefix + (n,), read))
        if name == "gather":
            gathered.update(
                leaf for i, (leaf, _) in used if i == 0 and leaf not in found
            )
        if name == "conv_general_dilated":
            for i, (leaf, _) in used:
                known = stored.get(eqn.invars[i])
                first = leaf not in found or eqn.invars[i] in changed
                if first and known is not None and i == 1:
                    spec = eqn.params["dimension_numbers"].rhs_spec
                    kernels.setdefault(leaf, tuple(known[a] for a in spec))
                    turn = flips.get(eqn.invars[i], frozenset())
                    if turn or any(d > 1 for d in eqn.params["lhs_dilation"]):
                        turns.setdefault(leaf, turn)
        scanned = (
            eqn.params.get("num_consts", 0) + eqn.params.get("num_carry", 0)
            if name == "scan"
            else None
        )
        for s, sub in enumerate(_subs(eqn)):
            skip = len(eqn.invars) - len(sub.invars)
            if skip < 0:
                continue
            inner = {}
            inner_stored = {}
            inner_fed = {
                sub.invars[j - skip]
                for j in range(skip, len(eqn.invars))
                if not _literal(eqn.invars[j]) and eqn.invars[j] in fed
            }
            for i, (leaf, prefix) in used:
                j = i - skip
                if j < 0:
                    continue
                where = prefix + (n, s)
                known = stored.get(eqn.invars[i])
                if scanned is not None and j >= scanned:
                    where += (ITER,)
                    if known is not None:
                        scanned_axes.setdefault(leaf, known[0])
                    known = None if known is None else known[1:]  # one slice
                inner[sub.invars[j]] = (leaf, where)
                if eqn.invars[i] in flips:
                    flips[sub.invars[j]] = flips[eqn.invars[i]]
                if known is not None:
                    inner_stored[sub.invars[j]] = known
            inner_taint = {
                sub.invars[j - skip]: ins[j]
                for j in range(skip, len(eqn.invars))
                if ins[j]
            }
            inner_changed = {
                sub.invars[i - skip]
                for i, _ in used
                if i >= skip and eqn.invars[i] in changed
            }
            products.update(
                sub.invars[j - skip]
                for j in range(skip, len(eqn.invars))
                if not _literal(eqn.invars[j]) and eqn.invars[j] in products
            )
            norms.enter(eqn.invars[skip:], sub.invars)
            _visit(
                sub,
                inner,
                found,
                inner_stored,
                records,
                inner_taint,
                inner_fed,
                relayed,
                inner_changed,
            )
            if s == 0:
                norms.leave(sub.outvars, eqn.outvars)
            if len(sub.outvars) == len(eqn.outvars):
                products.update(
                    v
                    for v, w in zip(eqn.outvars, sub.outvars)
                    if not _literal(w) and w in products
                )
            if len(sub.outvars) == len(eqn.outvars) and s == 0:
                for v, w in zip(eqn.outvars, sub.outvars):
                    taint[v] = 0 if _literal(w) else inner_taint.get(w, 0)
                    if not _literal(w) and w in flips and w in inner:
                        _reversed_out(
                            (v, w),
                            inner,
                            inner_stored.get(w),
                            used,
                            (tracked, stored, flips),
                        )
                        if w in inner_changed:
                            changed.add(v)
            elif len(sub.outvars) == len(eqn.outvars):
                for v, w in zip(eqn.outvars, sub.outvars):
                    taint[v] |= 0 if _literal(w) else inner_taint.get(w, 0)
        if len({leaf for _, (leaf, _) in used}) == 1 and all(
            _literal(v) or v in tracked for v in eqn.invars
        ):  # one weight alone (`1 + w`, `exp(-softplus(a))`): the result is that
            # weight, first used where it meets an activation, as PyTorch's
            # recorder reads it (the order of use alike on both sides)
            leaf, prefix = used[0][1]
            for v in eqn.outvars:
                tracked.setdefault(v, (leaf, prefix))
            if leaf not in found:
                relayed.setdefault(leaf, prefix + (n,))
                continue
        for i, (leaf, prefix) in used:
            if leaf not in found:
                others = 0
                for j, t in enumerate(ins):
                    others |= t if j != i and name not in _SIDE_BY_SIDE else 0
                upstream[leaf] = others
            found.setdefault(leaf, prefix + (n,))


def _norms_only(eqn: Any, norms: Norms, fed: set[Any]) -> None:
    """The normalisation tags through a sub-computation that holds no weight (a
    `jit` of `jnp.var`, a `custom_jvp`): only its first computation is read."""
    subs = _subs(eqn)
    sub = subs[0] if subs else None
    skip = len(eqn.invars) - (len(sub.invars) if sub is not None else 0)
    if sub is None or skip < 0:
        return
    norms.enter(eqn.invars[skip:], sub.invars)
    inner = {
        sub.invars[j - skip]
        for j in range(skip, len(eqn.invars))
        if not _literal(eqn.invars[j]) and eqn.invars[j] in fed
    }
    for e in sub.eqns:
        if any(not _literal(v) and v in inner for v in e.invars):
            inner.update(e.outvars)
        if _subs(e):
            _norms_only(e, norms, inner)
        else:
            norms.step(e, {}, inner)
    norms.leave(sub.outvars, eqn.outvars)


def _reversed_out(
    out: tuple[Any, Any],
    inner: dict[Any, tuple[int, Position]],
    known: tuple[int, ...] | None,
    used: list,
    maps: tuple[dict, dict, dict],
) -> None:
    """A sub-computation's output `w` that is a weight reversed (`jnp.flip`, a
    `jit` of a `rev`) is that weight outside too, as `v`: tracked, its layout and
    reversed axes kept, so the convolution it feeds records them."""
    (v, w), (tracked, stored, flips) = out, maps
    leaf = inner[w][0]
    prefix = next((p for _, (x, p) in used if x == leaf), None)
    if prefix is None:
        return
    tracked[v] = (leaf, prefix)
    flips[v] = flips[w]
    if known is not None:
        stored[v] = known


def _place(eqn: Any, known: tuple[int, ...] | None, placed: dict[Any, int]) -> None:
    """Where a 1-D leaf (`known`: its stored axes, `(0,)`) is reshaped or broadcast
    to one axis of the result (a `reshape` to `(1, .., n, .., 1)`,
    `broadcast_in_dim`), `placed` records that axis for the result."""
    (out,) = eqn.outvars
    name = eqn.primitive.name
    if name in _SAME_LAYOUT and eqn.invars[0] in placed:
        placed[out] = placed[eqn.invars[0]]
    if known != (0,):
        return
    shape = tuple(out.aval.shape)
    if name == "broadcast_in_dim":
        placed[out] = eqn.params["broadcast_dimensions"][0]
    elif name == "reshape":
        n = eqn.invars[0].aval.shape[0]
        fits = [a for a, m in enumerate(shape) if m == n]
        if len(fits) == 1 and all(m == 1 for a, m in enumerate(shape) if a != fits[0]):
            placed[out] = fits[0]


def _changed(
    eqn: Any,
    used: list,
    stored: dict[Any, tuple[int, ...]],
    tracked: dict[Any, tuple[int, Position]],
    changed: set[Any],
) -> None:
    """An element-by-element operation on weights alone (`_ELEMENTWISE`) whose
    result has the shape of an operand with known stored axes: the result is that
    operand's weight, changed (its layout kept), so the product or convolution it
    feeds records that weight's layout."""
    out = eqn.outvars[0]
    for i, (leaf, prefix) in used:
        v = eqn.invars[i]
        known = stored.get(v)
        if known is not None and tuple(v.aval.shape) == tuple(out.aval.shape):
            tracked[out] = (leaf, prefix)
            stored[out] = known
            changed.add(out)
            return


def _contraction(jaxpr: Any, n: int, side: int, known: tuple[int, ...]) -> Contraction:
    """The `Contraction` of operand `side` of the `dot_general` `jaxpr.eqns[n]`,
    whose axes are the stored axes `known`."""
    eqn = jaxpr.eqns[n]
    contracting, batch = eqn.params["dimension_numbers"]
    mine, other = contracting[side], contracting[1 - side]
    inputs = [m for _, m in sorted(zip(other, mine))]
    rank = len(known)
    free = [a for a in range(rank) if a not in mine and a not in batch[side]]
    lhs_free = len(eqn.invars[0].aval.shape) - len(contracting[0]) - len(batch[0])
    start = len(batch[0]) + (lhs_free if side == 1 else 0)
    place = {a: start + k for k, a in enumerate(free)}
    out = eqn.outvars[0]
    for later in jaxpr.eqns[n + 1 :]:
        if any(v is out for v in later.invars):
            if later.primitive.name == "transpose":
                perm = list(later.params["permutation"])
                place = {a: perm.index(p) for a, p in place.items()}
            break
    outputs = sorted(free, key=lambda a: place[a])
    return Contraction(
        tuple(known[a] for a in inputs),
        tuple(known[a] for a in outputs),
        tuple(known[a] for a in batch[side]),
    )


def _subs(eqn: Any) -> list[Any]:
    """The computations an equation runs (a while loop's body, not its condition)."""
    out = []
    for key, value in eqn.params.items():
        if key == "cond_jaxpr":
            continue
        for v in value if isinstance(value, tuple | list) else (value,):
            j = getattr(v, "jaxpr", v)
            if hasattr(j, "eqns") and hasattr(j, "invars"):
                out.append(j)
    return out


def _literal(v: Any) -> bool:
    return isinstance(v, jax.extend.core.Literal)


ITER = -1
"""In a position, where a scan over a stack iterates (replaced by the layer index)."""


Position = tuple[int, ...]


class NoModel(Exception):
    """A whole-model Tree whose native form has no forward pass to run: variables
    without their module, a checkpoint read without its model's code."""
