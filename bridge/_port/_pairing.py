"""Pairing source layers with target layers: rules first, then kind, shape and
definition order; a choice that kind, shapes and order leave open is an error."""

from __future__ import annotations

import re
from collections.abc import Mapping

from . import _errors
from ._layers import Layer


_PAIR = 1000  # a pair outweighs any number of shape agreements


def common_kind(a: Layer, b: Layer) -> str | None:
    """The kind two layers share (a Linen layer may have several candidates)."""
    for kind in a.kinds:
        if kind in b.kinds:
            return kind
    return None


def _same_shapes(a: Layer, b: Layer, kind: str) -> bool:
    sa, sb = a.specs[kind], b.specs[kind]
    return all(sa[k].shape == sb[k].shape for k in sa.keys() & sb.keys())


def _weight(a: Layer, b: Layer) -> int:
    kind = common_kind(a, b)
    if kind is None:
        return 0
    return _PAIR + int(_same_shapes(a, b, kind))


def pair(
    sources: list[Layer],
    targets: list[Layer],
    rules: Mapping[str, str] | None,
    problems: list[str],
) -> tuple[list[tuple[Layer, Layer]], list[Layer], list[Layer]]:
    """`(pairs, unpaired sources, unpaired targets)`, pairs in target order; layers
    left unpaired by an ambiguity are reported as such, not as unpaired."""
    pairs: list[tuple[Layer, Layer]] = []
    by_where = {t.where: t for t in targets}
    ruled_sources: set[int] = set()
    ruled_targets: dict[int, list[Layer]] = {}
    for pattern, replacement in (rules or {}).items():
        used = False
        for s in sources:
            match = re.fullmatch(pattern, s.where)
            if match is None or id(s) in ruled_sources:
                continue
            used = True
            where = match.expand(replacement)
            t = by_where.get(where)
            if t is None:
                problems.append(
                    _errors.RULE_TARGET.format(
                        pattern=pattern,
                        source=s.where,
                        target=where,
                        layers=[t.where for t in targets],
                    )
                )
                continue
            if common_kind(s, t) is None:
                problems.append(
                    _errors.KIND.format(
                        source=s.where,
                        source_kind="/".join(s.kinds),
                        target=t.where,
                        target_kind="/".join(t.kinds),
                    )
                )
            ruled_sources.add(id(s))
            ruled_targets.setdefault(id(t), []).append(s)
            pairs.append((s, t))
        if not used:
            problems.append(
                _errors.RULE_UNUSED.format(
                    pattern=pattern, layers=[s.where for s in sources]
                )
            )
    for t in targets:
        if len(ruled_targets.get(id(t), ())) > 1:
            problems.append(
                _errors.RULE_TWICE.format(
                    target=t.where, sources=[s.where for s in ruled_targets[id(t)]]
                )
            )
    rest_s = [s for s in sources if id(s) not in ruled_sources]
    rest_t = [t for t in targets if id(t) not in ruled_targets]
    named = _by_name(rest_s, rest_t)
    pairs += named
    rest_s = [s for s in rest_s if all(s is not a for a, _ in named)]
    rest_t = [t for t in rest_t if all(t is not b for _, b in named)]
    grouped = _by_signature(rest_s, rest_t)
    pairs += grouped
    rest_s = [s for s in rest_s if all(s is not a for a, _ in grouped)]
    rest_t = [t for t in rest_t if all(t is not b for _, b in grouped)]
    ambiguous: set[int] = set()
    aligned = _align(rest_s, rest_t, problems, ambiguous)
    pairs += [(s, t) for s, t in aligned if common_kind(s, t) is not None]
    paired_s = {id(s) for s, _ in pairs}
    paired_t = {id(t) for _, t in pairs}
    order = {id(t): i for i, t in enumerate(targets)}
    pairs.sort(key=lambda st: order[id(st[1])])
    return (
        pairs,
        [s for s in sources if id(s) not in paired_s | ambiguous],
        [t for t in targets if id(t) not in paired_t | ambiguous],
    )


def normalised(where: str) -> str:
    """A layer path in one spelling for every framework: `.layer[0].query`,
    `layer.0.query` and `.layer_0.query` all read `layer.0.query`."""
    text = re.sub(r"\[(\d+)\]", r".\1", where)
    text = re.sub(r"\['([^']*)'\]", r".\1", text)
    text = re.sub(r"_(\d+)(?=\.|$)", r".\1", text)
    return text.lstrip(".")


