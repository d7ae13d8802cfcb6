"""`bridge.port_opt_state`: resume training in another framework with the moments.

The oracle is each framework's own training loop (Linen `tx.update` over the params
dict, `nnx.Optimizer`, Equinox `eqx.filter` + `tx.update`) and `bridge.make_step`:
train k steps in A, carry the model and the optimizer state to B, train n more;
the result equals k + n steps in A.
"""

import functools
import re
from dataclasses import dataclass
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from flax.training import train_state

import bridge
from bridge._adapters._nnx import as_pure

from .helpers import tree_allclose, tree_equal_bits
from .models import (
    D_IN,
    D_OUT,
    equinox_block,
    equinox_cnn,
    equinox_mlp,
    linen_block,
    linen_cnn,
    linen_mlp,
    nnx_block,
    nnx_cnn,
    nnx_mlp,
)


K, N = 3, 2


def batch(i):
    x = jax.random.normal(jax.random.fold_in(jax.random.key(7), i), (4, D_IN))
    return x, jnp.tanh(x[:, :D_OUT] * 2.0)


def frozen_first(params):
    """multi_transform labels for any form of the parameters: the first layer frozen."""

    def label(path, _):
        first = re.search(r"Dense_0|layers'?\]?\[0\]", jax.tree_util.keystr(path))
        return "frozen" if first else "train"

    return jax.tree_util.tree_map_with_path(label, params)


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "freeze": lambda: optax.multi_transform(
        {
            "train": optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
            "frozen": optax.set_to_zero(),
        },
        frozen_first,
    ),
}


def mse(pred, y):
    return jnp.mean((pred - y) ** 2)


# --- one training loop per framework --------------------------------------------------


@dataclass
class Run:
    """A framework's own loop: `model(seed)`, `init(model, tx) -> opt`,
    `step(model, opt, tx, x, y) -> (model, opt)`, and `opt_state(opt)` (the state or
    container `port_opt_state` takes)."""

    model: Any
    init: Any
    step: Any


_JITS: dict = {}


def _compiled(kind, tx, make):
    """One compiled step per framework and optimizer (held with the optimizer, so
    its id stays its own)."""
    if (kind, id(tx)) not in _JITS:
        _JITS[kind, id(tx)] = tx, make(tx)
    return _JITS[kind, id(tx)][1]


def _linen_jit(tx):
    @functools.partial(jax.jit, static_argnums=0)  # jax.jit(...) decorates from 0.7
    def run(module, params, opt, x, y):
        grads = jax.grad(lambda p: mse(module.apply({"params": p}, x), y))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    return run


def _linen_step(model, opt, tx, x, y):
    module, variables = model
    params, opt = _compiled("linen", tx, _linen_jit)(
        module, variables["params"], opt, x, y
    )
    return (module, {"params": params}), opt


def _nnx_jit(tx):
    @nnx.jit
    def run(model, opt, x, y):
        grads = nnx.grad(lambda m: mse(m(x), y))(model)
        opt.update(model, grads)

    return run


def _nnx_step(model, opt, tx, x, y):
    _compiled("nnx", tx, _nnx_jit)(model, opt, x, y)
    return model, opt


def _equinox_jit(tx):
    @eqx.filter_jit
    def run(model, opt, x, y):
        grads = eqx.filter_grad(lambda m: mse(jax.vmap(m)(x), y))(model)
        updates, opt = tx.update(grads, opt, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt

    return run


def _equinox_step(model, opt, tx, x, y):
    return _compiled("equinox", tx, _equinox_jit)(model, opt, x, y)


def _nnx_state_jit(tx):
    @nnx.jit
    def run(model, opt, x, y):
        params = nnx.state(model, nnx.Param)
        grads = nnx.grad(lambda m: mse(m(x), y))(model)
        updates, opt = tx.update(grads, opt, params)
        nnx.update(model, optax.apply_updates(params, updates))
        return opt

    return run


def _nnx_state_step(model, opt, tx, x, y):
    """optax over `nnx.state(model, nnx.Param)` by hand (no `nnx.Optimizer`)."""
    return model, _compiled("nnx_state", tx, _nnx_state_jit)(model, opt, x, y)


def _make_step(tree, tx):
    spec = bridge.trainable(tree, lambda t: t)
    return _compiled(
        "make_step",
        tx,
        lambda tx: bridge.make_step(lambda m, x, y: mse(m(x), y), tx, spec),
    )


def _make_step_step(model, opt, tx, x, y):
    model, opt, _ = _make_step(model, tx)(model, opt, x, y)
    return model, opt


RUNS = {
    "linen": Run(
        linen_mlp,
        lambda m, tx: tx.init(m[1]["params"]),
        _linen_step,
    ),
    "nnx": Run(
        nnx_mlp,
        lambda m, tx: nnx.Optimizer(m, tx, wrt=nnx.Param),
        _nnx_step,
    ),
    "nnx_state": Run(
        nnx_mlp,
        lambda m, tx: tx.init(nnx.state(m, nnx.Param)),
        _nnx_state_step,
    ),
    "equinox": Run(
        equinox_mlp,
        lambda m, tx: tx.init(eqx.filter(m, eqx.is_array)),
        _equinox_step,
    ),
    "make_step": Run(
        lambda seed: bridge.from_nnx(nnx_mlp(seed)),
        lambda m, tx: _make_step(m, tx).init(m),
        _make_step_step,
    ),
}


def train(run, model, opt, tx, start, n):
    for i in range(start, start + n):
        model, opt = run.step(model, opt, tx, *batch(i))
    return model, opt


def copied(model):
    return jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, model)


