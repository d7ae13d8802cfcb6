"""`from_linen`'s one walk (`_linen_walk._walk`) against its general path (`_general`):
the same Tree, field by field, on the variables Linen makes; the general path only
for content the walk does not read."""

import random
from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from flax.core import FrozenDict, freeze
from hypothesis import given, settings, strategies as st

import bridge
from bridge._adapters import _linen, _linen_walk
from bridge._kept._array import QuantizedArray, Scheme
from bridge._tree import leaf_roles

from . import models, public_models
from .helpers import key_orders, leaf_objects, same_objects
from .test_linen import Boxed


def _shuffled(node, rnd):
    """The same variables, every dict's keys in a random order."""
    if isinstance(node, dict):
        keys = list(node)
        rnd.shuffle(keys)
        return {k: _shuffled(node[k], rnd) for k in keys}
    return node


def _many(n, box=lambda i: False):
    """Numbered names past ten, in creation order (`Dense_2` before `Dense_10`);
    the kernels of the layers `box` picks in an `nn.Partitioned`."""

    def kernel(i):
        w = jnp.ones((2, 2))
        return nn.Partitioned(w, names=(None, "model")) if box(i) else w

    return {
        "params": {
            f"Dense_{i}": {"kernel": kernel(i), "bias": jnp.zeros(2)} for i in range(n)
        }
    }


def _tied(n):
    """`n` layers holding one array (tied weights)."""
    w = jnp.ones(3)
    return {"params": {f"layers_{i}": {"w": w, "b": jnp.ones(1)} for i in range(n)}}


def _cnn():
    return models.linen_cnn()


def _vit_scan():
    return public_models.linen_vit(scan=True)


# `(module or None, variables)`, all read by the one walk
WALKED = {
    "mlp": lambda: models.linen_mlp(),
    "cnn batch_stats": _cnn,
    "block": lambda: models.linen_block(),
    "nn.scan stack": _vit_scan,
    "vit": lambda: public_models.linen_vit(),
    "boxed": lambda: (m := Boxed(), m.init(jax.random.key(0), jnp.ones((1, 3)))),
    "shuffled": lambda: (None, _shuffled(_cnn()[1], random.Random(0))),
    "shuffled stack": lambda: (None, _shuffled(_vit_scan()[1], random.Random(1))),
    "frozen": lambda: (None, freeze(_cnn()[1])),
    "frozen collection": lambda: (None, {"params": FrozenDict(_cnn()[1]["params"])}),
    "numpy": lambda: (None, jax.tree.map(np.asarray, _cnn()[1])),
    "abstract": lambda: (
        None,
        jax.eval_shape(lambda: _cnn()[1]),
    ),
    "empty collection": lambda: (None, {**_cnn()[1], "intermediates": {}}),
    "empty module": lambda: (None, {"params": {"a": {}, "b": {"w": jnp.ones(1)}}}),
    "only empty": lambda: (None, {"params": {}}),
    "no collection": lambda: (None, {}),
    "none": lambda: (None, {"params": {"a": None, "b": {"w": jnp.ones(1)}}}),
    "many names": lambda: (None, _many(130)),
    "many frozen": lambda: (None, freeze(_many(20))),
    "many shuffled": lambda: (None, _shuffled(_many(20), random.Random(2))),
    "many, one other": lambda: (
        None,
        {"params": {**_many(20)["params"], "Dense_7": {"kernel": jnp.ones(1)}}},
    ),
    "many with stats": lambda: (
        None,
        {**_many(20), "batch_stats": {"Dense_3": {"mean": jnp.ones(2)}}},
    ),
    "cache first": lambda: (
        None,
        {"cache": {"x": {"k": jnp.ones(1)}}, "params": {"x": {"w": jnp.ones(1)}}},
    ),
    "int keys": lambda: (None, {"params": {0: {"w": jnp.ones(1)}, 1: jnp.ones(1)}}),
    "many boxed": lambda: (None, _many(20, box=lambda i: True)),
    "many, one boxed": lambda: (None, _many(20, box=lambda i: i == 13)),
    "many, one none": lambda: (
        None,
        {
            "params": {
                **_many(20)["params"],
                "Dense_9": {"kernel": None, "b": jnp.ones(1)},
            }
        },
    ),
    "many abstract": lambda: (None, jax.eval_shape(lambda: _many(20))),
    "many, one nested": lambda: (
        None,
        {
            "params": {
                **_many(20)["params"],
                "Dense_5": {"w": jnp.ones(1), "sub": {"z": jnp.ones(1), "a": None}},
            }
        },
    ),
    "many numpy, shuffled": lambda: (
        None,
        _shuffled(jax.tree.map(np.asarray, _many(150)), random.Random(3)),
    ),
    "many tied": lambda: (None, _tied(12)),
    "many in two collections": lambda: (
        None,
        {
            **_many(30),
            "batch_stats": {
                f"Dense_{i}": {"mean": jnp.ones(2), "var": jnp.ones(2)}
                for i in range(12)
            },
        },
    ),
    "tied (one array twice)": lambda: (
        None,
        {"params": {"a": (w := jnp.ones(2)), "b": w}},
    ),
}

