"""Property tests (hypothesis): random Linen variable trees and random Equinox models
round-trip exactly through their adapter and through every checkpoint format, with
`like` and without; models without arrays too. The default session runs a few
examples per property; `-m slow` runs many."""

import tempfile
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import bridge


FORMATS = ["m.safetensors", "m.msgpack", "ckpt"]
DTYPES = ["float32", "bfloat16", "float16", "int8", "int32", "uint8", "bool"]
FAST = settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SLOW = settings(FAST, max_examples=80)

# names as models have them: words, digits after a letter, unicode letters
names = st.text(
    alphabet=st.sampled_from("abcxyzDenseConv_0123456789ßλ日"), min_size=1, max_size=8
).filter(lambda s: not s[0].isdigit())


@st.composite
def arrays(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    n = int(np.prod(shape))
    raw = draw(st.binary(min_size=n * 4, max_size=n * 4))
    values = np.frombuffer(raw, np.uint8)[:n] if n else np.zeros(0, np.uint8)
    if dtype == "bool":
        values = values % 2
    return jnp.asarray(values.astype(dtype).reshape(shape))


def modules(depth: int):
    """Nested dicts of arrays, empty sub-dicts included."""
    leaf = arrays()
    if depth == 0:
        return leaf
    return st.one_of(
        leaf,
        st.dictionaries(names, modules(depth - 1), max_size=4),
    )


@st.composite
def linen_variables(draw):
    params = draw(st.dictionaries(names, modules(3), max_size=4))
    variables = {"params": params}
    if draw(st.booleans()):  # names of its own: a name is one collection's (a rule)
        stats = draw(st.dictionaries(names, arrays(), max_size=2))
        variables["batch_stats"] = {f"stat_{k}": v for k, v in stats.items()}
    return variables


def same(a, b) -> bool:
    """Same structure (dict order included), dtypes and bits."""
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and list(a) == list(b)
            and all(same(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def leaves_by_path(tree) -> dict:
    return {
        jtu.keystr(p): np.asarray(x) for p, x in jtu.tree_flatten_with_path(tree)[0]
    }


def check_linen(variables):
    tree = bridge.from_linen(variables)
    assert same(bridge.to_linen(tree), variables)
    with tempfile.TemporaryDirectory() as directory:
        for name in FORMATS:
            path = Path(directory) / name
            bridge.save(path, variables)
            assert same(bridge.load(path, like=variables), variables), name
            alone = bridge.load(path)  # without like: the same dicts, empty ones too
            assert jtu.tree_structure(bridge.to_native(alone)) == jtu.tree_structure(
                variables
            ), name
            loaded = leaves_by_path(alone)
            expected = leaves_by_path(tree)
            assert loaded.keys() == expected.keys(), name
            assert all(same(loaded[k], expected[k]) for k in expected), name


@FAST
@given(linen_variables())
def test_random_linen_variables_round_trip(variables):
    check_linen(variables)


@pytest.mark.slow
@SLOW
@given(linen_variables())
def test_random_linen_variables_round_trip_many(variables):
    check_linen(variables)


# --- Equinox ------------------------------------------------------------------------


class Holder(eqx.Module):
    children: object
    scale: float = eqx.field(static=True, default=1.0)


@st.composite
def equinox_parts(draw, depth):
    kind = draw(
        st.sampled_from(
            ["linear", "array", "dict", "list"] if depth else ["linear", "array"]
        )
    )
    if kind == "linear":
        i, o = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        return ("linear", i, o, draw(st.booleans()))
    if kind == "array":
        return ("array", draw(arrays()))
    children = draw(st.lists(equinox_parts(depth - 1), max_size=3))
    if kind == "dict":
        keys = draw(
            st.lists(names, min_size=len(children), max_size=len(children), unique=True)
        )
        return ("dict", dict(zip(keys, children)))
    return ("list", children)


def build(part, seed: int):
    """The Equinox model a drawn part describes; `seed` picks its weights."""
    kind = part[0]
    if kind == "linear":
        _, i, o, bias = part
        return eqx.nn.Linear(i, o, use_bias=bias, key=jax.random.key(seed))
    if kind == "array":
        return part[1] + seed if part[1].dtype != jnp.bool_ else part[1]
    if kind == "dict":
        return {k: build(v, seed + n) for n, (k, v) in enumerate(part[1].items())}
    return [build(v, seed + n) for n, v in enumerate(part[1])]


def check_equinox(part):
    model = Holder(build(part, 0), scale=2.0)
    back = bridge.to_equinox(bridge.from_equinox(model))
    assert jtu.tree_structure(back) == jtu.tree_structure(model)
    assert same(jtu.tree_leaves(back), jtu.tree_leaves(model))
    with tempfile.TemporaryDirectory() as directory:
        for name in FORMATS:
            path = Path(directory) / name
            bridge.save(path, model)
            loaded = bridge.load(path, like=Holder(build(part, 7), scale=2.0))
            assert jtu.tree_structure(loaded) == jtu.tree_structure(model), name
            assert same(jtu.tree_leaves(loaded), jtu.tree_leaves(model)), name
            tree = bridge.load(path)
            assert len(jtu.tree_leaves(tree)) == len(jtu.tree_leaves(model)), name


@FAST
@given(equinox_parts(3))
def test_random_equinox_models_round_trip(part):
    check_equinox(part)


@pytest.mark.slow
@SLOW
@given(equinox_parts(3))
def test_random_equinox_models_round_trip_many(part):
    check_equinox(part)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(
    "model",
    [
        {"params": {}},
        {"params": {"a": {}, "b": {"c": {}}}},
        Holder([]),
        Holder({"x": []}),
    ],
    ids=["linen empty", "linen empty nested", "equinox empty list", "equinox nested"],
)
def test_models_without_arrays(tmp_path, name, model):
    bridge.save(tmp_path / name, model)
    back = bridge.load(tmp_path / name, like=model)
    assert jtu.tree_structure(back) == jtu.tree_structure(model)
    alone = bridge.load(tmp_path / name)
    if isinstance(model, dict):
        assert back == model
        assert bridge.to_native(alone) == model  # the empty dicts without `like` too
    assert jtu.tree_leaves(alone) == []