def resume(a, b, optimizer):
    """`(A for K + N steps, A for K then B for N)`, as Trees."""
    tx = OPTIMIZERS[optimizer]()
    ra, rb = RUNS[a], RUNS[b]
    model = ra.model(0)
    opt = ra.init(model, tx)
    model, opt = train(ra, model, opt, tx, 0, K)
    # B starts from copies: the port shares arrays whose layout is the same, and
    # make_step consumes (donates) what it is given
    target = copied(bridge.port(model, rb.model(1)))
    like = rb.init(target, tx)
    ported = bridge.port_opt_state(opt, model, target, like=like, step=K)
    model_b, _ = train(rb, target, ported, tx, K, N)
    model_a, _ = train(ra, model, opt, tx, K, N)
    reference = bridge.to_neutral(model_a)
    return reference, bridge.port(model_b, reference)


FAST = [("linen", "nnx"), ("nnx", "equinox"), ("equinox", "make_step")]
FAST += [("make_step", "linen"), ("nnx_state", "nnx"), ("nnx", "nnx_state")]
PAIRS = [(a, b) for a in RUNS for b in RUNS]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "a,b", [p if p in FAST else pytest.param(*p, marks=pytest.mark.slow) for p in PAIRS]
)
def test_resume_equals_training_on(a, b, optimizer):
    reference, resumed = resume(a, b, optimizer)
    assert tree_allclose(reference, resumed, rtol=1e-5, atol=1e-6)
    if {a, b} <= {"linen", "nnx", "nnx_state"}:  # the same arithmetic: the same bits
        assert tree_equal_bits(reference, resumed)


def test_moments_follow_the_layout():
    """Adam's moments of a Dense kernel `(in, out)` become those of the Equinox
    weight `(out, in)`; the count is copied."""
    tx = optax.adam(1e-2)
    model = nnx_mlp(0)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    model, opt = train(RUNS["nnx"], model, opt, tx, 0, 2)
    target = bridge.port(model, equinox_mlp(1))
    state = bridge.port_opt_state(
        opt, model, target, like=tx.init(eqx.filter(target, eqx.is_array))
    )
    mu = opt.opt_state[0].mu["layers"][1]["kernel"][...]
    assert state[0].mu.layers[1].weight.shape == mu.T.shape
    assert bool(jnp.all(state[0].mu.layers[1].weight == mu.T))
    assert int(state[0].count) == 2


@pytest.mark.parametrize(
    "make_source,make_target",
    [
        (linen_cnn, equinox_cnn),
        (equinox_cnn, nnx_cnn),
        (linen_block, equinox_block),
        (equinox_block, nnx_block),
    ],
)
def test_moments_move_as_their_parameters(make_source, make_target):
    """A state whose `mu` is the parameters themselves and `nu` their squares:
    ported, it holds exactly the ported parameters and their squares (conv HWIO <->
    OIHW, the conv bias `(O, 1, 1)`, attention heads split <-> fused; BatchNorm's
    statistics are no parameters and hold no moments)."""
    source, target = make_source(0), make_target(1)
    params = _params(source)
    tx = optax.adam(1e-2)
    state = tx.init(params)
    state = (state[0]._replace(mu=params, nu=jax.tree.map(jnp.square, params)),)
    state += tx.init(params)[1:]
    like = tx.init(_params(target))
    new = bridge.port_opt_state(state, source, target, like=like)
    ported = _params(bridge.port(source, target))
    assert tree_equal_bits(new[0].mu, ported)
    assert tree_allclose(new[0].nu, jax.tree.map(jnp.square, ported), atol=0)