# content left to the general path
GENERAL = {
    "list": lambda: (None, {"params": {"layers": [{"w": jnp.ones(1)}]}}),
    "quantized": lambda: (
        None,
        {
            "params": {
                "q": QuantizedArray(
                    {"weight": jnp.ones((2, 2)), "scale": jnp.ones(1)},
                    Scheme("int", 8, (2, 2), "float32"),
                ),
                "w": jnp.ones(2),
            }
        },
    ),
    "box of a dict": lambda: (
        None,
        {"params": {"a": nn.Partitioned({"w": jnp.ones(1)}, names=(None,))}},
    ),
}


def _general(module, variables):
    """The oracle: the Tree of `_general`, the path every variables took before."""
    _linen_walk._KNOWN.clear()
    leaves, treedef = jtu.tree_flatten(
        variables, is_leaf=bridge._kept._array.is_quantized
    )
    return _linen_walk._general(variables, module, leaves, treedef)


def _same_tree(fast, general):
    """Field by field: structure (keys, roles, kinds, the whole Source but its
    native orders), native orders, the record's dict orders and plain flag, the
    leaf objects, the cached treedef, and the variables `to_linen` gives back."""
    a, b = fast._info.source, general._info.source
    assert jtu.tree_structure(fast) == jtu.tree_structure(general)
    assert (a.framework, a.paths, a.order) == (b.framework, b.paths, b.order)
    assert a.record.treedef == b.record.treedef
    assert a.record.module == b.record.module
    assert a.record.plain == b.record.plain
    assert list(a.record.orders.value.items()) == list(b.record.orders.value.items())
    assert dict(a.native) == dict(b.native) and list(a.native) == list(b.native)
    assert a._treedef == b._treedef and a._is_leaf is b._is_leaf
    assert leaf_roles(fast) == leaf_roles(general)
    whole = bridge._kept._array.is_quantized
    assert same_objects(leaf_objects(fast, whole), leaf_objects(general, whole))
    back, again = bridge.to_linen(fast), bridge.to_linen(general)
    assert jtu.tree_structure(back) == jtu.tree_structure(again)
    assert key_orders(back) == key_orders(again)
    assert same_objects(leaf_objects(back), leaf_objects(again))


@pytest.mark.parametrize("name", WALKED)
def test_the_walk_makes_the_tree_of_the_general_path(name, monkeypatch):
    module, variables = WALKED[name]()
    general = _general(module, variables)
    calls = []
    monkeypatch.setattr(
        _linen, "_general", lambda *a: calls.append(a) or general
    )  # taken: a failure below
    _linen_walk._KNOWN.clear()
    fast = bridge.from_linen(variables, module)
    assert not calls, f"{name}: the one walk left these variables to _general"
    _same_tree(fast, general)


@pytest.mark.parametrize("name", GENERAL)
def test_other_content_takes_the_general_path(name):
    _, variables = GENERAL[name]()
    leaves, treedef = jtu.tree_flatten(variables)
    assert _linen_walk._walk(variables, None, leaves, treedef) is None
    _linen_walk._KNOWN.clear()
    _same_tree(bridge.from_linen(variables), _general(None, variables))


