import equinox as eqx
import jax
import pytest

import bridge

from . import models


def test_access_reads_like_the_model():
    t = bridge.from_nnx(models.nnx_mlp())
    assert t.layers[-1].kernel is t["layers"][2]["kernel"]
    assert t.layers[-1] is t.layers[2]
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(t)]
    assert paths[0] == ".layers[0].kernel"


def test_tree_is_immutable():
    t = bridge.from_equinox(models.equinox_mlp())
    with pytest.raises(AttributeError, match="immutable"):
        t.layers = None


def test_missing_child_names_the_children():
    t = bridge.from_nnx(models.nnx_cnn())
    with pytest.raises(AttributeError, match=r"children are \['conv', 'bn', 'head'\]"):
        t.nope


def test_seed_pattern_verbatim():
    t = bridge.from_nnx(models.nnx_mlp())
    spec = jax.tree_util.tree_map(lambda _: False, t)
    spec = eqx.tree_at(
        lambda s: (s.layers[-1].kernel, s.layers[-1].bias), spec, replace=(True, True)
    )
    diff, static = eqx.partition(t, spec)
    assert (
        diff.layers[0].kernel is None and diff.layers[-1].kernel is t.layers[-1].kernel
    )
    assert eqx.tree_equal(eqx.combine(diff, static), t)
