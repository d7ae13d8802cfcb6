"""A table in two roles: the embedding a JAX model looks up and the LM head that
reads the same array (a tie inside a JAX model), found by the computation.

Linen's `nn.Embed.attend`, NNX's `embed.attend` and an Equinox head that computes
`h @ self.embed.weight.T` hold one array for two layers; a PyTorch model holds two
names (`embed_tokens.weight`, `lm_head.weight`: tied by transformers'
`tie_word_embeddings`, or two tensors). Where the traced forward pass first uses an
`Embed` layer's array as a `gather`'s table and a later `dot_general` contracts it
(`_trace.Trace.heads`), the model also has a head: a `Dense` layer read through
that product (`_general.dense_view`, the contracted axis its input), named by the
table's module and `_trace.ATTEND` (`.wte.attend`), holding the table's array
(`Layer.held`), tied to it (`Layer.tied`). It then pairs like any `Dense` (with an
`nn.Linear` head by the order of use) and the port's ties do the rest:

- from it, the one array fills both layers of the other side (two tensors, or one
  tied tensor);
- into it, the two layers of the other side must hold equal values to the bit
  (`_run._equal_ties`), else the port is refused naming both.

A name never decides it: an array looked up and not contracted (or contracted and
not looked up) is no head. Without a trace no head is made, and a head on the other
side stays unpaired (refused as before, which `example=` settles).
"""

from __future__ import annotations

from collections import Counter

from ._general import Reading, dense_view
from ._layer import Layer, read_specs
from ._trace import Trace


def with_heads(
    sides: tuple[list[Layer], list[Layer]],
    traces: tuple[Trace | None, Trace | None],
    problems: list[str],
) -> None:
    """Each side's heads that read an `Embed` layer's table, added in place (and
    the table's layer marked tied). A side is traced for it only where the other
    side holds more `Dense` layers of the head's shape `(features, vocabulary)`
    than it does (a head this side keeps in its table)."""
    for side, (layers, trace) in enumerate(zip(sides, traces)):
        if trace is None:
            continue
        tables = [x for x in layers if x.index is None and "Embed" in x.kinds]
        if not tables:
            continue
        mine, other = _dense_shapes(layers), _dense_shapes(sides[1 - side])
        wanted = [x for x in tables if other[_head_shape(x)] > mine[_head_shape(x)]]
        if not wanted or not trace():
            continue
        heads = trace.heads()
        for x in wanted:
            (entry,) = x.paths
            table = x.leaf(entry)
            found = [h for h, t in heads.items() if t == table]
            if not found or any(y.path == found[0] for y in layers):
                continue
            read = trace.contractions()[found[0]]
            codec = dense_view(
                x.codec("Embed").framework, Reading(read.inputs, read.outputs)
            )
            head = Layer(
                found[0],
                (codec,),
                {"kernel": x.leaves[entry]},
                {"kernel": ()},
                {},
                held={"kernel": table},
                tied=frozenset({table}),
            )
            read_specs(head, problems)
            if not head.codecs:
                continue
            x.tied = x.tied | {table}
            layers.append(head)


def _head_shape(table: Layer) -> tuple[int, ...]:
    """The canonical `Dense` kernel `(features, vocabulary)` of a head reading the
    `Embed` layer's table `(vocabulary, features)`."""
    shape = tuple(table.specs["Embed"]["embedding"].shape)
    return shape[::-1]


def _dense_shapes(layers: list[Layer]) -> Counter[tuple[int, ...]]:
    """How many `Dense` layers of each kernel shape hold an array of their own, not
    shared: one whose arrays are other layers' (a tied head) is filled through
    those, as a masked-LM `decoder` whose bias is the head's loose `bias`; a table
    shared with such a head (a folder's embedding, `Embed` or `Dense` by its
    shape) is no head."""
    return Counter(
        tuple(x.specs["Dense"]["kernel"].shape)
        for x in layers
        if "Dense" in x.kinds
        and "kernel" in x.specs.get("Dense", {})
        and {x.leaf(e) for e in x.paths if e not in x.held} - x.tied
    )
