import equinox as eqx
import flax.linen as nn
import jax
import pytest
from flax import nnx

import bridge
from bridge._tree import framework

from . import models
from .helpers import tree_equal_bits


def test_to_neutral_dispatches_on_what_it_is_given():
    module, variables = models.linen_mlp()
    model, state = models.equinox_cnn()
    nnx_model = models.nnx_mlp()
    cases = [
        (nnx_model, "nnx"),
        (model, "equinox"),
        ((model, state), "equinox"),
        (variables, "linen"),
        ((module, variables), "linen"),
        (module.bind(variables), "linen"),
    ]
    for obj, expected in cases:
        t = bridge.to_neutral(obj)
        assert framework(t) == expected
        assert bridge.to_neutral(t) is t
    assert framework(bridge.to_neutral((model, state))) == "equinox"
    assert isinstance(bridge.to_native(bridge.to_neutral((model, state))), tuple)


def test_to_native_gives_each_framework_its_own_model():
    module, variables = models.linen_mlp()
    x = models.mlp_input()
    bound = bridge.to_native(bridge.to_neutral((module, variables)))
    assert isinstance(bound, nn.Module) and tree_equal_bits(
        bound(x), module.apply(variables, x)
    )
    assert isinstance(bridge.to_native(bridge.to_neutral(models.nnx_mlp())), nnx.Module)
    eqx_model = bridge.to_native(bridge.to_neutral(models.equinox_mlp()))
    assert isinstance(eqx_model, eqx.nn.MLP)
    assert tree_equal_bits(jax.vmap(eqx_model)(x), jax.vmap(models.equinox_mlp())(x))


def test_an_unknown_object_is_refused():
    with pytest.raises(TypeError, match="does not know how to convert a int"):
        bridge.to_neutral(3)
    with pytest.raises(TypeError, match="does not know how to convert a tuple"):
        bridge.to_neutral((1, 2))


def test_an_unbound_linen_module_is_refused():
    module, _ = models.linen_mlp()
    with pytest.raises(TypeError, match="unbound Linen module holds no weights"):
        bridge.to_neutral(module)


def test_a_subtree_is_refused():
    t = bridge.from_nnx(models.nnx_mlp())
    with pytest.raises(TypeError, match="a part of a model .a subtree."):
        bridge.to_native(t.layers)
    with pytest.raises(TypeError, match="Expected a bridge.Tree, got dict"):
        bridge.to_native({})


@pytest.mark.parametrize(
    "source, to",
    [
        ("nnx", bridge.to_linen),
        ("nnx", bridge.to_equinox),
        ("linen", bridge.to_nnx),
        ("equinox", bridge.to_nnx),
        ("equinox", bridge.to_linen),
    ],
)
def test_a_tree_from_another_framework_is_refused(source, to):
    make = {
        "nnx": lambda: bridge.from_nnx(models.nnx_mlp()),
        "linen": lambda: bridge.from_linen(models.linen_mlp()[1]),
        "equinox": lambda: bridge.from_equinox(models.equinox_mlp()),
    }[source]
    with pytest.raises(
        TypeError, match=r"use bridge.to_native\(tree\), or bridge.port"
    ):
        to(make())
