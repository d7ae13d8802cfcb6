"""One layer on one side is several on the other: a fused product against its parts.

A fused attention projection (`qkv`: one Dense `D -> 3D` whose output the forward
pass splits into the query, the key and the value) or a fused gate/up MLP projection
against separate Dense layers `D -> D`. Where the first pairing leaves such a Dense
unpaired on one side and, on the other, unpaired Dense layers of its input size whose
outputs add up to its own in equal parts (`fused`), the Dense is read as its parts
(`parts`): part `i` of `k` is the Dense whose canonical kernel is columns `[i * n,
(i + 1) * n)` of the fused one (and the bias's), read through a view of the fused
layer's codec (`part_view`). Parts pair with the other side's layers in their orders
of use, by `SPLIT`; written into a fused target, the parts are concatenated and
encoded once (`_run`).

Which part is which layer the order of use does not say (the query and the key are
computed side by side): the port runs both models on the example inputs and keeps the
one assignment of parts to layers whose outputs agree (`_port._verified`), trying
each (the same for every fused layer of one size); where the example inputs hold no
values, or none or several agree, it is refused.
"""

from __future__ import annotations

import math
from typing import Any

from ._codec import Codec, Leaves
from ._layer import Layer, read_specs


SPLIT = "split"
"""The `by` of a pair of a part of a fused layer and a layer of the other side."""

_VIEWS: dict[tuple[int, int, int], Codec] = {}


def part_view(codec: Codec, index: int, parts: int) -> Codec:
    """The `Dense` view of part `index` of `parts` of a fused Dense read by `codec`:
    canonical kernel columns (and bias entries) `[index * n, (index + 1) * n)`. A
    part is never encoded alone: the fused layer is written whole (`_run`)."""
    key = (id(codec), index, parts)
    if key in _VIEWS:
        return _VIEWS[key]

    def decode(leaves: Leaves, hyper: dict[str, Any]) -> Leaves:
        canonical = codec.decode(leaves, hyper)
        out = {}
        for name, array in canonical.items():
            n = array.shape[-1] // parts
            out[name] = array[..., index * n : (index + 1) * n]
        return out

    def encode(canonical: Leaves, like: Leaves, hyper: dict[str, Any]) -> Leaves:
        raise TypeError("a part of a fused layer is written with its other parts")

    view = Codec(
        "Dense",
        codec.framework,
        lambda cls, leaves: False,  # made by `parts`, never recognised
        decode,
        encode,
        codec.hyperparameters,
        layout=f"{codec.layout}; part {index + 1} of {parts}".lstrip("; "),
        defaults=codec.defaults,
    )
    _VIEWS[key] = view
    return view


