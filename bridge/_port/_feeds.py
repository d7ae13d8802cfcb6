"""Which layer feeds which, in each side's traced forward pass: the one fact two
implementations of a model cannot disagree on, whatever order they compute in.

`dependence` reads, per layer, its arrays' bits and the bits of the arrays its input
is computed from (`Trace.upstream`); `feeding` turns a side's into one boolean
matrix. Pairing reads them twice, after the orders of use have paired what they
could (`_pairing.pair`): `repaired` exchanges partners that the orders of use
paired against what feeds them, and `alike` finds loose arrays a pass computes
side by side, which nothing can pair (refused). `contradicted` finds the pairs
the two passes disagree on (`_checks` refuses them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._paths import Path
from ._layer import ARRAY, Layer, layer_signature


def dependence(trace: Any, layers: list[Layer]) -> list[tuple[int, int]]:
    """Per layer, `(its arrays' bits, the bits of the arrays its input is computed
    from)` in one side's traced forward pass (`Trace.upstream`), an array the Tree
    holds once for several names (`Trace.ties`: BERT's `cls.predictions.bias`, used
    as `decoder.bias`) read under the names the pass used."""
    needs = trace.upstream()
    names: dict[Path, list[Path]] = {}
    for name, held in trace.ties().items():
        names.setdefault(held, []).append(name)
    out = []
    for x in layers:
        mine, fed = 0, 0
        for rel in x.paths.values():
            for path in [x.path + rel, *names.get(x.path + rel, ())]:
                bit, upstream = needs.get(path, (0, 0))
                mine, fed = mine | bit, fed | upstream
        out.append((mine, fed & ~mine))
    return out


def feeding(found: list[tuple[int, int]]) -> np.ndarray:
    """`[k, j]`: whether layer `j`'s arrays feed layer `k`'s input, of `dependence`'s
    `found`, as one product of bit matrices (`(n, n)` booleans, False on the
    diagonal; the `n**2` tests of big integers cost 0.1 s for a 64-layer Llama's
    580 layers)."""
    width = max((max(a.bit_length(), b.bit_length()) for a, b in found), default=0)
    size = max(1, (width + 7) // 8)

    def bits(xs: list[int]) -> np.ndarray:
        packed = np.frombuffer(
            b"".join(x.to_bytes(size, "little") for x in xs), np.uint8
        )
        unpacked = np.unpackbits(packed.reshape(len(xs), size), 1, bitorder="little")
        return unpacked.astype(np.float32)

    own, fed = bits([a for a, _ in found]), bits([b for _, b in found])
    return fed @ own.T > 0


def repaired(pairs: Sequence[Any], traces: Sequence[Any]) -> list[Any]:
    """`pairs` (`_pairing.Pair`s), with the layers that the orders of use paired
    against what each is computed from re-paired: where a source layer's input
    comes from the layers of some pairs and its partner's from others' (a query's
    norm paired with the key's, when one side computes the key first; a masked-LM
    head's loose `bias` paired with another head's), and exchanging partners
    within their kind and shapes makes every such pair agree, one way only. Stacks'
    layers (one array for every index) and ties are left as they are, but for a
    loose array held under several names (a bias tied to its `decoder.bias`: one
    array, one use)."""
    pairs = list(pairs)
    kept = np.array(
        [
            p.source.index is None
            and p.target.index is None
            and _untied(p.source)
            and _untied(p.target)
            for p in pairs
        ]
    )
    for _ in range(len(pairs)):
        after = [  # [k, j]: whether pair j's layer feeds pair k's, both kept
            feeding(dependence(t, [(p.source, p.target)[side] for p in pairs])) & kept
            for side, t in enumerate(traces)
        ]
        wrong: dict[tuple, list[int]] = {}
        for k, p in enumerate(pairs):
            if kept[k] and p.by == "trace" and (after[0][k] != after[1][k]).any():
                key = (p.source.kinds, layer_signature(p.source))
                wrong.setdefault(key, []).append(k)
        changed = False
        for ks in wrong.values():
            fits = {
                k: [j for j in ks if (after[0][k] == after[1][j]).all()] for k in ks
            }
            if all(len(f) == 1 for f in fits.values()) and len(
                {f[0] for f in fits.values()}
            ) == len(ks):
                targets = {k: pairs[fits[k][0]].target for k in ks}
                for k in ks:
                    pairs[k] = pairs[k]._replace(target=targets[k], by="trace")
                changed = True
        if not changed:
            break
    return pairs


def alike(pairs: Sequence[Any], traces: Sequence[Any]) -> list[list[int]]:
    """The groups (indices into `pairs`) of loose arrays of one shape that the
    orders of use paired (names differing) but that a forward pass computes alike:
    from the same arrays, neither from the other (two masked-LM heads' loose
    biases, each added to a product of one input with one table). Which it adds
    first is its own choice, so their order of use does not pair them, and nothing
    else in the computation does (`repaired` pairs those that it does)."""
    groups: dict[tuple, list[int]] = {}
    for k, p in enumerate(pairs):
        if p.by == "trace" and p.source.kinds == (ARRAY,) and p.source.index is None:
            groups.setdefault(layer_signature(p.source), []).append(k)
    out = []
    for members in groups.values():
        if len(members) < 2:
            continue
        sides = [
            dependence(t, [(pairs[k].source, pairs[k].target)[side] for k in members])
            for side, t in enumerate(traces)
        ]
        found = [
            members[i]
            for i in range(len(members))
            if any(
                _alike(side[i], side[j])
                for side in sides
                for j in range(len(members))
                if j != i
            )
        ]
        if len(found) >= 2:
            out.append(found)
    return out


def contradicted(pairs: Sequence[Any], traces: Sequence[Any]) -> list[tuple[Any, Any]]:
    """The pairs `(a, b)` (of `pairs`, `_pairing.Pair`s) that the forward passes
    contradict: in the source layer `a` feeds `b` (`b`'s input is computed from
    `a`'s arrays), in the target `b`'s partner feeds `a`'s. Stacks' layers and
    ties are not asked (a tied array's names share its bit: each seems to feed what
    the others do)."""
    checked = [
        p
        for p in pairs
        if p.source.index is None
        and p.target.index is None
        and not p.source.tied
        and not p.target.tied
    ]
    if len(checked) < 2:
        return []
    source, target = (
        feeding(dependence(trace, [(p.source, p.target)[side] for p in checked]))
        for side, trace in enumerate(traces)
    )
    # i feeds j in the source, j feeds i in the target (never i itself: `dependence`)
    return [(checked[i], checked[j]) for i, j in np.argwhere(source.T & target)]


def _alike(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether two arrays (`dependence`'s `(bits, upstream bits)`), both used, are
    computed with the same arrays (some: a token concatenated first, computed with
    none, is left to the order of use) and neither from the other."""
    return (
        bool(a[0] and b[0] and a[1])
        and a[1] == b[1]
        and not (a[0] & b[1] or b[0] & a[1])
    )


def _untied(x: Layer) -> bool:
    """Whether `x` is no tie, or a loose array held under several names (one array,
    which its dependence reads under each: `dependence`)."""
    return not x.tied or x.kinds == (ARRAY,)