def _by_name(sources: list[Layer], targets: list[Layer]) -> list[tuple[Layer, Layer]]:
    """Pairs of layers of a common kind and shapes whose paths are the same once
    normalised (each name unique on its side): names decide before order."""
    by_name: dict[str, list[Layer]] = {}
    for t in targets:
        by_name.setdefault(normalised(t.where), []).append(t)
    seen: dict[str, int] = {}
    for s in sources:
        key = normalised(s.where)
        seen[key] = seen.get(key, 0) + 1
    out = []
    for s in sources:
        key = normalised(s.where)
        found = by_name.get(key, [])
        if seen[key] != 1 or len(found) != 1:
            continue
        kind = common_kind(s, found[0])
        if kind is not None and _same_shapes(s, found[0], kind):
            out.append((s, found[0]))
    return out


def _signature(layer: Layer) -> tuple | None:
    if len(layer.kinds) != 1:
        return None
    spec = layer.specs[layer.kinds[0]]
    return (layer.kinds[0], tuple(sorted((k, v.shape) for k, v in spec.items())))


def _by_signature(
    sources: list[Layer], targets: list[Layer]
) -> list[tuple[Layer, Layer]]:
    """Pairs of layers whose kind and shapes appear as often in the source as in the
    target, in definition order within each such group: shapes pair layers even
    when the two models define them in another order."""
    groups: dict[tuple, tuple[list[Layer], list[Layer]]] = {}
    for side, layers in ((0, sources), (1, targets)):
        for layer in layers:
            sig = _signature(layer)
            if sig is not None:
                groups.setdefault(sig, ([], []))[side].append(layer)
    out = []
    for a, b in groups.values():
        if len(a) == len(b):
            out += list(zip(a, b))
    return out


def _align(
    sources: list[Layer],
    targets: list[Layer],
    problems: list[str],
    ambiguous: set[int],
) -> list[tuple[Layer, Layer]]:
    """The order-preserving pairing with the most pairs, then the most pairs of equal
    shapes. When two pairings tie, the layers they pair differently are ambiguous.

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
    for i in range(n, -1, -1):
        for j in range(m, -1, -1):
            if i == n and j == m:
                continue
            for phase in (0, 1):
                options = []
                if i < n and j < m and weights[i][j]:
                    options.append(
                        (weights[i][j] + best[i + 1][j + 1][0], (i + 1, j + 1, 0))
                    )
                if i < n and phase == 0:
                    options.append((best[i + 1][j][0], (i + 1, j, 0)))
                if j < m:
                    options.append((best[i][j + 1][1], (i, j + 1, 1)))
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
            moves = []
            if i < n and j < m and weights[i][j]:
                moves.append((weights[i][j] + best[i + 1][j + 1][0], (i + 1, j + 1, 0)))
            if i < n and phase == 0:
                moves.append((best[i + 1][j][0], (i + 1, j, 0)))
            if j < m:
                moves.append((best[i][j + 1][1], (i, j + 1, 1)))
            top = best[i][j][phase]
            ok = [mv for v, mv in moves if v == top and v > worst]
            a, b, p = ok[0] if prefer_pair else ok[-1]
            if (a, b) == (i + 1, j + 1):
                out.append((i, j))
            i, j, phase = a, b, p
        return out

    first = trace(prefer_pair=True)
    if count[0][0][0] > 1:
        second = set(trace(prefer_pair=False))
        for i, j in set(first) ^ second:
            ambiguous.update((id(sources[i]), id(targets[j])))
        for i, j in first:
            if (i, j) in second:
                continue
            others = [targets[b].where for a, b in second if a == i]
            choices = [targets[j].where] + others
            if len(choices) == 1:
                choices.append("nothing")
            s = sources[i]
            problems.append(
                _errors.AMBIGUOUS.format(
                    source=s.where,
                    kind="/".join(s.kinds),
                    choices=" or ".join(choices),
                    source_re=re.escape(s.where),
                    target=targets[j].where,
                )
            )
        return [(sources[i], targets[j]) for i, j in first if (i, j) in second]
    return [(sources[i], targets[j]) for i, j in first]