def _params(model):
    """What a framework's optimizer is given: Linen's params dict, NNX's Params,
    Equinox's arrays (of the model, not of its state)."""
    if isinstance(model, tuple) and isinstance(model[0], eqx.Module):
        return eqx.filter(model[0], eqx.is_array)
    if isinstance(model, eqx.Module):
        return eqx.filter(model, eqx.is_array)
    if isinstance(model, nnx.Module):
        return as_pure(nnx.state(model, nnx.Param))
    return model[1]["params"]


def test_nothing_is_shared_or_modified():
    tx = optax.adam(1e-2)
    model = nnx_mlp(0)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    model, opt = train(RUNS["nnx"], model, opt, tx, 0, 1)
    tree = bridge.from_nnx(model)
    step = _make_step(tree, tx)
    like = step.init(tree)
    before = jax.tree_util.tree_map(jnp.copy, as_pure(opt.opt_state))
    state = bridge.port_opt_state(opt, model, tree, like=like)
    assert tree_equal_bits(as_pure(opt.opt_state), before)
    ids = {id(x) for x in jax.tree_util.tree_leaves((opt.opt_state, like))}
    assert not ids & {id(x) for x in jax.tree_util.tree_leaves(state)}


# --- inside one framework: switching to make_step keeps the moments -------------------


def test_nnx_optimizer_to_make_step_and_back():
    tx = optax.adam(1e-2)
    model = nnx_mlp(0)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    model, opt = train(RUNS["nnx"], model, opt, tx, 0, K)
    tree = bridge.from_nnx(model)
    state = bridge.port_opt_state(
        opt, model, tree, like=_make_step(tree, tx).init(tree)
    )
    assert jnp.array_equal(
        state[0].nu[".layers[2].kernel"],
        opt.opt_state[0].nu["layers"][2]["kernel"][...],
    )
    back = bridge.port_opt_state(
        state, tree, model, like=nnx.Optimizer(nnx_mlp(1), tx, wrt=nnx.Param), step=K
    )
    assert isinstance(back, nnx.Optimizer) and int(back.step[...]) == K
    assert tree_equal_bits(as_pure(back.opt_state), as_pure(opt.opt_state))


def test_linen_train_state_to_make_step_and_back():
    tx = OPTIMIZERS["freeze"]()
    module, variables = linen_mlp(0)
    ts = train_state.TrainState.create(
        apply_fn=module.apply, params=variables["params"], tx=tx
    )

    @jax.jit
    def native_step(ts, x, y):
        grads = jax.grad(lambda p: mse(ts.apply_fn({"params": p}, x), y))(ts.params)
        return ts.apply_gradients(grads=grads)

    for i in range(K):
        ts = native_step(ts, *batch(i))
    tree = copied(bridge.from_linen({"params": ts.params}, module))
    opt = bridge.port_opt_state(ts, ts, tree, like=_make_step(tree, tx).init(tree))
    tree, opt = train(RUNS["make_step"], tree, opt, tx, K, N)
    fresh = train_state.TrainState.create(
        apply_fn=module.apply, params=variables["params"], tx=tx
    )
    back = bridge.port_opt_state(opt, tree, fresh, step=K + N)
    assert int(back.step) == K + N
    for i in range(K, K + N):
        ts = native_step(ts, *batch(i))
    assert tree_allclose(back.opt_state, ts.opt_state)
    assert tree_allclose(bridge.from_linen({"params": ts.params}, module), tree)


# --- a changed trainable set ----------------------------------------------------------


def test_target_trains_more_layers():
    """The source trained the last layer only; the target trains all: the last
    layer's moments are ported, the others start fresh, with a warning."""
    tx = optax.adam(1e-2)
    tree = bridge.from_nnx(nnx_mlp(0))
    spec = bridge.trainable(tree, lambda t: t.layers[2])
    step = bridge.make_step(lambda m, x, y: mse(m(x), y), tx, spec)
    opt = step.init(tree)
    for i in range(K):
        tree, opt, _ = step(tree, opt, *batch(i))
    target = bridge.port(tree, equinox_mlp(1))
    like = tx.init(eqx.filter(target, eqx.is_array))
    with pytest.warns(
        bridge.PortWarning, match=r"(?s)start fresh.*\.layers\[0\]\.weight"
    ):
        state = bridge.port_opt_state(opt, tree, target, like=like)
    mu = state[0].mu
    assert jnp.array_equal(mu.layers[2].weight, opt[0].mu[".layers[2].kernel"].T)
    assert jnp.array_equal(mu.layers[2].bias, opt[0].mu[".layers[2].bias"])
    assert jnp.any(mu.layers[2].weight != 0)
    assert jnp.array_equal(mu.layers[0].weight, like[0].mu.layers[0].weight)
    assert int(state[0].count) == K


