"""`from_linen`'s one walk (`_linen._walk`) against its general path (`_general`):
the same Tree, field by field, on the variables Linen makes; the general path only
for content the walk does not read."""

import random

import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from flax.core import FrozenDict, freeze

import bridge
from bridge._adapters import _linen
from bridge._qarray import QuantizedArray, Scheme
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


def _many(n):
    """Numbered names past ten, in creation order (`Dense_2` before `Dense_10`)."""
    return {
        "params": {
            f"Dense_{i}": {"kernel": jnp.ones((2, 2)), "bias": jnp.zeros(2)}
            for i in range(n)
        }
    }


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
}

# content left to the general path
GENERAL = {
    "list": lambda: (None, {"params": {"layers": [{"w": jnp.ones(1)}]}}),
    "tied (one array twice)": lambda: (
        None,
        {"params": {"a": (w := jnp.ones(2)), "b": w}},
    ),
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
    _linen._KNOWN.clear()
    leaves, treedef = jtu.tree_flatten(variables, is_leaf=bridge._qarray.is_quantized)
    return _linen._general(variables, module, leaves, treedef)


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
    assert a.record.orders.value == b.record.orders.value
    assert dict(a.native) == dict(b.native) and list(a.native) == list(b.native)
    assert a._treedef == b._treedef and a._is_leaf is b._is_leaf
    assert leaf_roles(fast) == leaf_roles(general)
    whole = bridge._qarray.is_quantized
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
    _linen._KNOWN.clear()
    fast = bridge.from_linen(variables, module)
    assert not calls, f"{name}: the one walk left these variables to _general"
    _same_tree(fast, general)


@pytest.mark.parametrize("name", GENERAL)
def test_other_content_takes_the_general_path(name):
    _, variables = GENERAL[name]()
    leaves, treedef = jtu.tree_flatten(variables)
    assert _linen._walk(variables, None, leaves, treedef) is None
    _linen._KNOWN.clear()
    _same_tree(bridge.from_linen(variables), _general(None, variables))


def test_a_collision_is_reported_by_the_general_path():
    variables = {
        "params": {"Dense_0": {"kernel": jnp.ones(2)}},
        "batch_stats": {"Dense_0": {"kernel": jnp.ones(2)}},
    }
    leaves, treedef = jtu.tree_flatten(variables)
    assert _linen._walk(variables, None, leaves, treedef) is None
    with pytest.raises(
        ValueError, match="is in collections 'params' and 'batch_stats'"
    ):
        bridge.from_linen(variables)


def test_a_known_structure_with_a_quantized_leaf_is_not_cached():
    """The cache key is read from JAX's leaves; a quantized weight is several of
    them but one leaf of the Tree: such variables are converted afresh each time."""
    _, variables = GENERAL["quantized"]()
    _linen._KNOWN.clear()
    first = bridge.from_linen(variables)
    assert not _linen._KNOWN.items
    second = bridge.from_linen(variables)
    assert isinstance(second.q, QuantizedArray) and second.q is variables["params"]["q"]
    assert jtu.tree_structure(second) == jtu.tree_structure(first)
