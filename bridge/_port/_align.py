"""The order-preserving alignment of the layers left: the pairing with the most
pairs of equal shapes, then the most pairs, counting the best pairings so that a
choice left open is found (and reported as ambiguous) instead of guessed."""

from __future__ import annotations

import re

from . import _errors
from ._layer import Layer, common_kind, same_shapes


_EQUAL, _UNEQUAL = 1000, 1  # an equal-shape pair outweighs any unequal ones


def _weight(a: Layer, b: Layer) -> int:
    k = common_kind(a, b)
    if k is None:
        return 0
    return _EQUAL if same_shapes(a, b, k) else _UNEQUAL


def _align(
    sources: list[Layer],
    targets: list[Layer],
    problems: list[str],
    ambiguous: set[int],
    decide: str,
) -> list[tuple[Layer, Layer]]:
    """The order-preserving pairing with the most pairs of equal shapes, then the
    most pairs. When two pairings tie, the layers they pair differently are
    ambiguous (`decide`: what would decide, for the message).

    Dynamic programming over `(i, j, phase)`: between two pairs, unpaired sources
    come before unpaired targets (`phase` 1 once a target was skipped), so every
    pairing is one path, and counting best paths counts best pairings.
    """
    n, m = len(sources), len(targets)
    weights = [[_weight(s, t) for t in targets] for s in sources]
    worst = -(10**12)
    best = [[[worst, worst] for _ in range(m + 1)] for _ in range(n + 1)]
    count = [[[0, 0] for _ in range(m + 1)] for _ in range(n + 1)]
    best[n][m] = [0, 0]
    count[n][m] = [1, 1]

    def moves(i: int, j: int, phase: int) -> list[tuple[int, tuple[int, int, int]]]:
        out = []
        if i < n and j < m and weights[i][j]:
            out.append((weights[i][j] + best[i + 1][j + 1][0], (i + 1, j + 1, 0)))
        if i < n and phase == 0:
            out.append((best[i + 1][j][0], (i + 1, j, 0)))
        if j < m:
            out.append((best[i][j + 1][1], (i, j + 1, 1)))
        return out

    for i in range(n, -1, -1):
        for j in range(m, -1, -1):
            if i == n and j == m:
                continue
            for phase in (0, 1):
                options = moves(i, j, phase)
                if not options:
                    continue
                top = max(v for v, _ in options)
                best[i][j][phase] = top
                count[i][j][phase] = min(
                    2, sum(count[a][b][p] for v, (a, b, p) in options if v == top)
                )

    def trace(prefer_pair: bool) -> list[tuple[int, int]]:
        out, i, j, phase = [], 0, 0, 0
        while (i, j) != (n, m):
            top = best[i][j][phase]
            ok = [mv for v, mv in moves(i, j, phase) if v == top and v > worst]
            a, b, p = ok[0] if prefer_pair else ok[-1]
            if (a, b) == (i + 1, j + 1):
                out.append((i, j))
            i, j, phase = a, b, p
        return out

    first = trace(prefer_pair=True)
    if count[0][0][0] > 1:
        second = set(trace(prefer_pair=False))
        differ = set(first) ^ second
        if _one_array(differ, sources, targets):  # the names read as the kind
            # they pair as (a head's `decoder` as Dense, not the embedding's table)
            chosen = max(
                (first, sorted(second)), key=lambda p: _native(p, sources, targets)
            )
            return [(sources[i], targets[j]) for i, j in chosen]
        for i, j in differ:
            ambiguous.update((id(sources[i]), id(targets[j])))
        for i in sorted({a for a, _ in differ}):  # a line per source either pairs
            choices = [targets[b].where for a, b in first if a == i]
            choices += [
                targets[b].where for a, b in sorted(second - set(first)) if a == i
            ]
            if len(choices) == 1:
                choices.append("nothing")
            s = sources[i]
            problems.append(
                _errors.AMBIGUOUS.format(
                    source=s.where,
                    kind="/".join(s.kinds),
                    choices=" or ".join(choices),
                    source_re=re.escape(s.where),
                    decide=decide,
                )
            )
        return [(sources[i], targets[j]) for i, j in first if (i, j) in second]
    return [(sources[i], targets[j]) for i, j in first]


def _one_array(
    differ: set[tuple[int, int]], sources: list[Layer], targets: list[Layer]
) -> bool:
    """Whether two best pairings differ only by names of one array: where one
    pairs source `a` with a target and the other source `b` with it (or one
    source with target `a` or `b`), `a` and `b` hold the very same arrays (a tied
    embedding and the head reading it, one tensor in a folder) and pair with it
    as the same kind, so either fills it with the same values."""
    if not differ:
        return False
    by_target: dict[int, set[int]] = {}
    by_source: dict[int, set[int]] = {}
    for i, j in differ:
        by_target.setdefault(j, set()).add(i)
        by_source.setdefault(i, set()).add(j)
    for j, found in by_target.items():
        if len(found) > 1 and not _alike([sources[i] for i in found], targets[j]):
            return False
    for i, found in by_source.items():
        if len(found) > 1 and not _alike([targets[j] for j in found], sources[i]):
            return False
    return all(len(f) > 1 for f in by_target.values()) or all(
        len(f) > 1 for f in by_source.values()
    )


def _native(
    pairs: list[tuple[int, int]], sources: list[Layer], targets: list[Layer]
) -> int:
    """How many of `pairs` pair a source layer as its first kind."""
    return sum(
        sources[i].kinds[0] == common_kind(sources[i], targets[j]) for i, j in pairs
    )


def _alike(layers: list[Layer], other: Layer) -> bool:
    """Whether `layers` hold one set of arrays, untouched by any other, and each
    pairs with `other` as one kind."""
    arrays = {frozenset(x.leaf(e) for e in x.paths) for x in layers}
    kinds = {common_kind(x, other) for x in layers}
    return (
        len(arrays) == 1
        and len(kinds) == 1
        and None not in kinds
        and all(x.index is None and x.tied for x in layers)
    )
