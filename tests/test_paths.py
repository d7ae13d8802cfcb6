"""`bridge._paths`: the canonical (natural) order of a node's keys."""

import random

import pytest
from hypothesis import given, settings, strategies as st

from bridge import _paths
from bridge._paths import canonical


def _reference(keys):
    return tuple(sorted(keys, key=_paths._natural))


# names as models have them, and the cases natural order must read right: numbers
# of several lengths, leading zeros, digits inside a name, unicode digits (`٣`),
# names that are a prefix of others, no digits at all
_parts = st.sampled_from(
    ["Dense_", "Dense", "Conv_", "layers_", "a", "ab", "_", "x1y", "٣", "ß", ""]
)
_numbers = st.sampled_from(["", "0", "1", "2", "9", "10", "11", "007", "00", "42"])
_keys = st.lists(
    st.builds(lambda p, n, q: p + n + q, _parts, _numbers, st.sampled_from(["", "z"])),
    min_size=1,
    max_size=200,
    unique=True,
)


@settings(max_examples=60, deadline=None)
@given(_keys, st.randoms())
def test_canonical_is_the_natural_order(keys, rnd):
    rnd.shuffle(keys)
    _paths._NATURAL.clear()  # computed, not read from the cache
    many = keys * (_paths._MANY // len(keys) + 1)  # the many-key path too
    assert canonical(keys) == _reference(keys)
    assert canonical(tuple(dict.fromkeys(many))) == _reference(keys)
    for listed in (keys, tuple(dict.fromkeys(many))):
        _paths._NATURAL.clear()
        _same_orders(listed)


def _same_orders(keys):
    """`canonical_and_sorted` agrees with `natural` and `sorted`, and its ranks
    (when given) place each canonical key in sorted order."""
    ordered, jax_order, ranks = _paths.canonical_and_sorted(keys)
    assert ordered == _reference(keys)
    assert jax_order == sorted(keys)
    if ranks is not None:
        assert sorted(ranks) == list(range(len(keys)))
        assert [jax_order[r] for r in ranks] == list(ordered)


_numbered_keys = st.lists(
    st.tuples(
        st.sampled_from(["Dense_", "Conv_", "layers_", "a", "ab", "λß_", ""]),
        st.none() | st.integers(0, 10**6),
    ),
    min_size=_paths._MANY,
    max_size=300,
    unique=True,
).map(lambda pairs: [p + ("" if n is None else str(n)) for p, n in pairs])


@settings(max_examples=60, deadline=None)
@given(_numbered_keys, st.randoms())
def test_many_numbered_names_give_their_sorted_ranks(keys, rnd):
    """Many numbered names (shuffled, of several names and lengths) are ordered in
    C, with each one's rank in sorted order (JAX's): the same as key by key."""
    rnd.shuffle(keys)
    assert _paths._numbered(keys) is not None
    _same_orders(keys)


@pytest.mark.parametrize(
    "keys",
    [
        [f"Dense_{i}" for i in range(300)],
        [f"{p}_{i}" for p in ("Dense", "Conv", "BatchNorm") for i in range(100)]
        + ["x"],
        [f"layers{i}" for i in range(100)] + ["layers"],
        [f"λß_{i}" for i in range(100)],  # a unicode name without digits
    ],
)
def test_many_numbered_names_are_sorted_in_c(keys):
    """`_numbered` (C-level passes, no `natural` per key) takes these, and agrees."""
    random.Random(0).shuffle(keys)
    ordered, jax_order, ranks = _paths._numbered(keys)
    assert ordered == _reference(keys)
    assert jax_order == sorted(keys)
    assert [jax_order[r] for r in ranks] == list(ordered)
    _paths._NATURAL.clear()
    assert canonical(keys) == _reference(keys)


@pytest.mark.parametrize(
    "extra",
    ["Dense_007", "Dense_00", "x1y_2", "Dense_٣", "٣4", 3],
)
def test_names_natural_reads_otherwise_are_left_to_natural(extra):
    """A leading zero, a digit inside a name, a unicode digit, an int key: not for
    `_numbered`; `canonical` still gives the natural order."""
    keys = [f"Dense_{i}" for i in range(100)] + [extra]
    assert _paths._numbered(keys) is None
    _paths._NATURAL.clear()
    assert canonical(keys) == _reference(keys)


def test_only_ascii_digits_as_int_writes_them_are_indices():
    """`str.isdigit` takes `"²"` (which `int` refuses) and `"١"` (Arabic-Indic, which
    `int` reads as 1: another array's name); `"01"` is not how `str(1)` writes 1."""
    from bridge._paths import is_index, parse

    assert parse("layers.10.kernel") == ("layers", 10, "kernel")
    assert parse("l.\u00b2.\u0661.01.0") == ("l", "\u00b2", "\u0661", "01", 0)
    assert [is_index(k) for k in ("0", "7", "10", "01", "", "-1", "1e3", "\u0661")] == [
        True,
        True,
        True,
        False,
        False,
        False,
        False,
        False,
    ]


def test_names_compared_by_their_words_read_only_ascii_digits_as_numbers():
    """Pairing by name (`normalised`): `layer١` (an Arabic-Indic one) was
    `("layer", 1)`, the same words as `layer1`; a superscript was dropped."""
    from bridge._port._order import normalised

    assert normalised((".layers_3.Attn",)) == ("layers", 3, "attn")
    assert normalised(("layer\u0661",)) == ("layer", "\u0661")
    assert normalised(("layer\u00b2",)) == ("layer", "\u00b2")
    assert normalised(("layer\u0661",)) != normalised(("layer1",))
