"""The order-preserving alignment (`bridge/_port/_align.py`) where two best
pairings tie. Where they differ only by two names of one array (a folder's tied
embedding and the head that reads it, stored once: `esm.embeddings.word_embeddings`
and `lm_head.decoder`), either fills the target with the same values: the name
read as the kind it pairs as is kept, nothing ambiguous (esm2quinox's ESM-2 from
transformers' folder was refused so). Two layers of other arrays stay ambiguous."""

from types import SimpleNamespace

import jax
import numpy as np

from bridge._port._align import _align
from bridge._port._layer import Layer


V, D = 12, 8


def _layer(path, kinds, entry_paths, tied=(), held=None):
    """A layer of these kinds, each with a `kernel` of one shape."""
    spec = {"kernel": jax.ShapeDtypeStruct((D, V), np.float32)}
    return Layer(
        path,
        tuple(SimpleNamespace(kind=k) for k in kinds),
        {e: np.zeros((V, D), np.float32) for e in entry_paths},
        {e: (e,) for e in entry_paths},
        {},
        specs={k: spec for k in kinds},
        held=held or {},
        tied=frozenset(tied),
    )


TABLE = ("esm", "embeddings", "word_embeddings", "weight")


def test_two_names_of_one_array_pair_as_the_kind_they_are_read_as():
    table = _layer(TABLE[:-1], ("Embed", "Dense"), ["weight"], tied=[TABLE])
    head = _layer(
        ("lm_head", "decoder"), ("Dense",), ["weight"], tied=[TABLE],
        held={"weight": TABLE},
    )  # fmt: skip
    target = _layer(("logit_head", "linear2"), ("Dense",), ["weight"])
    problems, ambiguous = [], set()
    pairs = _align([table, head], [target], problems, ambiguous, "")
    assert problems == [] and ambiguous == set()
    assert pairs == [(head, target)]  # the head read as Dense, not the table


def test_two_layers_of_other_arrays_stay_ambiguous():
    a = _layer(("a",), ("Dense",), ["weight"])
    b = _layer(("b",), ("Dense",), ["weight"])
    target = _layer(("t",), ("Dense",), ["weight"])
    problems, ambiguous = [], set()
    assert _align([a, b], [target], problems, ambiguous, "") == []
    assert len(problems) == 2 and "could pair with .t or nothing" in problems[0]
