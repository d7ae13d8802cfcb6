"""Pairing by kind, shape and definition order; rules; Linen names; compare."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bridge

from . import models
from .helpers import requires


KEY = jax.random.key


class TwelveDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(12):
            x = nn.Dense(4)(x)
        return x


class TwelveLinear(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(12)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@requires("NNX")
def test_linen_definition_order_not_sorted_order():
    """JAX sorts `Dense_10` before `Dense_2`; pairing follows definition order."""
    x = jnp.ones((2, 4))
    module = TwelveDense()
    source = (module, module.init(KEY(0), x))
    target = TwelveLinear(nnx.Rngs(1))
    plan = bridge.port_plan(source, target)
    assert [s.source for s in plan.steps] == [f".Dense_{i}" for i in range(12)]
    assert [s.target for s in plan.steps] == [f".layers[{i}]" for i in range(12)]
    assert bridge.compare(source, bridge.port(source, target), x) < 1e-5


class SortedLater(nnx.Module):
    def __init__(self, rngs):
        self.zeta = nnx.Linear(4, 4, rngs=rngs)  # defined first, sorted last
        self.alpha = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.alpha(self.zeta(x))


@requires("NNX")
def test_nnx_definition_order_not_sorted_keys():
    source = SortedLater(nnx.Rngs(0))
    target = eqx.nn.Sequential([eqx.nn.Linear(4, 4, key=KEY(i)) for i in range(2)])
    plan = bridge.port_plan(source, target)
    assert [(s.source, s.target) for s in plan.steps] == [
        (".zeta", ".layers[0]"),
        (".alpha", ".layers[1]"),
    ]
    x = jnp.ones((3, 4))
    assert bridge.compare(source, bridge.port(source, target), x) < 1e-5


class Swapped(nn.Module):
    """Dense_0 is constructed first but applied second (FACTS.md)."""

    @nn.compact
    def __call__(self, x):
        outer = nn.Dense(3)
        return outer(jax.nn.relu(nn.Dense(6)(x)))


def test_shapes_pair_layers_defined_in_another_order():
    x = jnp.ones((2, 3))
    module = Swapped()
    source = (module, module.init(KEY(0), x))
    target = eqx.nn.MLP(3, 3, 6, depth=1, activation=jax.nn.relu, key=KEY(1))
    plan = bridge.port_plan(source, target)
    assert {(s.source, s.target) for s in plan.steps} == {
        (".Dense_1", ".layers[0]"),
        (".Dense_0", ".layers[1]"),
    }
    assert bridge.compare(source, bridge.port(source, target), x) < 1e-5


def test_rules_with_groups():
    source, target = models.linen_mlp(1), models.equinox_mlp(2)
    rules = {r"\.Dense_(\d)": r".layers[\1]"}
    plan = bridge.port_plan(source, target, rules=rules)
    assert [s.target for s in plan.steps] == [".layers[0]", ".layers[1]", ".layers[2]"]
    ported = bridge.port(source, target, rules=rules)
    assert bridge.compare(source, ported, models.mlp_input()) < 1e-5


def test_linen_layer_without_auto_name_is_recognised_by_its_arrays():
    """Names from `setup` carry no class: the arrays decide, and the target the
    kind when several fit (a `scale` alone: LayerNorm, GroupNorm or RMSNorm)."""
    variables = {
        "params": {
            "proj": {"kernel": jnp.ones((4, 4)), "bias": jnp.zeros(4)},
            "norm": {"scale": jnp.full(4, 2.0)},
        }
    }
    target = eqx.nn.Sequential([eqx.nn.Linear(4, 4, key=KEY(0)), eqx.nn.RMSNorm(4)])
    plan = bridge.port_plan(variables, target)
    assert [s.kind for s in plan.steps] == ["Dense", "RMSNorm"]
    assert "bias = 0.0" in plan.steps[1].transform
    ported = bridge.port(variables, target)
    assert np.array_equal(ported.layers[1].weight, np.full(4, 2.0))
    assert np.array_equal(ported.layers[1].bias, np.zeros(4))


def test_plan_table():
    source, (target, state) = models.linen_cnn(), models.equinox_cnn()
    text = str(bridge.port_plan(source, (target, state)))
    lines = text.splitlines()
    # a plan wider than 100 columns folds each row onto two lines
    header = " ".join(lines[:2]).replace(";", " ").split()
    for word in ("~", "source", "target", "kind", "by", "transform", "shapes"):
        assert word in header, header
    assert ".BatchNorm_0" in text and "Flax -> stats in State" in text
    assert "weight OIHW" in text


@requires("NNX")
def test_compare_equals_native_outputs():
    """compare runs each framework as it runs itself; channel_first moves axes."""
    x = models.cnn_input()
    module, variables = models.linen_cnn()
    native = module.apply(variables, x)
    model, state = models.equinox_cnn()
    ported = bridge.port((module, variables), (model, state))
    model, state = ported
    infer = eqx.nn.inference_mode(model)
    eqx_infer = jax.vmap(lambda e: infer(e, state)[0])(x)
    assert np.allclose(eqx_infer, native, atol=1e-6)
    assert bridge.compare((module, variables), ported, x) == float(
        np.max(
            np.abs(np.asarray(eqx_infer, np.float64) - np.asarray(native, np.float64))
        )
    )
    conv = eqx.nn.Conv2d(2, 3, 3, padding=1, key=KEY(0))
    flax_conv = bridge.port(conv, nnx.Conv(2, 3, (3, 3), rngs=nnx.Rngs(0)))
    assert bridge.compare(conv, flax_conv, x, channel_first=(True, False)) < 1e-5


def test_bound_linen_modules_in_and_out():
    module, variables = models.linen_mlp(1)
    target_module, target_variables = models.linen_mlp(2)
    bound = target_module.bind(target_variables)
    ported = bridge.port(module.bind(variables), bound)
    assert isinstance(ported, nn.Module) and ported.scope is not None
    x = models.mlp_input()
    assert np.array_equal(ported(x), module.apply(variables, x))
    assert not np.array_equal(bound(x), module.apply(variables, x))


class Stack(eqx.Module):
    layers: list


class Wrapped(eqx.Module):
    net: Stack


def _stack(n: int) -> Stack:
    return Stack([eqx.nn.Linear(4, 4, key=KEY(i)) for i in range(n)])


def test_pairing_by_order_asks_about_n_log_n_pairs_not_every_pair(monkeypatch):
    """Layers that names do not pair (`.layers[i]` -> `.net.layers[i]`) pair by kind,
    shapes and creation order, which is checked per node and sorted, not asked of
    every two layers (issue 28: a 128-layer model's pairing was quadratic)."""
    from bridge._port import _pairing

    asked = []
    compare, common_kind = _pairing.Order.compare, _pairing.common_kind

    def counted_compare(self, a, b):
        asked.append(1)
        return compare(self, a, b)

    def counted_kind(a, b):
        asked.append(1)
        return common_kind(a, b)

    monkeypatch.setattr(_pairing.Order, "compare", counted_compare)
    monkeypatch.setattr(_pairing, "common_kind", counted_kind)
    counts = {}
    for n in (32, 128):
        asked.clear()
        plan = bridge.port_plan(_stack(n), Wrapped(_stack(n)))
        assert not plan.problems
        assert [(s.source, s.target, s.by) for s in plan.steps] == [
            (f".layers[{i}]", f".net.layers[{i}]", "order") for i in range(n)
        ]
        counts[n] = len(asked)
    assert counts[128] < 6 * counts[32], counts  # every pair: 16x


@requires("NNX")
def test_two_alignments_that_tie_name_every_layer_either_pairs():
    """Creation orders `[(4, 4), (4, 8)]` and `[(4, 8), (4, 4)]`: either pair is the
    best order-preserving alignment, so both sources are ambiguous, and each has a
    line of its own (the second alignment's source had none)."""
    from bridge._port._align import _align
    from bridge._port._find import find_layers
    from bridge._port._side import read_side

    def layers(*shapes):
        class M(nnx.Module):
            def __init__(self, rngs):
                for k, (i, o) in enumerate(shapes):
                    setattr(self, f"l{k}", nnx.Linear(i, o, rngs=rngs))

        return find_layers(read_side(M(nnx.Rngs(0)), 0, []), [])

    problems: list[str] = []
    ambiguous: set[int] = set()
    sources, targets = layers((4, 4), (4, 8)), layers((4, 8), (4, 4))
    assert _align(sources, targets, problems, ambiguous, "") == []
    assert len(problems) == 2
    assert "source layer .l0 (Dense) could pair with .l1 or nothing" in problems[0]
    assert "source layer .l1 (Dense) could pair with .l0 or nothing" in problems[1]
