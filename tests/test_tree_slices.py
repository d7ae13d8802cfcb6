"""Slices of sequence nodes: `t.layers[1:]` is a tuple of the stored children, so
`eqx.tree_at` and `bridge.trainable` select with it as Equinox does on its tuples."""

from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import bridge

from . import models
from .helpers import run_markdown, same_objects as same, tree_equal_bits


def zeros(node):
    return jax.tree_util.tree_map(jnp.zeros_like, node)


def negate(node):
    return jax.tree_util.tree_map(jnp.negative, node)


TREES = {
    "nnx": lambda: bridge.from_nnx(models.nnx_mlp()),
    "equinox": lambda: bridge.from_equinox(models.equinox_mlp()),
}


@pytest.fixture(params=list(TREES))
def tree(request):
    return TREES[request.param]()


def test_a_slice_is_a_tuple_of_the_stored_children(tree):
    layers = tree.layers
    assert type(layers[1:]) is tuple and len(layers[1:]) == 2
    assert all(a is b for a, b in zip(layers[-2:], (layers[1], layers[2])))
    assert all(a is b for a, b in zip(layers[::-1], (layers[2], layers[1], layers[0])))
    assert layers[5:] == ()
    assert tree["layers"][:1][0] is layers[0]


def test_trainable_with_a_slice(tree):
    by_slice = bridge.trainable(tree, lambda t: t.layers[-2:])
    by_index = bridge.trainable(tree, lambda t: (t.layers[1], t.layers[2]))
    assert jax.tree_util.tree_leaves(by_slice) == jax.tree_util.tree_leaves(by_index)
    assert jax.tree_util.tree_leaves(by_slice) == [False] * 2 + [True] * 4


def test_tree_at_with_a_slice(tree):
    spec = jax.tree_util.tree_map(lambda _: False, tree)
    spec = eqx.tree_at(
        lambda s: s.layers[1:],
        spec,
        replace_fn=lambda node: jax.tree_util.tree_map(lambda _: True, node),
    )
    assert jax.tree_util.tree_leaves(spec) == [False] * 2 + [True] * 4
    new = (zeros(tree.layers[0]), zeros(tree.layers[1]))
    replaced = eqx.tree_at(lambda t: t.layers[:2], tree, replace=new)
    leaves = jax.tree_util.tree_leaves
    assert same(leaves(replaced.layers[:2]), leaves(new))
    assert same(leaves(replaced.layers[2]), leaves(tree.layers[2]))


def test_tree_at_with_a_slice_equals_equinox_on_its_own_tuple():
    model, x = models.equinox_mlp(), models.mlp_input()
    native = eqx.tree_at(lambda m: m.layers[-2:], model, replace_fn=negate)
    tree = eqx.tree_at(
        lambda t: t.layers[-2:], bridge.from_equinox(model), replace_fn=negate
    )
    via_tree = bridge.to_equinox(tree)
    assert tree_equal_bits(
        eqx.filter(via_tree, eqx.is_array), eqx.filter(native, eqx.is_array)
    )
    assert tree_equal_bits(jax.vmap(via_tree)(x), jax.vmap(native)(x))
    assert not tree_equal_bits(jax.vmap(native)(x), jax.vmap(model)(x))


def test_nnx_tree_at_with_a_slice_gives_that_model():
    model, x = models.nnx_mlp(), models.mlp_input()
    tree = eqx.tree_at(lambda t: t.layers[1:], bridge.from_nnx(model), replace_fn=zeros)
    rebuilt = bridge.to_nnx(tree)
    assert tree_equal_bits(rebuilt(x), jnp.zeros((x.shape[0], models.D_OUT)))
    assert tree_equal_bits(rebuilt.layers[0].kernel[...], model.layers[0].kernel[...])


def test_a_slice_of_a_mapping_node_is_an_error():
    module, variables = models.linen_mlp()
    tree = bridge.from_linen(variables, module)
    with pytest.raises(KeyError, match="Only a sequence node"):
        tree[1:]
    with pytest.raises(KeyError, match="Dense_0"):
        bridge.trainable(tree, lambda t: t[:2])


@pytest.mark.slow
def test_tree_guide_runs():
    """Every code block of docs/guides/tree.md, in order, as one script."""
    code = run_markdown(Path(__file__).parent.parent / "docs/guides/tree.md")
    assert "t.layers[-2:]" in code