def test_target_trains_fewer_layers():
    tx = optax.adam(1e-2)
    tree = bridge.from_nnx(nnx_mlp(0))
    opt = _make_step(tree, tx).init(tree)
    last = bridge.make_step(
        lambda m, x, y: mse(m(x), y), tx, bridge.trainable(tree, lambda t: t.layers[2])
    )
    like = last.init(tree)
    with pytest.raises(ValueError, match=r"(?s)does not train.*\.layers\[0\]\.kernel"):
        bridge.port_opt_state(opt, tree, tree, like=like)
    state = bridge.port_opt_state(opt, tree, tree, like=like, strict=False)
    assert sorted(state[0].mu) == [".layers[2].bias", ".layers[2].kernel"]


def test_masked_labels_differ():
    """multi_transform with other labels on the target: MaskedNode where the target
    has them, ported moments where both train, fresh where only the target does."""
    source_tx = OPTIMIZERS["freeze"]()
    target_tx = optax.multi_transform(
        {
            "train": optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
            "frozen": optax.set_to_zero(),
        },
        lambda p: jax.tree_util.tree_map(lambda _: "train", p),
    )
    module, variables = linen_mlp(0)
    model = (module, variables)
    opt = source_tx.init(variables["params"])
    model, opt = train(RUNS["linen"], model, opt, source_tx, 0, K)
    target = bridge.port(model, nnx_mlp(1))
    like = nnx.Optimizer(target, target_tx, wrt=nnx.Param)
    with pytest.warns(bridge.PortWarning, match=r"'layers'\]\['0'\]|layers\[0\]"):
        new = bridge.port_opt_state(opt, model, target, like=like, step=K)
    inner = as_pure(new.opt_state).inner_states["train"].inner_state[1][0]
    old = opt.inner_states["train"].inner_state[1][0]
    assert jnp.array_equal(inner.mu["layers"][1]["kernel"], old.mu["Dense_1"]["kernel"])
    assert not jnp.any(inner.mu["layers"][0]["kernel"])
    assert int(new.step[...]) == K


# --- errors ---------------------------------------------------------------------------


def test_state_of_another_model():
    tx = optax.adam(1e-2)
    module, variables = linen_mlp(0)
    other = {"params": {"Dense_9": variables["params"]["Dense_0"]}}
    opt = tx.init(other["params"])
    like = tx.init(variables["params"])
    with pytest.raises(ValueError, match=r"(?s)does not match the source.s.*Dense_9"):
        bridge.port_opt_state(opt, variables, variables, like=like)


def test_unsupported_optimizer():
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=2)
    module, variables = linen_mlp(0)
    params = jax.tree_util.tree_map(lambda x: jnp.ones((8, 8)), variables["params"])
    opt = tx.init(params)
    with pytest.raises(ValueError, match=r"(?s)Unsupported.*FactoredState"):
        bridge.port_opt_state(opt, {"params": params}, variables, like=opt)


def test_like_of_another_optimizer():
    module, variables = linen_mlp(0)
    opt = optax.adam(1e-2).init(variables["params"])
    like = optax.sgd(1e-2, momentum=0.9).init(variables["params"])
    with pytest.raises(ValueError, match=r"(?s)differ in structure.*\[0\]\.mu"):
        bridge.port_opt_state(opt, variables, variables, like=like)


def test_step_needed_for_an_optimizer_container():
    tx = optax.adam(1e-2)
    tree = bridge.from_nnx(nnx_mlp(0))
    opt = _make_step(tree, tx).init(tree)
    like = nnx.Optimizer(nnx_mlp(1), tx, wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"step=1000"):
        bridge.port_opt_state(opt, tree, nnx_mlp(1), like=like)
    # without `like`: an nnx.Optimizer at the optax state's count (Adam's)
    started = bridge.port_opt_state(opt, tree, nnx_mlp(1), tx=tx)
    assert int(started.step[...]) == 0
    sgd = optax.sgd(1e-2, 0.9)  # counts nothing
    counted_nothing = _make_step(tree, sgd).init(tree)
    with pytest.raises(ValueError, match=r"step=1000"):
        bridge.port_opt_state(counted_nothing, tree, nnx_mlp(1), tx=sgd)
    started = bridge.port_opt_state(counted_nothing, tree, nnx_mlp(1), tx=sgd, step=3)
    assert int(started.step[...]) == 3
