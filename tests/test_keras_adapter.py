"""The Keras adapter (JAX backend) on Keras's and KerasHub's own models: the Tree
reads like the variable paths, roles, a new model from `to_native` holding the very
arrays, the refusals, and a training step against Keras's own `fit`."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import bridge
from bridge._tree import kind

from .helpers import same_objects, tree_equal_bits


keras = pytest.importorskip("keras")


@pytest.fixture(autouse=True, scope="module")
def keras_broadcasts():
    """Keras's layers broadcast by rank, which tests/conftest.py makes an error."""
    with jax.numpy_rank_promotion("allow"):
        yield


def values(model) -> list:
    return [v.value for v in model.variables]


def cnn(dropout: float = 0.0):
    keras.utils.set_random_seed(0)
    layers = [
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(4, 3, name="conv"),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.Flatten(),
        keras.layers.Dense(5, activation="relu", name="hidden"),
    ]
    if dropout:
        layers.append(keras.layers.Dropout(dropout, seed=1))
    return keras.Sequential([*layers, keras.layers.Dense(3, name="head")])


def test_the_tree_reads_the_variable_paths_with_classes_and_roles():
    model = cnn(dropout=0.5)
    model.get_layer("hidden").trainable = False
    t = bridge.from_keras(model)
    assert kind(t) is keras.Sequential and kind(t.bn) is keras.layers.BatchNormalization
    assert t.conv.kernel is model.get_layer("conv").kernel.value
    roles = bridge.roles(t)
    assert (roles.bn.gamma, roles.bn.moving_mean, roles.bn.moving_variance) == (
        "params",
        "batch_stats",
        "batch_stats",
    )
    (seed,) = [k for k in t if k.startswith("seed_generator")]
    assert kind(t[seed]) is keras.random.SeedGenerator
    assert roles[seed].seed_generator_state == "rngs"
    # a frozen layer's weights: Keras's non-trainable state, which no step trains
    assert (roles.hidden.kernel, roles.head.kernel) == ("state", "params")


def test_to_native_is_a_new_model_holding_the_very_arrays():
    model = cnn(dropout=0.5)
    x = np.random.default_rng(0).standard_normal((2, 6, 6, 2)).astype("float32")
    before = [np.asarray(v) for v in values(model)]
    t = bridge.from_keras(model)
    new = bridge.to_native(t)
    assert new is not model and type(new) is type(model)
    assert same_objects(values(new), values(model))
    assert all(a is not b for a, b in zip(new.variables, model.variables))
    assert tree_equal_bits(new(x), model(x))
    # writing into the new model leaves the source as it was
    new.get_layer("head").kernel.assign(jnp.zeros((5, 3)))
    assert all(np.array_equal(a, b) for a, b in zip(before, values(model)))


def test_a_kerashub_causal_lm_round_trips_with_its_untied_head():
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=32,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
        tie_word_embeddings=False,
    )
    lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    t = bridge.from_keras(lm)
    assert t.token_embedding.reverse_embeddings.shape == (8, 32)
    assert t.transformer_layer_0.self_attention.query.kernel.shape == (8, 2, 4)
    new = bridge.to_native(t)
    assert type(new) is type(lm) and same_objects(values(new), values(lm))
    ids = np.array([[1, 2, 3, 4]])
    assert bridge.compare(lm, new, ids) == 0.0


def test_a_changed_dtype_or_shape_is_refused_naming_the_leaf():
    t = bridge.from_keras(cnn())
    import equinox as eqx

    t = eqx.tree_at(lambda t: t.head.kernel, t, t.head.kernel.astype(jnp.bfloat16))
    t = eqx.tree_at(lambda t: t.conv.bias, t, jnp.zeros(7))
    with pytest.raises(
        ValueError, match=r"(?s)\.conv\.bias: float32\[7\].*float32\[4\]"
    ):
        bridge.to_native(t)
    with pytest.raises(ValueError, match=r"\.head\.kernel: bfloat16\[5, 3\]"):
        bridge.to_native(t)


