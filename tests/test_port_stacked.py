"""Stacked layers (Linen `nn.scan` with the layer axis first, NNX blocks made under
`nnx.vmap`, Equinox blocks made by `eqx.filter_vmap`): a stack ports into a stack, into
per-layer layers of any framework (`.blocks[i]` is the i-th slice of every array of
`.blocks`), and per-layer layers back into a stack; outputs compared."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import requires, skip_unless


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
    stack_target = _linen(Scanned(), 2)
    before = jax.tree_util.tree_map(np.array, stack_target[1])
    back = bridge.port(ported, stack_target, check=X)
    assert bridge.compare(source, back, X) < 1e-5
    shapes = jax.tree_util.tree_map(jnp.shape, back[1]["params"]["blocks"])
    assert shapes["Dense_0"]["kernel"] == (3, 4, 4)
    # the stack is filled in place in a new array: the target's own are untouched
    assert jax.tree_util.tree_all(
        jax.tree_util.tree_map(np.array_equal, before, stack_target[1])
    )


def test_per_layer_layers_into_an_abstract_stack_are_its_slices_bit_for_bit():
    """Each layer is converted inside the (donated) write into the stack: every slice
    is the Equinox layer's own weight transposed, bit for bit, and the source's
    arrays are neither changed nor donated."""
    source = EqxLooped(jax.random.key(3))
    before = jax.tree_util.tree_map(np.array, eqx.filter(source, eqx.is_array))
    like = Scanned(), jax.eval_shape(Scanned().init, jax.random.key(1), X)
    blocks = bridge.port(source, like)[1]["params"]["blocks"]
    for i, layer in enumerate(source.layers):
        assert np.array_equal(
            blocks["Dense_0"]["kernel"][i], np.asarray(layer.dense.weight).T
        )
        assert np.array_equal(blocks["Dense_0"]["bias"][i], layer.dense.bias)
        assert np.array_equal(blocks["LayerNorm_0"]["scale"][i], layer.norm.weight)
    after = eqx.filter(source, eqx.is_array)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, before, after))


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
    rows = [
        [w for w in line.split() if w.startswith(".")][:2]
        for line in str(plan).splitlines()
    ]
    rows = [row for row in rows if row]  # a row's transform line names no layer
    assert rows == [
        [".blocks[0..2].LayerNorm_0", ".layers[0..2].norm"],
        [".blocks[0..2].Dense_0", ".layers[0..2].dense"],
        [".head", ".head"],
    ]
    assert len(plan.steps) == 7  # the rows are still one per layer


def test_a_stack_with_the_layer_axis_at_one_ports_like_maxtext():
    """`variable_axes={"params": 1}` (MaxText's `param_scan_axis=1`): the layer axis
    is found where the shapes put it, both ways."""
    source = _randomised(_linen(Scanned(axis=1), 0))
    assert source[1]["params"]["blocks"]["Dense_0"]["kernel"].shape == (4, 3, 4)
    ported = bridge.port(source, _linen(Looped(), 1), check=X)
    assert bridge.compare(source, ported, X) < 1e-5
    back = bridge.port(ported, _linen(Scanned(axis=1), 2), check=X)
    assert bridge.compare(source, back, X) < 1e-5
    assert back[1]["params"]["blocks"]["LayerNorm_0"]["scale"].shape == (4, 3)


class BiasFree(nn.Module):
    """A bias-free block with named projections (Llama's): its `(L, in, out)`
    kernels are DenseGeneral or Conv kernels too, but a scanned block holds several
    layers."""

    features: int = 4

    @nn.compact
    def __call__(self, x, _):
        h = nn.RMSNorm(name="norm")(x)
        h = nn.Dense(self.features, use_bias=False, name="up")(h)
        down = nn.Dense(self.features, use_bias=False, name="down")
        return x + down(jnp.tanh(h)), None


class BiasFreeScanned(nn.Module):
    axis: int = 0
    features: int = 4

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(
            BiasFree,
            variable_axes={"params": self.axis},
            split_rngs={"params": True},
            length=3,
        )
        return stack(self.features, name="layers")(x, None)[0]


class BiasFreeLooped(nnx.Module):
    def __init__(self, rngs, features=4):
        def block():
            b = nnx.Module()
            b.norm = nnx.RMSNorm(features, rngs=rngs)
            b.up = nnx.Linear(features, features, use_bias=False, rngs=rngs)
            b.down = nnx.Linear(features, features, use_bias=False, rngs=rngs)
            return b

        self.layers = nnx.List([block() for _ in range(3)])

    def __call__(self, x):
        for b in self.layers:
            x = x + b.down(jnp.tanh(b.up(b.norm(x))))
        return x


@pytest.mark.parametrize("axis", [0, 1])
def test_a_bias_free_stack_at_either_axis_into_per_layer_nnx_and_back(axis):
    skip_unless("NNX")
    source = _randomised(_linen(BiasFreeScanned(axis=axis), 0))
    target = BiasFreeLooped(nnx.Rngs(1))
    plan = bridge.port_plan(source, target)
    assert not plan.problems, plan
    assert (".layers[2].up", ".layers[2].up") in {
        (s.source, s.target) for s in plan.steps
    }
    ported = bridge.port(source, target, check=X)
    assert bridge.compare(source, ported, X) < 1e-5
    back = bridge.port(ported, _linen(BiasFreeScanned(axis=axis), 2), check=X)
    assert bridge.compare(source, back, X) < 1e-5


@requires("NNX")
def test_a_stack_whose_axis_the_shapes_do_not_tell_is_refused_naming_it():
    """Three layers of 3 features at axis 1: axes 0, 1 and 2 all read as stacks."""
    module = BiasFreeScanned(axis=1)
    variables = module.init(jax.random.key(0), X)
    params = jax.tree_util.tree_map(
        lambda x: x[:3, :, :3] if x.ndim == 3 else x[:3], variables["params"]
    )
    with pytest.raises(bridge.PortError, match=r"stack: source \.layers reads as"):
        bridge.port((module, {"params": params}), BiasFreeLooped(nnx.Rngs(1)))


@pytest.mark.parametrize("axis", [0, 1])
def test_a_stack_whose_axis_only_the_scan_tells_ports_with_example_inputs(axis):
    """Three layers of 3 features (`L = D`): the `(3, 3, 3)` kernels and `(3, 3)`
    scales slice into layers at axis 0 and at axis 1 alike, and the looped model's
    layers fit both readings. Without example inputs: refused, naming the axes.
    With them, the scan in the forward pass iterates over the stored axis
    `variable_axes` put the layers on: ported exactly, both ways."""
    skip_unless("NNX")
    x = X[:, :3]
    module = BiasFreeScanned(axis=axis, features=3)
    source = _randomised((module, module.init(jax.random.key(0), x)))
    target = BiasFreeLooped(nnx.Rngs(1), features=3)
    with pytest.raises(bridge.PortError, match=r"stack: source \.layers reads as"):
        bridge.port(source, target)
    ported = bridge.port(source, target, example=x)
    assert bridge.compare(source, ported, x) < 1e-6
    blank = (module, module.init(jax.random.key(2), x))
    back = bridge.port(ported, blank, example=x)
    assert bridge.compare(source, back, x) < 1e-6


# --- stacks of NNX (nnx.vmap) and Equinox (eqx.filter_vmap) modules ---------------


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.dense = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return x + self.dense(self.norm(x))


class NNXStacked(nnx.Module):
    """The flax guide's pattern: blocks made under `nnx.vmap`, run by `nnx.scan`."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NNXBlock(rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.head(forward(x, self.blocks))


class NNXLooped(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([NNXBlock(rngs) for _ in range(3)])
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class EqxStackedBlock(eqx.Module):
    norm: eqx.nn.LayerNorm
    dense: eqx.nn.Linear

    def __init__(self, key):
        self.norm = eqx.nn.LayerNorm(4, eps=1e-6)
        self.dense = eqx.nn.Linear(4, 4, key=key)

    def __call__(self, x):
        return x + self.dense(self.norm(x))


class EqxStacked(eqx.Module):
    """One block whose arrays have a leading layer axis (`eqx.filter_vmap`), run by
    `lax.scan`: the Equinox recipe for scan-over-layers."""

    blocks: EqxStackedBlock
    head: eqx.nn.Linear

    def __init__(self, key):
        a, b = jax.random.split(key)
        self.blocks = eqx.filter_vmap(EqxStackedBlock)(jax.random.split(a, 3))
        self.head = eqx.nn.Linear(4, 2, key=b)

    def __call__(self, x):
        arrays, static = eqx.partition(self.blocks, eqx.is_array)

        def forward(x, layer):
            return eqx.combine(layer, static)(x), None

        x, _ = jax.lax.scan(forward, x, arrays)
        return self.head(x)


def _model(name, seed):
    if name.startswith("nnx"):
        skip_unless("NNX")
    if name == "linen scan":
        return _randomised(_linen(Scanned(), seed))
    if name == "linen loop":
        return _randomised(_linen(Looped(), seed))
    if name == "nnx vmap":
        return NNXStacked(nnx.Rngs(seed))
    if name == "nnx loop":
        return NNXLooped(nnx.Rngs(seed))
    if name == "equinox vmap":
        return EqxStacked(jax.random.key(seed))
    return EqxLooped(jax.random.key(seed))


def _abstract(name, seed):
    if name.startswith("nnx"):
        skip_unless("NNX")
    if name.startswith("nnx"):
        return nnx.eval_shape(lambda: _model(name, seed))
    if name.startswith("equinox"):
        return eqx.filter_eval_shape(_model, name, seed)
    module = Scanned() if name == "linen scan" else Looped()
    return module, jax.eval_shape(module.init, jax.random.key(seed), X)


STACKS = ["linen scan", "nnx vmap", "equinox vmap"]
LOOPS = ["linen loop", "nnx loop", "equinox loop"]


def _cases():
    """Every stack into every other stack and every per-layer model, and back; the
    targets concrete and abstract (`eval_shape`: long cases `slow` but the stacks)."""
    pairs = [(s, t) for s in STACKS for t in STACKS + LOOPS if s != t]
    pairs += [(s, t) for s in LOOPS for t in STACKS]
    for source, target in pairs:
        yield pytest.param(source, target, False, id=f"{source}->{target}")
        slow = () if source in STACKS and target in STACKS else pytest.mark.slow
        yield pytest.param(
            source, target, True, id=f"{source}->{target} abstract", marks=slow
        )


@pytest.mark.parametrize("source, target, abstract", list(_cases()))
def test_stacks_of_every_framework_port_both_ways(source, target, abstract):
    model = _model(source, 0)
    like = _abstract(target, 1) if abstract else _model(target, 1)
    plan = bridge.port_plan(model, like)
    assert not plan.problems, plan
    if source in STACKS and target in STACKS:  # stacked -> stacked: one row each
        norms = [s for s in plan.steps if s.kind == "LayerNorm"]
        assert [s.source.split(".")[1] for s in norms] == [
            f"blocks[{i}]" for i in range(3)
        ]
    ported = bridge.port(model, like, check=X)
    assert bridge.compare(model, ported, X) < 1e-5


def test_a_stack_is_one_row_in_the_plan():
    plan = bridge.port_plan(_model("equinox vmap", 0), _model("nnx loop", 1))
    text = str(plan)
    assert ".blocks[0..2].dense" in text and ".layers[0..2].dense" in text
