"""`bridge.port` through wrappers: an outer model of each framework holding a wrapped
model of each other framework, ported to and from the same architecture written in
one framework; the outputs of source and result are compared (both are run)."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge
from bridge._embed._as_linen import linen_wrappers

from .embed_models import (
    DIRECTIONS,
    NNXMLP,
    EquinoxBatchCNN,
    EquinoxMLP,
    LinenMLP,
    inputs,
    native,
)
from .helpers import requires
from .models import D_IN, D_OUT, NNXCNN, EquinoxCNN


HEAD_IN, HEAD_OUT = 2, 3


class LinenOuter(nn.Module):
    enc: nn.Module

    @nn.compact
    def __call__(self, x):
        return nn.Dense(HEAD_OUT)(self.enc(x))


class NNXOuter(nnx.Module):
    def __init__(self, enc, rngs):
        self.enc = enc
        self.head = nnx.Linear(HEAD_IN, HEAD_OUT, rngs=rngs)

    def __call__(self, x):
        return self.head(self.enc(x))


class EquinoxOuter(eqx.Module):
    enc: eqx.Module
    head: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(self.head)(self.enc(x))


class LinenAll(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(HEAD_OUT, name="head")(LinenMLP(name="enc")(x))


def mixed(outer, inner, seed):
    """An `outer` model whose encoder is a wrapped `inner` MLP; `(model, run)`."""
    x, _ = inputs("mlp")
    component = native(inner, "mlp", seed)
    if outer == "linen":
        module = LinenOuter(bridge.as_linen(component))
        variables = module.init(jax.random.key(seed + 1), x)
        return (module, variables), lambda m: m[0].apply(m[1], x)
    if outer == "nnx":
        model = NNXOuter(bridge.as_nnx(component), nnx.Rngs(seed + 1))
        return model, lambda m: m(x)
    head = eqx.nn.Linear(HEAD_IN, HEAD_OUT, key=jax.random.key(seed + 1))
    return EquinoxOuter(bridge.as_equinox(component), head), lambda m: m(x)


def all_in(fw, seed):
    """The same architecture written in framework `fw` alone; `(model, run)`."""
    x, _ = inputs("mlp")
    if fw == "linen":
        module = LinenAll()
        return (module, module.init(jax.random.key(seed), x)), lambda m: m[0].apply(
            m[1], x
        )
    if fw == "nnx":
        rngs = nnx.Rngs(seed)
        return NNXOuter(NNXMLP(rngs), rngs), lambda m: m(x)
    key = jax.random.key(seed)
    head = eqx.nn.Linear(HEAD_IN, HEAD_OUT, key=key)
    return EquinoxOuter(EquinoxMLP(key), head), lambda m: m(x)


def _third(*frameworks):
    return next(f for f in ("linen", "nnx", "equinox") if f not in frameworks)


@requires("NNX")
@pytest.mark.parametrize("inner, outer", DIRECTIONS)
def test_port_a_model_holding_a_wrapper(inner, outer):
    # to the same architecture in the third framework and back, outputs equal
    source, run_source = mixed(outer, inner, seed=0)
    other = _third(inner, outer)
    target, run_target = all_in(other, seed=10)
    want = run_source(source)
    assert not jnp.allclose(run_target(target), want, atol=1e-3)
    ported = bridge.port(source, target)
    assert jnp.allclose(run_target(ported), want, atol=1e-6)
    fresh, _ = mixed(outer, inner, seed=20)
    assert not jnp.allclose(run_source(fresh), want, atol=1e-3)
    back = bridge.port(ported, fresh)
    assert jnp.allclose(run_source(back), want, atol=1e-6)
    if "equinox" not in (outer, other):  # (compare vmaps an Equinox model)
        assert bridge.compare(source, ported, inputs("mlp")[0]) < 1e-6


@requires("NNX", "eqx.nn.BatchNorm(mode=...)")
def test_port_batch_statistics_through_a_wrapper_in_linen():
    # an Equinox CNN with BatchNorm inside Linen, its statistics moved by a training
    # call, ported to the same model in NNX: evaluation outputs equal
    x, _ = inputs("cnn")
    cnn, state = eqx.nn.make_with_state(EquinoxCNN)(jax.random.key(0), mode="ema")
    inner = (EquinoxBatchCNN(cnn), state)
    module = LinenOuter(bridge.as_linen(inner))
    variables = module.init(jax.random.key(1), x)
    _, updates = module.apply(variables, x, mutable=["batch_stats"])
    variables = {**variables, **updates}
    target = NNXOuter(NNXCNN(nnx.Rngs(5)), nnx.Rngs(6))
    ported = bridge.port((module, variables), target)
    evaluation = LinenOuter(bridge.as_linen(inner, inference=True))
    ported.eval()
    want = evaluation.apply(variables, x)
    np.testing.assert_allclose(ported(x), want, rtol=1e-5, atol=1e-6)
    mean = variables["batch_stats"]["enc"]["cnn"]["bn"]["ema_state_index"][0]
    assert not jnp.array_equal(mean, state.get(cnn.bn.ema_state_index)[0])
    np.testing.assert_array_equal(ported.enc.bn.mean[...], mean)


class SetupOuter(nn.Module):
    """A wrapper made in `setup`, inside a module given as a field."""

    def setup(self):
        self.enc = bridge.as_linen(native("equinox", "mlp"))
        self.head = nn.Dense(HEAD_OUT)

    def __call__(self, x):
        return self.head(self.enc(x))


class Holder(nn.Module):
    body: nn.Module

    def __call__(self, x):
        return self.body(x)


class CompactOuter(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(HEAD_OUT)(bridge.as_linen(native("equinox", "mlp"))(x))


@requires("NNX")
def test_port_finds_linen_wrappers_in_setup_at_depth_not_in_compact_calls():
    x, _ = inputs("mlp")
    target = NNXOuter(NNXMLP(nnx.Rngs(3)), nnx.Rngs(4))
    model = Holder(SetupOuter())
    variables = model.init(jax.random.key(0), x)
    ported = bridge.port((model, variables), target)
    np.testing.assert_allclose(ported(x), model.apply(variables, x), atol=1e-6)
    compact = CompactOuter()
    with pytest.raises(
        bridge.PortError,
        match=r"(?s)the source's arrays .*\.layers\[0\]\.weight.* are in no layer.*"
        r"declare the wrapper as a field of its parent or in `setup`",
    ):
        bridge.port((compact, compact.init(jax.random.key(0), x)), target)


@requires("NNX")
@pytest.mark.parametrize("outer", ["nnx", "linen", "equinox"])
def test_port_into_an_abstract_model_holding_a_wrapper(outer):
    # targets made with eval_shape (no memory) hold wrappers too
    source, run_source = all_in("linen", seed=0)
    inner = "nnx" if outer == "equinox" else "equinox"
    x, _ = inputs("mlp")
    if outer == "nnx":
        make = lambda: mixed(outer, inner, seed=5)[0]  # noqa: E731
        ported = bridge.port(source, nnx.eval_shape(make))
        got = ported(x)
    elif outer == "equinox":
        make = lambda: mixed(outer, inner, seed=5)[0]  # noqa: E731
        ported = bridge.port(source, eqx.filter_eval_shape(make))
        got = ported(x)
    else:
        module = LinenOuter(bridge.as_linen(native(inner, "mlp", 5)))
        abstract = jax.eval_shape(module.init, jax.random.key(0), x)
        _, variables = bridge.port(source, (module, abstract))
        got = module.apply(variables, x)
    np.testing.assert_allclose(got, run_source(source), atol=1e-6)


class SetupForInitOnly(nn.Module):
    """A `setup` that fails outside `init` (looking for wrappers runs it)."""

    def setup(self):
        if not self.is_initializing():
            raise RuntimeError("this setup runs in init only")
        self.dense = nn.Dense(HEAD_OUT)

    def __call__(self, x):
        return self.dense(x)


@requires("NNX")
def test_looking_for_linen_wrappers_never_breaks_a_port():
    x, _ = inputs("mlp")
    module = SetupForInitOnly()
    variables = module.init(jax.random.key(0), x)
    target = nnx.Linear(x.shape[1], HEAD_OUT, rngs=nnx.Rngs(1))
    ported = bridge.port((module, variables), target)
    np.testing.assert_array_equal(
        ported.kernel[...], variables["params"]["dense"]["kernel"]
    )


SETUPS = []


class WrappingBlock(nn.Module):
    """A residual block whose `setup` makes a wrapper (a stack's block)."""

    seed: int = 0

    def setup(self):
        SETUPS.append(self.name)
        self.enc = bridge.as_linen(native("equinox", "mlp", self.seed))
        self.proj = nn.Dense(D_IN)

    def __call__(self, x):
        return x + self.proj(self.enc(x))


class WrappingStack(nn.Module):
    def setup(self):
        # three alike, one of other settings: a walk of its own
        self.blocks = [WrappingBlock(seed=1 if i == 3 else 0) for i in range(4)]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.enc = NNXMLP(rngs)
        self.proj = nnx.Linear(D_OUT, D_IN, rngs=rngs)

    def __call__(self, x):
        return x + self.proj(self.enc(x))


class NNXStack(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([NNXBlock(rngs) for _ in range(4)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@requires("NNX")
def test_linen_wrappers_in_every_block_of_a_stack_each_setup_walked_once():
    """Looking for wrappers walks a block's `setup` once for all the blocks alike
    (a 64-layer Llama: 9 ms a layer), and finds each block's wrapper."""
    x, _ = inputs("mlp")
    model = WrappingStack()
    variables = model.init(jax.random.key(0), x)
    variables = jax.tree.map(lambda v: v + 0.01, variables)  # not the wrappers' own
    SETUPS.clear()
    found = dict(linen_wrappers(bridge.from_linen(variables, model)))
    assert sorted(found) == [(f"blocks_{i}", "enc") for i in range(4)]
    assert SETUPS == ["blocks_0", "blocks_3"], SETUPS
    ported = bridge.port((model, variables), NNXStack(nnx.Rngs(2)))
    np.testing.assert_allclose(ported(x), model.apply(variables, x), atol=1e-6)
