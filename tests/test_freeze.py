import equinox as eqx
import jax
import pytest
from flax import nnx

import bridge

from . import models
from .helpers import requires


def true_paths(spec):
    leaves = jax.tree_util.tree_leaves_with_path(spec)
    return [jax.tree_util.keystr(p) for p, flag in leaves if flag]


def test_callable_matches_the_seed_pattern():
    tree = bridge.from_nnx(models.nnx_mlp())
    spec = bridge.trainable(tree, lambda t: (t.layers[-1].kernel, t.layers[-1].bias))
    seed = jax.tree_util.tree_map(lambda _: False, tree)
    seed = eqx.tree_at(
        lambda s: (s.layers[-1].kernel, s.layers[-1].bias), seed, replace=(True, True)
    )
    assert jax.tree_util.tree_structure(spec) == jax.tree_util.tree_structure(tree)
    assert jax.tree_util.tree_leaves(spec) == jax.tree_util.tree_leaves(seed)
    diff, static = eqx.partition(tree, spec)
    assert diff.layers[0].kernel is None
    assert diff.layers[-1].kernel is tree.layers[-1].kernel


def test_a_module_selects_its_params_only():
    tree = bridge.from_nnx(models.nnx_cnn())
    spec = bridge.trainable(tree, lambda t: (t.bn, t.head))
    assert true_paths(spec) == [".bn.bias", ".bn.scale", ".head.bias", ".head.kernel"]


def test_regex_over_keystr_paths():
    module, variables = models.linen_cnn()
    tree = bridge.from_linen(variables, module)
    assert true_paths(bridge.trainable(tree, r"^\.Dense_0\.")) == [
        ".Dense_0.bias",
        ".Dense_0.kernel",
    ]
    # BatchNorm_0's mean and var match too, but they are batch statistics
    assert true_paths(bridge.trainable(tree, r"BatchNorm")) == [
        ".BatchNorm_0.bias",
        ".BatchNorm_0.scale",
    ]


def test_equinox_state_is_never_trainable():
    model, state = models.equinox_cnn()
    tree = bridge.from_equinox(model, state)
    spec = bridge.trainable(tree, lambda t: t)
    assert true_paths(spec) == [
        ".conv.weight",
        ".conv.bias",
        ".bn.weight",
        ".bn.bias",
        ".head.weight",
        ".head.bias",
    ]


@requires("NNX")
def test_tied_weight_appears_once():
    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(2, 2, rngs=rngs)
            self.b = self.a

    spec = bridge.trainable(bridge.from_nnx(Tied(nnx.Rngs(0))), r"kernel")
    assert true_paths(spec) == [".a.kernel"]


def test_selecting_nothing_is_an_error():
    tree = bridge.from_nnx(models.nnx_cnn())
    with pytest.raises(ValueError, match=r"paths matching r'\^\\\.nope' hold no leaf"):
        bridge.trainable(tree, r"^\.nope")
    with pytest.raises(ValueError, match=r"only leaves of role batch_stats"):
        bridge.trainable(tree, lambda t: (t.bn.mean, t.bn.var))
    with pytest.raises(ValueError, match=r"r'\^\\\.head\[\.\\\[\]'"):
        bridge.trainable(tree, r"zzz")


def test_where_must_return_parts_of_the_tree():
    tree = bridge.from_nnx(models.nnx_mlp())
    other = bridge.from_nnx(models.nnx_mlp(seed=1))
    with pytest.raises(ValueError, match=r"2 object\(s\) that are not part of `tree`"):
        bridge.trainable(tree, lambda t: other.layers[0])


def test_not_a_tree():
    with pytest.raises(TypeError, match="convert the model first"):
        bridge.trainable(models.nnx_mlp(), r"kernel")