def test_a_collision_is_reported_by_the_general_path():
    variables = {
        "params": {"Dense_0": {"kernel": jnp.ones(2)}},
        "batch_stats": {"Dense_0": {"kernel": jnp.ones(2)}},
    }
    leaves, treedef = jtu.tree_flatten(variables)
    assert _linen_walk._walk(variables, None, leaves, treedef) is None
    with pytest.raises(
        ValueError, match="is in collections 'params' and 'batch_stats'"
    ):
        bridge.from_linen(variables)


def test_a_known_structure_with_a_quantized_leaf_is_not_cached():
    """The cache key is read from JAX's leaves; a quantized weight is several of
    them but one leaf of the Tree: such variables are converted afresh each time."""
    _, variables = GENERAL["quantized"]()
    _linen_walk._KNOWN.clear()
    first = bridge.from_linen(variables)
    assert not _linen_walk._KNOWN.items
    second = bridge.from_linen(variables)
    assert isinstance(second.q, QuantizedArray) and second.q is variables["params"]["q"]
    assert jtu.tree_structure(second) == jtu.tree_structure(first)


def _key(variables, module=None):
    leaves, treedef = jtu.tree_flatten(variables)
    return _linen_walk._known_key(variables, treedef, tuple(map(type, leaves)), module)


@pytest.mark.parametrize("name", WALKED)
def test_a_second_conversion_reads_the_cache(name, monkeypatch):
    """The structure is cached by the first conversion and found by the second
    (no walk), giving the same Tree, with the cache key's orders those of a walk
    over every mapping one by one."""
    module, variables = WALKED[name]()
    _linen_walk._KNOWN.clear()
    first = bridge.from_linen(variables, module)
    key = _key(variables, module)
    assert key is not None and _linen_walk._KNOWN.get(key) is not None
    one_by_one: list = []
    leaves, treedef = jtu.tree_flatten(variables)
    inner = _linen_walk._key_orders(variables, one_by_one, alike=False)
    assert inner == treedef.num_nodes - treedef.num_leaves
    assert key[1] == tuple(one_by_one)

    def no_walk(*args):
        raise AssertionError("walked again")

    monkeypatch.setattr(_linen, "_walk", no_walk)
    second = bridge.from_linen(variables, module)
    assert jtu.tree_structure(second) == jtu.tree_structure(first)
    assert second._info.source.native == first._info.source.native
    assert same_objects(leaf_objects(second), leaf_objects(first))


def _reversed_layer(variables, name):
    """The same variables with one layer's keys in the other order."""
    params = dict(variables["params"])
    params[name] = dict(reversed(list(params[name].items())))
    return {**variables, "params": params}


@pytest.mark.parametrize("layer", ["Dense_0", "Dense_7", "Dense_19"])
def test_a_layer_listed_in_another_order_is_another_key(layer):
    """The cache key sees every mapping's order, also inside alike layers: the
    variables with one layer's keys reversed are converted afresh, and each gives
    back its own order."""
    _, variables = WALKED["many names"]()
    other = _reversed_layer(variables, layer)
    assert _key(variables) != _key(other)
    _linen_walk._KNOWN.clear()
    for v in (variables, other, variables, other):
        assert key_orders(bridge.to_linen(bridge.from_linen(v))) == key_orders(v)


def test_a_key_that_cannot_be_shown_whole_is_none():
    """A leaf of a mapping class (not a pytree for JAX) could hide a mapping from
    the count that shows the key read every mapping: no cache key."""

    class Leafy(Mapping):  # a Mapping JAX does not know: a leaf
        def __getitem__(self, key):
            return {"a": 1}[key]

        def __iter__(self):
            return iter(["a"])

        def __len__(self):
            return 1

    variables = {"params": {"x": Leafy(), "w": jnp.ones(1)}}
    assert _key(variables) is None
    assert _key({"params": {"w": jnp.ones(1)}}) is not None


