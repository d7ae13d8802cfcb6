"""Pairing from the computation: given example inputs, the order in which each
forward pass first uses its layers (traced abstractly), which no sorting destroys.
A dict's order is never evidence (test_port_property)."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import bridge

from .helpers import requires
from .resnets import NNXResNet, equinox_resnet, image, linen_resnet


pytestmark = requires("NNX", "eqx.nn.BatchNorm(mode=...)")

TRAIN_OFF = ({"train": False}, {})


def _optax_step(params):
    """One Adam step: the dicts come back sorted, creation order gone."""
    tx = optax.adam(0.1)
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    return optax.apply_updates(params, updates)


def _block_rows(plan):
    return {(s.source, s.target) for s in plan.steps if "Block" in s.source}


def _expected_blocks():
    names = {"Conv_0": "conv1", "BatchNorm_0": "bn1", "Conv_1": "conv2"}
    names |= {"BatchNorm_1": "bn2", "conv_proj": "proj_conv", "norm_proj": "proj_bn"}
    out = set()
    for i in range(8):
        for a, b in names.items():
            if "proj" not in a or i in (2, 4, 6):
                out.add((f".ResNetBlock_{i}.{a}", f".blocks[{i}].{b}"))
    return out


@pytest.fixture(scope="module")
def resnet():
    return linen_resnet()


@pytest.fixture(scope="module")
def targets():
    """`{framework: ResNet-18}` with other names, built once (ports never modify
    their target)."""
    return {"equinox": equinox_resnet(), "nnx": NNXResNet(nnx.Rngs(1))}


def _ports_by_the_forward_pass(source, target):
    """`port` refuses without example inputs, proposing them before rules; with one
    example image every block pairs by the trace and the outputs agree."""
    with pytest.raises(bridge.PortError, match="ambiguous") as refused:
        bridge.port(source, target)
    ambiguous = [p for p in refused.value.problems if p.startswith("ambiguous")]
    assert ambiguous
    for problem in ambiguous:  # example= is proposed before rules
        assert problem.index("Give example inputs") < problem.index("rules")
    x = image()
    plan = bridge.port_plan(source, target, example=x, example_kwargs=TRAIN_OFF)
    assert not plan.problems
    assert _block_rows(plan) == _expected_blocks()
    assert {s.by for s in plan.steps if "Block" in s.source} >= {"trace"}
    ported = bridge.port(source, target, example=x, example_kwargs=TRAIN_OFF)
    assert bridge.compare(source, ported, x, per_side=TRAIN_OFF) < 1e-5
    return ported


@pytest.mark.slow  # a ResNet-18 built and run eagerly: minutes on a shared CPU
@pytest.mark.parametrize("framework", ["equinox", "nnx"])
def test_flax_imagenet_resnet_fresh_init_ports_without_rules(
    resnet, targets, framework
):
    """Fresh `module.init` variables, as the Flax example makes them. A dict's order
    is never trusted (user code builds them in any order: test_port_property), so
    the example image decides, with no rules."""
    module, variables = resnet
    assert list(variables["params"]["ResNetBlock_2"]) == [
        "Conv_0", "BatchNorm_0", "Conv_1", "BatchNorm_1", "conv_proj", "norm_proj"
    ]  # fmt: skip
    _ports_by_the_forward_pass(resnet, targets[framework])


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["equinox", "nnx"])
def test_flax_imagenet_resnet_after_an_optax_step_pairs_by_the_forward_pass(
    resnet, targets, framework
):
    """After an optax step the dicts are sorted (`BatchNorm_0, BatchNorm_1, Conv_0,
    ...`): no order is left but the computation's."""
    module, variables = resnet
    trained = {**variables, "params": _optax_step(variables["params"])}
    block = list(trained["params"]["ResNetBlock_2"])
    assert block[:2] == ["BatchNorm_0", "BatchNorm_1"]
    source = (module, trained)
    target = targets[framework]
    _ports_by_the_forward_pass(source, target)
    # `check=` inputs are example inputs too
    x = image()
    checked = bridge.port(source, target, check=x, check_kwargs=TRAIN_OFF)
    assert bridge.compare(source, checked, x, per_side=TRAIN_OFF) < 1e-5


