"""`_branches.recorded` (a PyTorch side's signatures, read from `Uses.merges`) reads
each merge for the groups it can change only: the same signatures as reading
every merge for every group, with work linear in the merges."""

from types import SimpleNamespace
from typing import Any

from bridge._port import _branches


def _record(layers: int):
    """A record as `trace_module` makes it for an embedding then a stack of blocks,
    each an attention (q, k, v side by side: `q @ k.T`, then `p @ v`, its output
    projection `o` added to the stream), a gated MLP (gate, up: `silu(gate) * up`,
    then `d`, added) and its two norms; one output."""
    stream = 1 << 9 * layers  # the embedding's
    needs, merges, groups = {"embed": (stream, 0)}, [], []
    for i in range(layers):
        bit = {n: 1 << (9 * i + k) for k, n in enumerate("nqkvomgud")}
        for n, b in bit.items():
            needs[f"{i}.{n}"] = (b, 0)
        x = stream | bit["n"]
        q, k, v = x | bit["q"], x | bit["k"], x | bit["v"]
        merges += [
            ("dot_general", ((0, q), (1, k))),
            ("dot_general", ((0, q | k), (1, v))),
            ("add", ((None, stream), (None, q | k | v | bit["o"]))),
        ]
        stream |= q | k | v | bit["o"]
        h = stream | bit["m"]
        gate, up = h | bit["g"], h | bit["u"]
        merges += [
            ("mul", ((None, gate), (None, up))),
            ("add", ((None, stream), (None, gate | up | bit["d"]))),
        ]
        stream |= gate | up | bit["d"]
        groups += [
            [[f"{i}.q"], [f"{i}.k"], [f"{i}.v"]],
            [[f"{i}.g"], [f"{i}.u"]],
            [[f"{i}.n"], [f"{i}.m"]],
        ]
    merges.append(("output", ((None, stream),)))
    alone = {f"{i}.g": True for i in range(layers)}
    trace: Any = SimpleNamespace(  # what `recorded` reads of a `Trace`
        upstream=lambda: needs, merges=tuple(merges), alone=alone
    )
    return trace, groups


def _every_merge_for_every_group(trace, groups):
    """The reading `recorded` must equal: each merge for each group."""
    needs, out = trace.upstream(), []
    for group in groups:
        masks = [sum(needs[p][0] for p in layer if p in needs) for layer in group]
        found = [set() for _ in group]
        products = set()
        for name, operands in trace.merges:
            parts = [
                {j for j, m in enumerate(masks) if bits & m} for _, bits in operands
            ]
            met = set().union(*parts)
            if name == "dot_general" and len(met) == 1 and all(parts):
                products |= met
            if name == "output":
                for j in met if len(met) < len(group) else ():
                    found[j].add(("output", None, 0))
                continue
            for (place, _), part in zip(operands, parts):
                if part and part != met:
                    for j in part:
                        found[j].add((name, place, len(met - part)))
        out.append(
            [
                _branches.Branch(
                    frozenset(
                        {_branches.CHANGED}
                        if any(trace.alone.get(p) for p in layer)
                        else ()
                    ),
                    frozenset(f),
                    j in products,
                )
                for j, (layer, f) in enumerate(zip(group, found))
            ]
        )
    return out


def test_recorded_reads_as_every_merge_for_every_group():
    trace, groups = _record(4)
    got = _branches.recorded(trace, groups)
    assert got == _every_merge_for_every_group(trace, groups)
    q, k, v = got[3]  # what tells them apart is there (the second block's)
    assert q.merges == {("dot_general", 0, 1)}
    assert k.merges == {("dot_general", 1, 1), ("dot_general", 0, 1)}
    assert v.merges == {("dot_general", 1, 2)}
    norm, norm_mlp = got[5]
    assert norm.product and not norm_mlp.product
    gate, up = got[4]
    assert gate.alone == {_branches.CHANGED} and not up.alone


def test_recorded_reads_each_merge_for_a_few_groups(monkeypatch):
    reads = []
    meet = _branches._Meets.meet
    monkeypatch.setattr(
        _branches._Meets, "meet", lambda self, *a: (reads.append(a), meet(self, *a))
    )
    for layers in (8, 32):
        reads.clear()
        trace, groups = _record(layers)
        assert _branches.recorded(trace, groups) == _every_merge_for_every_group(
            trace, groups
        )
        # 5 merges a block, each read for the groups of its block (and the
        # output for all): not for every group of every block
        assert len(reads) <= 3 * len(trace.merges) + len(groups)