@pytest.mark.parametrize("name", ["cnn batch_stats", "many names", "many boxed"])
def test_without_treedefs_from_children_the_tree_is_the_same(name, monkeypatch):
    """On a JAX without `PyTreeDef.from_node_data_and_children`, the Tree's treedef
    is read from the Tree: the same Tree."""
    module, variables = WALKED[name]()
    general = _general(module, variables)
    real = bridge._adapters._build._FROM_DATA
    if real is not None:  # the path this test takes away is the one taken
        calls = []

        def spy(*args):
            calls.append(args)
            return real(*args)

        monkeypatch.setattr(bridge._adapters._build, "_FROM_DATA", spy)
        _linen_walk._KNOWN.clear()
        bridge.from_linen(variables, module)
        assert calls
    monkeypatch.setattr(_linen_walk, "_FROM_DATA", None)
    monkeypatch.setattr(bridge._adapters._build, "_FROM_DATA", None)
    _linen_walk._KNOWN.clear()
    tree = bridge.from_linen(variables, module)
    assert tree._info.source._treedef == jtu.tree_structure(tree)
    _same_tree(tree, general)


# --- varied variables (hypothesis) ----------------------------------------------

_MODULES = st.sampled_from(["Dense_", "layers_", "Conv_", "block", "a"]).flatmap(
    lambda name: st.integers(0, 12).map(lambda i: f"{name}{i}")
)
# leaf names differ per collection and from module names: no collision
_LEAF_NAMES = {
    "params": ["kernel", "bias", "scale", "embedding"],
    "batch_stats": ["mean", "var"],
    "cache": ["cached_key", "cache_index"],
}
_LEAVES = st.sampled_from(
    [
        lambda: jnp.ones(2),
        lambda: np.zeros((1, 2), np.float32),
        lambda: jax.ShapeDtypeStruct((3,), jnp.float32),
        lambda: nn.Partitioned(jnp.ones(2), names=("model",)),
        lambda: None,
    ]
).map(lambda make: make())


def _module(collection):
    leaves = st.dictionaries(
        st.sampled_from(_LEAF_NAMES[collection]), _LEAVES, min_size=1, max_size=3
    )
    # alike layers: many modules with the same leaf names in the same order
    layers = st.tuples(
        st.integers(_linen_walk._ALIKE, 24),
        st.permutations(_LEAF_NAMES[collection]),
        st.sampled_from(["layers_", "Dense_"]),
        st.booleans(),
    ).map(
        lambda t: {
            f"{t[2]}{i}": {
                k: nn.Partitioned(jnp.ones(1), names=(None,))
                if t[3] and i == 3
                else jnp.ones(1)
                for k in t[1]
            }
            for i in range(t[0])
        }
    )
    return st.recursive(
        leaves | layers,
        lambda inner: st.tuples(
            st.dictionaries(_MODULES, inner, min_size=1, max_size=10), leaves
        ).map(lambda t: {**t[0], **t[1]}),
        max_leaves=6,
    )


_VARIABLES = st.fixed_dictionaries(
    {"params": _module("params")},
    optional={"batch_stats": _module("batch_stats"), "cache": _module("cache")},
)


def _sorted_dicts(node):
    """What an optax step gives back: every dict rebuilt in sorted key order."""
    if isinstance(node, dict):
        return {k: _sorted_dicts(node[k]) for k in sorted(node)}
    return node


@settings(max_examples=40, deadline=None)
@given(_VARIABLES, st.sampled_from(["as made", "shuffled", "sorted", "frozen"]))
def test_varied_variables_walk_to_the_tree_of_the_general_path(variables, form):
    variables = {
        "as made": lambda v: v,
        "shuffled": lambda v: _shuffled(v, random.Random(len(str(v)))),
        "sorted": _sorted_dicts,
        "frozen": freeze,
    }[form](variables)
    leaves, treedef = jtu.tree_flatten(variables)
    assert _linen_walk._walk(variables, None, leaves, treedef) is not None
    general = _general(None, variables)
    _linen_walk._KNOWN.clear()
    first = bridge.from_linen(variables)
    _same_tree(first, general)
    again = bridge.from_linen(variables)  # from the cache
    assert _linen_walk._KNOWN.items
    _same_tree(again, general)
    back = bridge.to_linen(first)  # the very variables given, in their orders
    assert jtu.tree_structure(back) == jtu.tree_structure(variables)
    assert key_orders(back) == key_orders(variables)
    assert same_objects(leaf_objects(back), leaf_objects(variables))
