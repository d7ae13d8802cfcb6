"""Stacked layers (`nn.scan` with the layer axis first): a stack ports into a stack of
the same names, into per-layer layers of any framework (`.blocks[i]` is the i-th
slice of every array of `.blocks`), and per-layer layers back into a stack."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import bridge


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(4)(nn.LayerNorm()(x)), None


class Scanned(nn.Module):
    axis: int = 0  # MaxText puts the layer axis at position 1

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            Block,
            variable_axes={"params": self.axis},
            split_rngs={"params": True},
            length=3,
        )
        x, _ = stack(name="blocks")(x, None)
        return nn.Dense(2, name="head")(x)


class Looped(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x, _ = Block(name=f"layers_{i}")(x, None)
        return nn.Dense(2, name="head")(x)


X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)


def _linen(module, seed):
    return module, module.init(jax.random.key(seed), X)


class EqxBlock(eqx.Module):
    norm: eqx.nn.LayerNorm
    dense: eqx.nn.Linear

    def __call__(self, x):
        return x + self.dense(self.norm(x))


class EqxLooped(eqx.Module):
    layers: list
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.layers = [
            EqxBlock(eqx.nn.LayerNorm(4, eps=1e-6), eqx.nn.Linear(4, 4, key=k))
            for k in keys[:3]
        ]
        self.head = eqx.nn.Linear(4, 2, key=keys[3])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _randomised(model):
    """Linen variables moved away from their init (LayerNorms away from 1 and 0)."""
    module, variables = model
    leaves, treedef = jax.tree_util.tree_flatten(variables)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    leaves = [x + jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return module, jax.tree_util.tree_unflatten(treedef, leaves)


def test_a_stack_ports_into_a_stack_of_the_same_names():
    source, target = _randomised(_linen(Scanned(), 0)), _linen(Scanned(), 1)
    plan = bridge.port_plan(source, target)
    assert ".blocks[2].Dense_0" in {s.source for s in plan.steps}
    ported = bridge.port(source, target, check=X)
    assert bridge.compare(source, ported, X) == 0


@pytest.mark.parametrize("target", ["linen", "equinox", "linen abstract"])
def test_a_stack_into_per_layer_layers_and_back(target):
    source = _randomised(_linen(Scanned(), 0))
    if target == "equinox":
        model = EqxLooped(jax.random.key(1))
    elif target == "linen":
        model = _linen(Looped(), 1)
    else:
        model = Looped(), jax.eval_shape(Looped().init, jax.random.key(1), X)
    plan = bridge.port_plan(source, model)
    assert not plan.problems, plan
    layers = [(s.source, s.target) for s in plan.steps if s.kind == "LayerNorm"]
    if target == "equinox":
        assert layers == [
            (f".blocks[{i}].LayerNorm_0", f".layers[{i}].norm") for i in range(3)
        ]
    else:
        assert layers == [
            (f".blocks[{i}].LayerNorm_0", f".layers_{i}.LayerNorm_0") for i in range(3)
        ]
    ported = bridge.port(source, model, check=X)
    assert bridge.compare(source, ported, X) < 1e-5
    # per-layer -> stacked: the layers are stacked back along the leading axis
    back = bridge.port(ported, _linen(Scanned(), 2), check=X)
    assert bridge.compare(source, back, X) < 1e-5
    shapes = jax.tree_util.tree_map(jnp.shape, back[1]["params"]["blocks"])
    assert shapes["Dense_0"]["kernel"] == (3, 4, 4)


def test_a_stack_of_another_length_is_missing_and_unexpected_layers():
    source = _linen(Scanned(), 0)
    target = _linen(Looped(), 1)
    target = (
        target[0],
        {"params": {k: v for k, v in target[1]["params"].items() if k != "layers_2"}},
    )
    with pytest.raises(
        bridge.PortError, match=r"unexpected: source layer \.blocks\[2\]\.LayerNorm_0"
    ):
        bridge.port(source, target)


def test_the_plan_shows_a_stack_as_one_row_per_layer_kind():
    plan = bridge.port_plan(_linen(Scanned(), 0), EqxLooped(jax.random.key(1)))
    lines = str(plan).splitlines()[2:5]
    rows = [[w for w in line.split() if w.startswith(".")][:2] for line in lines]
    assert rows == [
        [".blocks[0..2].LayerNorm_0", ".layers[0..2].norm"],
        [".blocks[0..2].Dense_0", ".layers[0..2].dense"],
        [".head", ".head"],
    ]
    assert len(plan.steps) == 7  # the rows are still one per layer


def test_a_stack_with_the_layer_axis_elsewhere_is_refused():
    source = _linen(Scanned(axis=1), 0)
    assert source[1]["params"]["blocks"]["Dense_0"]["kernel"].shape == (4, 3, 4)
    with pytest.raises(
        bridge.PortError,
        match=r"\.blocks\.Dense_0 is named like a Dense but holds \['bias', 'kernel'\]",
    ):
        bridge.port(source, _linen(Looped(), 1))