def test_a_model_not_built_and_other_objects_are_refused():
    with pytest.raises(ValueError, match="has no variables yet"):
        bridge.from_keras(keras.Sequential([keras.layers.Dense(2)]))
    with pytest.raises(TypeError, match="expects `model`, a Keras model or layer"):
        bridge.from_keras({"a": 1})


def test_another_backend_is_refused_in_one_line():
    code = (
        "import keras, bridge\n"
        "m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
        "try:\n    bridge.from_keras(m)\n"
        "except ValueError as e:\n    print(e)\n"
    )
    env = {**os.environ, "KERAS_BACKEND": "numpy"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "'numpy' backend" in lines[0]
    assert "set KERAS_BACKEND=jax" in lines[0]


def _loss(model, x, y):
    return jnp.mean((model(x, training=True) - y) ** 2)


def test_the_step_trains_as_keras_fit_does_and_leaves_frozen_arrays():
    """Oracle: Keras's own `fit`, one batch, SGD, mean squared error; a frozen layer
    (`trainable = False`) and the batch statistics updated in training mode."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 6, 6, 2)).astype("float32")
    y = rng.standard_normal((4, 3)).astype("float32")
    model = cnn()
    model.get_layer("conv").trainable = False
    t = bridge.from_keras(model)
    spec = bridge.trainable(t, lambda t: t)
    step = bridge.make_step(_loss, optax.sgd(0.1), spec, donate=False)
    new, _, loss = step(t, step.init(t), x, y)

    oracle = cnn()
    for mine, theirs in zip(oracle.variables, model.variables):
        mine.assign(jnp.array(theirs.value))  # fit donates its variables
    oracle.get_layer("conv").trainable = False
    oracle.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = oracle.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert np.allclose(loss, history.history["loss"][0], rtol=1e-5)
    got = bridge.to_native(new)
    for a, b in zip(got.variables, oracle.variables):
        assert np.allclose(a.value, b.value, rtol=1e-5, atol=1e-6), a.path
    # frozen: the very arrays; the batch statistics moved
    assert new.conv.kernel is t.conv.kernel and new.conv.bias is t.conv.bias
    assert not np.allclose(new.bn.moving_mean, t.bn.moving_mean)


def test_each_step_draws_a_new_dropout_mask_from_the_seed_state():
    model = cnn(dropout=0.5)
    t = bridge.from_keras(model)
    (seed,) = [k for k in t if k.startswith("seed_generator")]
    x, y = np.ones((4, 6, 6, 2), "float32"), np.zeros((4, 3), "float32")
    step = bridge.make_step(
        _loss, optax.sgd(0.0), bridge.trainable(t, lambda t: t.head), donate=False
    )
    opt = step.init(t)
    one, opt, first = step(t, opt, x, y)
    two, opt, second = step(one, opt, x, y)
    states = [np.asarray(s[seed].seed_generator_state) for s in (t, one, two)]
    assert len({s.tobytes() for s in states}) == 3
    assert first != second  # another mask, the same weights (learning rate 0)


def test_a_keras_model_runs_inside_nnx_and_equinox():
    """`bridge.as_nnx` / `as_equinox` (the adapter's `embed`): the same outputs, and
    gradients reach the Keras weights."""
    from flax import nnx

    model = cnn()
    x = np.random.default_rng(2).standard_normal((2, 6, 6, 2)).astype("float32")
    want = np.asarray(model(x, training=False))
    wrapped = bridge.as_nnx(model)
    wrapped.eval()
    assert np.abs(np.asarray(wrapped(x)) - want).max() < 1e-6
    grads = nnx.grad(lambda m: m(x).sum())(wrapped)
    assert any(np.abs(g).sum() > 0 for g in jax.tree_util.tree_leaves(grads))
    # a stateless one inside Equinox (with BatchNorm: Equinox's State convention)
    dense = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")])
    features = np.ones((4, 3), "float32")
    inner = bridge.as_equinox(dense)
    assert np.array_equal(np.asarray(inner(features)), np.asarray(dense(features)))