@pytest.mark.slow
def test_a_forward_pass_that_fails_on_the_example_is_reported(resnet, targets):
    module, variables = resnet
    source = (module, {**variables, "params": _optax_step(variables["params"])})
    with pytest.raises(bridge.PortError, match=r"trace: the source's forward pass"):
        bridge.port(source, targets["equinox"], example=jnp.ones((2, 8, 8, 5)))


class Reversed(nn.Module):
    @nn.compact
    def __call__(self, x):
        outer = nn.Dense(4, name="Dense_0")
        inner = nn.Dense(4, name="Dense_1")
        return outer(jnp.tanh(inner(x)))


class Pair(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(4, 4, rngs=rngs)
        self.second = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.second(jnp.tanh(self.first(x)))


def test_the_forward_pass_decides_where_creation_order_is_not_call_order():
    """`Dense_1` is applied first: creation order pairs it wrongly, the trace right."""
    x = jax.random.normal(jax.random.key(0), (2, 4))
    module = Reversed()
    source = (module, module.init(jax.random.key(1), x))
    target = Pair(nnx.Rngs(0))
    ported = bridge.port(source, target, example=x)
    assert bridge.compare(source, ported, x) < 1e-6
    plan = bridge.port_plan(source, target, example=x)
    assert [(s.source, s.target, s.by) for s in plan.steps] == [
        (".Dense_1", ".first", "trace"),
        (".Dense_0", ".second", "trace"),
    ]


class SameNames(nnx.Module):
    """Named as the Linen auto-names read, but `Dense_0` is applied first here
    (the Linen model applies its `Dense_0` second)."""

    def __init__(self, rngs):
        self.Dense_0 = nnx.Linear(4, 4, rngs=rngs)
        self.Dense_1 = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.Dense_1(jnp.tanh(self.Dense_0(x)))


def test_names_the_forward_pass_contradicts_are_refused():
    """Paths pair `.Dense_0` with `.Dense_0`, but in the source `Dense_1` feeds
    `Dense_0` and in the target `Dense_0` feeds `Dense_1`: with example inputs this
    is refused, proposing the rules the computation implies (which then port it
    exactly). Without example inputs names are all there is (a wrong model: the
    reason to give them)."""
    x = jax.random.normal(jax.random.key(0), (2, 4))
    module = Reversed()
    source = (module, module.init(jax.random.key(1), x))
    wrong = bridge.port(source, SameNames(nnx.Rngs(0)))
    assert bridge.compare(source, wrong, x) > 1e-2
    with pytest.raises(
        bridge.PortError,
        match=r"order: \.Dense_1 -> \.Dense_1 and \.Dense_0 -> \.Dense_0 were paired "
        r"by path, .* in the source \.Dense_1 feeds \.Dense_0 .* in the target "
        r"\.Dense_0 feeds \.Dense_1",
    ):
        bridge.port(source, SameNames(nnx.Rngs(0)), example=x)
    rules = {r"\.Dense_1": ".Dense_0", r"\.Dense_0": ".Dense_1"}
    ported = bridge.port(source, SameNames(nnx.Rngs(0)), rules=rules, example=x)
    assert bridge.compare(source, ported, x) < 1e-6


class LinenGated(nn.Module):
    @nn.compact
    def __call__(self, x):
        gate = nn.Dense(6, use_bias=False, name="gate")(x)
        up = nn.Dense(6, use_bias=False, name="up")(x)
        return nn.Dense(4, use_bias=False, name="down")(jax.nn.silu(gate) * up)


class GatedUpFirst(nnx.Module):
    """The same MLP computing `up` before `gate`: an order of use, not of
    dependence (neither feeds the other), so names stay right."""

    def __init__(self, rngs):
        self.down = nnx.Linear(6, 4, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(4, 6, use_bias=False, rngs=rngs)
        self.gate = nnx.Linear(4, 6, use_bias=False, rngs=rngs)

    def __call__(self, x):
        up = self.up(x)
        return self.down(up * jax.nn.silu(self.gate(x)))


def test_names_computed_in_another_order_but_not_contradicted_port():
    x = jax.random.normal(jax.random.key(0), (2, 4))
    module = LinenGated()
    source = (module, module.init(jax.random.key(1), x))
    ported = bridge.port(source, GatedUpFirst(nnx.Rngs(0)), example=x)
    assert bridge.compare(source, ported, x) < 1e-6


class _GatedMlp(nnx.Module):
    def __init__(self, rngs, up_first):
        self.gate = nnx.Linear(4, 6, rngs=rngs)
        self.up = nnx.Linear(4, 6, rngs=rngs)
        self.down = nnx.Linear(6, 4, rngs=rngs)
        self.up_first = up_first

    def __call__(self, x):
        if self.up_first:
            u = self.up(x)
            g = self.gate(x)
        else:
            g = self.gate(x)
            u = self.up(x)
        return x + self.down(jax.nn.silu(g) * u)


class _Layers(nnx.Module):
    def __init__(self, rngs, up_first):
        self.layers = nnx.List([_GatedMlp(rngs, up_first) for _ in range(2)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _Prefixed(nnx.Module):
    def __init__(self, rngs):
        self.model = _Layers(rngs, up_first=False)

    def __call__(self, x):
        return self.model(x)


def test_branches_used_in_another_order_pair_by_indices_and_names():
    """`.model.layers[i].gate` / `.up` against `.layers[i].gate` / `.up`, one model
    computing `up` first: the orders of use disagree and the paths differ by a
    prefix, but with both passes traced the indices and last names pair them."""
    x = jax.random.normal(jax.random.key(0), (2, 4))
    source = _Prefixed(nnx.Rngs(0))
    target = _Layers(nnx.Rngs(1), up_first=True)
    plan = bridge.port_plan(source, target, example=x)
    rows = {(s.source, s.target, s.by) for s in plan.steps}
    assert (".model.layers[1].up", ".layers[1].up", "name") in rows
    assert (".model.layers[0].gate", ".layers[0].gate", "name") in rows
    ported = bridge.port(source, target, example=x)
    assert bridge.compare(source, ported, x) < 1e-6


class OIHWConv(nn.Module):
    """A convolution written by hand with PyTorch's kernel layout `(out, in, kh,
    kw)`: with 3 channels and a 3x3 window its kernel has the shapes of a Flax
    `(kh, kw, in, out)` one."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (3, 3, 3, 3))
        bias = self.param("bias", nn.initializers.zeros, (3,))
        dims = ("NHWC", "OIHW", "NHWC")
        y = jax.lax.conv_general_dilated(
            x, kernel, (1, 1), "SAME", dimension_numbers=dims
        )
        return y + bias[None, None, None]


class HandConv(nn.Module):
    @nn.compact
    def __call__(self, x):
        return OIHWConv(name="conv")(x)


class NNXConv(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 3, (3, 3), rngs=rngs)

    def __call__(self, x):
        return self.conv(x)


def test_a_conv_kernel_the_trace_shows_in_another_layout_is_refused():
    """Shapes alone read the hand-written kernel as Flax's HWIO (a wrong model, and
    nothing can tell without running it); with example inputs the convolution's
    dimension numbers say out is axis 0: refused, naming the axes."""
    x = jax.random.normal(jax.random.key(0), (1, 5, 5, 3))
    module = HandConv()
    source = (module, module.init(jax.random.key(1), x))
    assert bridge.compare(source, bridge.port(source, NNXConv(nnx.Rngs(0))), x) > 1e-2
    with pytest.raises(
        bridge.PortError,
        match=r"layout: \.conv \(Conv kernel \(3, 3, 3, 3\)\) .* out at axis 0, in at "
        r"axis 1 and spatial axes \(2, 3\)",
    ):
        bridge.port(source, NNXConv(nnx.Rngs(0)), example=x)
    flax_layout = bridge.port(NNXConv(nnx.Rngs(2)), NNXConv(nnx.Rngs(3)), example=x)
    assert bridge.compare(NNXConv(nnx.Rngs(2)), flax_layout, x) < 1e-6


class _Cache(nnx.Module):
    """A KV cache passed to the model as an argument, as bonsai's decoders take it."""

    def __init__(self):
        self.k = nnx.Cache(jnp.zeros((2, 3, 4)))
        self.index = nnx.Variable(jnp.array(0))


class _Cached(nnx.Module):
    def __init__(self, rngs):
        self.q = nnx.Linear(4, 4, rngs=rngs)
        self.o = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x, cache):
        h = self.q(x)
        cache.k[...] = cache.k[...].at[:, 0].set(h)
        cache.index[...] += 1
        return self.o(h + cache.k[...].sum(1))


class _Renamed(nnx.Module):
    def __init__(self, rngs):
        self.second = nnx.Linear(4, 4, rngs=rngs)  # created first, used second
        self.first = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x, cache):
        h = self.first(x)
        cache.k[...] = cache.k[...].at[:, 0].set(h)
        return self.second(h + cache.k[...].sum(1))


def test_a_forward_pass_writing_a_cache_argument_is_traced():
    """A forward pass that writes into an NNX cache given as an example input raised
    `TraceContextError` (the cache was mutated from inside the trace): the inputs
    are rebuilt inside the trace from their arrays, as `nnx.jit` does. The trace
    pairs the layers (`q` -> `first`, `o` -> `second`, against their creation
    order), the port is exact, and the caller's cache is untouched."""
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    cache = _Cache()
    source = _Cached(nnx.Rngs(0))
    ported = bridge.port(source, _Renamed(nnx.Rngs(1)), example=(x, cache))
    assert int(cache.index[...]) == 0
    np.testing.assert_array_equal(ported.first.kernel[...], source.q.kernel[...])
    np.testing.assert_array_equal(ported.second.kernel[...], source.o.kernel[...])
    np.testing.assert_allclose(
        ported(x, _Cache()), source(x, _Cache()), rtol=1e-6, atol=1e-6
    )


class EqxPair(eqx.Module):
    """Two square layers used in the order they are declared (the order an
    Equinox file records)."""

    first: eqx.nn.Linear
    second: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(4, 4, key=k1)
        self.second = eqx.nn.Linear(4, 4, key=k2)

    def __call__(self, x):
        return self.second(jnp.tanh(self.first(x)))


class UsedNotCreated(nnx.Module):
    """Its own names, created in the other order than used: only its forward pass
    pairs it with `EqxPair`."""

    def __init__(self, rngs):
        self.b = nnx.Linear(4, 4, rngs=rngs)
        self.a = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def test_an_equinox_file_into_another_framework_pairs_by_like_s_trace(tmp_path):
    """An Equinox file is read back as skeletons (no code to run): with `example=`,
    only `like`'s forward pass is traced and the file's recorded order pairs with
    it (the load was refused as 'a Skeleton' before). `like` made abstract
    (`nnx.eval_shape`, attributes sorted: its creation order lost) is refused
    without example inputs and exact with them."""
    x = jax.random.normal(jax.random.key(0), (2, 4))
    source = EqxPair(jax.random.key(1))
    path = tmp_path / "eqx.safetensors"
    bridge.save(path, source)
    abstract = nnx.eval_shape(lambda: UsedNotCreated(nnx.Rngs(0)))
    with pytest.raises(bridge.PortError, match="order is not known"):
        bridge.load(path, like=abstract)
    loaded = bridge.load(path, like=abstract, example=x)
    assert bridge.compare(source, loaded, x) == 0.0
    plan = bridge.port_plan(bridge.load(path), abstract, example=x)
    assert [(s.source, s.target, s.by) for s in plan.steps] == [
        (".first", ".a", "trace"),
        (".second", ".b", "trace"),
    ]


def test_one_traced_side_whose_orders_differ_is_refused(tmp_path):
    """`like` created `b, a` and uses `a, b`; the file records only the order its
    layers were created in: which of like's orders it matches only the source's
    own forward pass could say. Refused (creation order alone ports it wrongly,
    0.6 off; the trace alone would be a guess)."""
    x = jax.random.normal(jax.random.key(0), (2, 4))
    source = EqxPair(jax.random.key(1))
    path = tmp_path / "eqx.safetensors"
    bridge.save(path, source)
    wrong = bridge.load(path, like=UsedNotCreated(nnx.Rngs(0)))
    assert bridge.compare(source, wrong, x) > 1e-2
    with pytest.raises(
        bridge.PortError,
        match=r"only the target's forward pass was traced: it uses these layers in "
        r"another order than it created them",
    ):
        bridge.load(path, like=UsedNotCreated(nnx.Rngs(0)), example=x)
    ported = bridge.port(source, UsedNotCreated(nnx.Rngs(0)), example=x)
    assert bridge.compare(source, ported, x) == 0.0  # from the model: both traced
