"""A part of a model (`bridge.from_equinox(vit).blocks[0]`) keeps no module settings:
the other side tells a setting the layout needs (`heads`), with a warning, or the
port is refused naming the setting."""

import equinox as eqx
import jax
import pytest
from flax import nnx

import bridge

from .helpers import requires


pytestmark = requires("NNX")
D = 8


class EqxBlock(eqx.Module):
    attention: eqx.nn.MultiheadAttention

    def __init__(self, heads, key):
        self.attention = eqx.nn.MultiheadAttention(heads, D, key=key)

    def __call__(self, x):
        return self.attention(x, x, x)


class EqxViT(eqx.Module):
    attention_blocks: list

    def __init__(self, key):
        keys = jax.random.split(key)
        self.attention_blocks = [EqxBlock(2, k) for k in keys]


class NNXBlock(nnx.Module):
    def __init__(self, heads, rngs):
        self.attention = nnx.MultiHeadAttention(heads, D, decode=False, rngs=rngs)

    def __call__(self, x):
        return self.attention(x)


class TwoBlocks(nnx.Module):
    def __init__(self, rngs):
        self.a, self.b = NNXBlock(2, rngs), NNXBlock(4, rngs)


def test_a_part_of_an_equinox_model_is_told_heads_by_the_target():
    vit = EqxViT(jax.random.key(0))
    part = bridge.from_equinox(vit).attention_blocks[0]
    with pytest.warns(bridge.PortWarning, match=r"setting `heads` is not recorded"):
        ported = bridge.port(part, NNXBlock(2, nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (2, 3, D))
    assert bridge.compare(vit.attention_blocks[0], ported, x) < 1e-5


def test_a_setting_nobody_tells_is_an_error_naming_it():
    part = bridge.from_equinox(EqxViT(jax.random.key(0))).attention_blocks[0]
    with pytest.raises(bridge.PortError, match=r"its setting `heads` is not known"):
        bridge.port(part, TwoBlocks(nnx.Rngs(0)), strict=False)
