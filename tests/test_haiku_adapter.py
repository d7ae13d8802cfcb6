"""The Haiku adapter on Haiku's own models (`hk.nets.ResNet18`, `hk.nets.MLP`):
the Tree reads like the model, the dicts come back exact and unchanged, roles,
errors, and a training step against Haiku's own optax idiom."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import bridge
from bridge._tree import framework, kind

from .haiku_twins import randomised
from .helpers import key_orders, leaf_objects, same_objects, snapshot, tree_equal_bits


hk = pytest.importorskip("haiku")


def resnet(x, is_training):
    return hk.nets.ResNet18(4, resnet_v2=False)(x, is_training)


def _resnet():
    fn = hk.transform_with_state(resnet)
    x = jax.random.normal(jax.random.key(1), (2, 16, 16, 3))
    shapes = jax.eval_shape(lambda x: fn.init(jax.random.key(0), x, True), x)
    params, state = randomised(shapes)
    return fn, params, state, x


def _mlp():
    fn = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([5, 5, 2])(x)))
    x = jax.random.normal(jax.random.key(1), (4, 3))
    return fn, fn.init(jax.random.key(0), x), x


def test_resnet18_reads_like_the_model_with_classes_and_roles():
    fn, params, state, x = _resnet()
    t = bridge.from_haiku(params, state, fn=fn, example=(x, False))
    bn = t.res_net18.block_group_0.block_0.batchnorm_0
    assert kind(bn) is hk.BatchNorm and kind(bn.mean_ema) is hk.ExponentialMovingAverage
    assert kind(t.res_net18.initial_conv) is hk.Conv2D
    roles = bridge.roles(t).res_net18.block_group_0.block_0.batchnorm_0
    assert (roles.scale, roles.offset) == ("params", "params")
    for ema in (roles.mean_ema, roles.var_ema):
        assert (ema.average, ema.hidden, ema.counter) == ("batch_stats",) * 3
    # 182 arrays: 62 params, 120 state (40 averages, 80 hidden and counters)
    assert len(jax.tree_util.tree_leaves(t)) == 182


def test_the_dicts_come_back_exact_in_their_order_and_the_source_untouched():
    fn, params, state, x = _resnet()
    before = snapshot((params, state))
    t = bridge.from_haiku(params, state, fn=fn)
    back_fn, back_params, back_state = bridge.to_native(t)
    assert back_fn is fn
    assert key_orders(back_params) == key_orders(params)
    assert key_orders(back_state) == key_orders(state)
    assert same_objects(
        leaf_objects((back_params, back_state)), leaf_objects((params, state))
    )
    assert back_params is not params and back_params[next(iter(params))] is not next(
        iter(params.values())
    )
    out = fn.apply(back_params, back_state, None, x, False)
    assert tree_equal_bits(out, fn.apply(params, state, None, x, False))
    assert snapshot((params, state)) == before


def test_dicts_alone_come_back_as_dicts():
    fn, params, x = _mlp()
    t = bridge.from_haiku(params)
    assert t.mlp.linear_0.w is params["mlp/~/linear_0"]["w"]
    assert bridge.to_native(t) == params and type(bridge.to_native(t)) is dict
    with pytest.raises(
        TypeError, match="made from the dicts alone: there is no function"
    ):
        bridge.compare(t, (fn, params), x)


def test_the_tree_structure_survives_an_optax_step_that_sorts_the_dicts():
    # `w` before `b` in Haiku's dicts, sorted by jax.tree.map: the same Tree structure
    fn, params, x = _mlp()
    moved = jax.tree.map(lambda p: p + 1, params)
    assert list(moved["mlp/~/linear_0"]) == ["b", "w"]
    a, b = bridge.from_haiku(params, fn=fn), bridge.from_haiku(moved, fn=fn)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    assert list(bridge.to_native(b)[1]["mlp/~/linear_0"]) == ["b", "w"]


def test_to_neutral_takes_the_function_and_its_dicts():
    fn, params, state, x = _resnet()
    assert bridge.to_native(bridge.to_neutral((fn, params, state)))[0] is fn
    mlp, mlp_params, _ = _mlp()
    t = bridge.to_neutral((mlp, mlp_params))
    assert framework(t) == "haiku"
    assert bridge.compare((mlp, mlp_params), t, _mlp()[2]) == 0.0


def test_a_submodule_made_in_a_method_and_one_made_in_init_both_nest():
    def f(x):
        class Net(hk.Module):
            def __init__(self):
                super().__init__(name="net")
                self.first = hk.Linear(3, name="first")

            def __call__(self, x):
                return hk.Linear(2, name="second")(self.first(x))

        return Net()(x)

    fn = hk.without_apply_rng(hk.transform(f))
    params = fn.init(jax.random.key(0), jnp.ones((1, 4)))
    assert set(params) == {"net/~/first", "net/second"}
    t = bridge.from_haiku(params, fn=fn)
    assert t.net.first.w.shape == (4, 3) and t.net.second.w.shape == (3, 2)
    assert set(bridge.to_native(t)[1]) == {"net/~/first", "net/second"}


def test_what_is_not_haiku_is_refused_naming_the_fix():
    fn, params, x = _mlp()
    with pytest.raises(
        TypeError, match=r"(?s)`params` must be Haiku's params dict.*got a list"
    ):
        bridge.from_haiku([1])
    with pytest.raises(
        TypeError, match=r"'mlp/~/linear_0'\['w'\] is a str, not an array"
    ):
        bridge.from_haiku({"mlp/~/linear_0": {"w": "x"}})
    with pytest.raises(TypeError, match="an hk.Transformed or hk.TransformedWithState"):
        bridge.from_haiku(params, fn=lambda x: x)
    with pytest.raises(TypeError, match="whose apply"):
        bridge.from_haiku(params, {}, fn=fn)
    with pytest.raises(TypeError, match="run through the model.s function"):
        bridge.from_haiku(params, example=x)
    clash = {"a/~/b": {"w": jnp.ones(2)}, "a/b": {"v": jnp.ones(2)}}
    with pytest.raises(ValueError, match=r"'a/~/b' and 'a/b' both read as \.a\.b"):
        bridge.from_haiku(clash)
    both = ({"m": {"w": jnp.ones(2)}}, {"m": {"w": jnp.ones(2)}})
    with pytest.raises(ValueError, match=r"\.m\.w is both an array of `params` and"):
        bridge.from_haiku(*both)


def _loss(fn):
    def loss_fn(params, state, x, y):
        out, state = fn.apply(params, state, None, x, True)
        return jnp.mean((out - y) ** 2), state

    return loss_fn


def test_the_step_trains_what_the_spec_marks_as_optax_masked_haiku_does():
    """Oracle: Haiku's own training loop, every parameter differentiated, the frozen
    ones masked out of adam (`optax.multi_transform` with `set_to_zero`), the state
    from `fn.apply` in training mode."""
    fn, params, state, x = _resnet()
    y = jax.random.normal(jax.random.key(2), (2, 4))
    t = bridge.from_haiku(params, state, fn=fn, example=(x, False))
    spec = bridge.trainable(t, r"\.res_net18\.(logits|block_group_3)\..*")
    step = bridge.make_step(_loss(fn), optax.sgd(0.1), spec, donate=False)
    new, _, loss = step(t, step.init(t), x, y)

    trained = lambda name: "logits" in name or "block_group_3" in name  # noqa: E731
    labels = {
        m: {k: "train" if trained(m) else "frozen" for k in d}
        for m, d in params.items()
    }
    tx = optax.multi_transform(
        {"train": optax.sgd(0.1), "frozen": optax.set_to_zero()}, labels
    )
    grad = jax.jit(jax.value_and_grad(_loss(fn), has_aux=True))
    (value, want_state), grads = grad(params, state, x, y)
    updates, _ = tx.update(grads, tx.init(params), params)
    want = optax.apply_updates(params, updates)

    _, got_params, got_state = bridge.to_native(new)
    assert np.allclose(loss, value, rtol=1e-6)
    for module, entries in params.items():
        for name, before in entries.items():
            got = got_params[module][name]
            if trained(module):
                assert np.allclose(got, want[module][name], rtol=1e-5, atol=1e-6)
            else:  # frozen: the very arrays, bit for bit
                assert got is before
    # the batch statistics as Haiku's training pass left them (counters moved)
    assert tree_equal_bits(got_state, want_state)
    assert int(got_state["res_net18/~/initial_batchnorm/~/mean_ema"]["counter"]) == 4


def test_a_loss_that_drops_the_state_is_refused():
    fn, params, state, x = _resnet()
    t = bridge.from_haiku(params, state, fn=fn)
    step = bridge.make_step(
        lambda p, s, x: _loss(fn)(p, s, x, 0.0)[0],
        optax.sgd(0.1),
        bridge.trainable(t, lambda t: t.res_net18.logits),
    )
    with pytest.raises(TypeError, match=r"must return `\(loss, new_state\)`"):
        step(t, step.init(t), x)


def test_a_haiku_model_runs_inside_nnx_and_equinox():
    """`bridge.as_nnx` / `as_equinox` take `(fn, params[, state])` (an
    `hk.Transformed` is run through its `apply`): Haiku's own outputs, gradients
    reach the Haiku arrays, and the BatchNorm state a training call writes comes
    back as Haiku's `apply` returns it."""
    from flax import nnx

    fn, params, x = _mlp()
    wrapped = bridge.as_nnx((fn, params))
    np.testing.assert_array_equal(wrapped(x), fn.apply(params, x))
    grads = nnx.grad(lambda m: m(x).sum())(wrapped)
    assert all(np.abs(g).sum() > 0 for g in jax.tree_util.tree_leaves(grads))
    inner = bridge.as_equinox((fn, params))
    np.testing.assert_array_equal(inner(x), fn.apply(params, x))

    fn, params, state, x = _resnet()
    wrapped = bridge.as_nnx((fn, params, state))
    want, want_state = fn.apply(params, state, None, x, True)
    np.testing.assert_array_equal(wrapped(x, True), want)
    stats = nnx.state(wrapped, nnx.BatchStat)
    bn = stats["res_net18"]["initial_batchnorm"]
    want_bn = "res_net18/~/initial_batchnorm/~/"
    for ema in ("mean_ema", "var_ema"):
        assert jnp.array_equal(
            bn[ema]["average"][...], want_state[want_bn + ema]["average"]
        )
        assert not jnp.array_equal(
            state[want_bn + ema]["average"], want_state[want_bn + ema]["average"]
        )