def fused(layers: tuple[list[Layer], list[Layer]]) -> dict[int, int]:
    """`{id(fused layer): parts}`: the `Dense` layers (not in a stack) of a kernel
    shape `(in, k * n)` that only one side holds, where the other holds `k` times
    as many more Dense layers of kernel `(in, n)` than the first side does (the
    query, key and value a fused `qkv` holds), all with a bias or none."""
    counts = [_counts(side) for side in layers]
    out: dict[int, int] = {}
    for side in (0, 1):
        mine, theirs = counts[side], counts[1 - side]
        for (rows, width, biased), n in mine.items():
            if theirs.get((rows, width, biased)):
                continue
            for (r, w, b), m in theirs.items():
                more = m - mine.get((r, w, b), 0)
                if (r, b) != (rows, biased) or w >= width or width % w:
                    continue
                if more == n * (width // w):
                    for x in layers[side]:
                        if _key(x) == (rows, width, biased):
                            out[id(x)] = width // w
    return out


def _key(x: Layer) -> tuple[int, int, bool] | None:
    shape = _kernel(x)
    if shape is None or x.index is not None or x.tied or x.part is not None:
        return None
    return (*shape, _biased(x))


def _counts(layers: list[Layer]) -> dict[tuple[int, int, bool], int]:
    out: dict[tuple[int, int, bool], int] = {}
    for x in layers:
        key = _key(x)
        if key is not None:
            out[key] = out.get(key, 0) + 1
    return out


def _kernel(x: Layer) -> tuple[int, int] | None:
    spec = x.specs.get("Dense", {}).get("kernel") if "Dense" in x.kinds else None
    return None if spec is None or len(spec.shape) != 2 else tuple(spec.shape)


def _biased(x: Layer) -> bool:
    return "bias" in x.specs.get("Dense", {})


def parts(x: Layer, count: int, problems: list[str]) -> list[Layer]:
    """The fused Dense `x` as its `count` parts: each holds the fused arrays
    (`Layer.held`: read and written where the fused layer's are), named
    `<fused path>.part<i>of<count>`, `Layer.part` `(i, count, x)`."""
    codec = x.codec("Dense")
    out = []
    for i in range(count):
        part = Layer(
            x.path + (f"part{i + 1}of{count}",),
            (part_view(codec, i, count),),
            dict(x.leaves),
            dict(x.paths),
            dict(x.hyper),
            held={e: x.leaf(e) for e in x.paths},
            part=(i, count, x),
        )
        read_specs(part, problems)
        out.append(part)
    return out


def verified(
    steps: tuple[Any, ...],
    ported: Any,
    rerun: Any,
    outputs: Any,
) -> tuple[tuple[Any, ...], Any]:
    """The one assignment of parts to the other side's layers whose ported model
    computes the source's outputs: `(its plan rows, the ported model)`.

    `steps`: the plan's rows, its `SPLIT` rows pairing each fused layer's parts in
    order; `ported`: the model they made; `rerun(rows) -> model` ports again with
    other rows; `outputs(model) -> difference` runs the source and `model` on the
    example inputs and gives their largest difference relative to the tolerance
    (<= 1: equal), or raises `ValueError` saying why they cannot run. Each
    permutation of the parts is tried, the same for every fused layer of as many
    parts (a `qkv` of 3 and a `gate_up` of 2: 3! x 2! assignments).

    **Raises:** `ValueError` with the message (`_errors.SPLIT_*`)."""
    from itertools import permutations, product

    from . import _errors

    groups: dict[int, dict[int, Any]] = {}
    for row in steps:
        if row.by != SPLIT:
            continue
        part = row._source.part or row._target.part  # one of them is a part
        groups.setdefault(id(part[2]), {})[part[0]] = row
    counts = sorted({len(g) for g in groups.values()})
    names = sorted({_fused_name(g) for g in groups.values()})
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    if max(counts) > 4 or math.prod(math.factorial(c) for c in counts) > MOST_TRIED:
        raise ValueError(
            _errors.SPLIT_UNCHECKED.format(
                layers=shown, pairs="parts", why="too many assignments to try"
            )
        )
    found = []
    for orders in product(*(permutations(range(c)) for c in counts)):
        order = dict(zip(counts, orders))
        rows = _assigned(steps, groups, order)
        kept = all(o == tuple(range(c)) for c, o in order.items())
        model = ported if kept else rerun(rows)
        diff = outputs(model)
        found.append((diff, rows, model))
    matching = [f for f in found if f[0] <= 1]
    if len(matching) == 1:
        return matching[0][1], matching[0][2]
    if not matching:
        best = min(f[0] for f in found)
        raise ValueError(_errors.SPLIT_NONE.format(layers=shown, diff=best))
    raise ValueError(_errors.SPLIT_SEVERAL.format(layers=shown, n=len(matching)))


MOST_TRIED = 48
"""The most assignments of parts a port tries (each runs both models)."""


def _fused_name(rows: dict[int, Any]) -> str:
    row = next(iter(rows.values()))
    part = row._source.part or row._target.part
    return part[2].where


def _assigned(
    steps: tuple[Any, ...], groups: dict, order: dict[int, tuple[int, ...]]
) -> tuple:
    """The rows with part `i` of each fused layer of `n` parts paired with the
    layer part `order[n][i]` was paired with."""
    import dataclasses

    swapped: dict[int, Any] = {}
    for rows in groups.values():
        for i, row in rows.items():
            other = rows[order[len(rows)][i]]
            if row._source.part is not None:  # parts on the source side
                new = dataclasses.replace(other, source=row.source, _source=row._source)
            else:
                new = dataclasses.replace(other, target=row.target, _target=row._target)
            swapped[id(row)] = new
    return tuple(swapped.get(id(row), row) for row in steps)
