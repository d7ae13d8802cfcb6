"""One small CNN (3x3 "SAME" convolution with bias, BatchNorm, ReLU, spatial mean,
Dense head) written in each of the six frameworks with its own layers and names:
ported in each of the 30 directions, with no rules and no example inputs (one layer
of each kind: shapes pair them), the outputs equal to the source's; through a
checkpoint file between Haiku and Keras and the others; BatchNorm statistics and
Keras's dropout seed states each checked on their own."""

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .haiku_twins import randomised


hk = pytest.importorskip("haiku")
keras = pytest.importorskip("keras")
torch = pytest.importorskip("torch")

C_IN, C, OUT, EPS, DECAY = 2, 4, 3, 1e-5, 0.9
X = jax.random.normal(jax.random.key(3), (2, 6, 6, C_IN))


@pytest.fixture(autouse=True, scope="module")
def keras_broadcasts():
    """Keras's layers broadcast by rank, which tests/conftest.py makes an error."""
    with jax.numpy_rank_promotion("allow"):
        yield


def _haiku_cnn(x, is_training):
    x = hk.Conv2D(C, 3, name="conv")(x)
    x = hk.BatchNorm(True, True, DECAY, eps=EPS, name="bn")(x, is_training)
    return hk.Linear(OUT, name="head")(jnp.mean(jax.nn.relu(x), axis=(1, 2)))


HAIKU = hk.transform_with_state(_haiku_cnn)


def haiku(seed):
    shapes = jax.eval_shape(lambda: HAIKU.init(jax.random.key(0), X, True))
    return (HAIKU, *randomised(shapes, seed))


def keras_cnn(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input(X.shape[1:]),
            keras.layers.Conv2D(C, 3, padding="same", name="features"),
            keras.layers.BatchNormalization(momentum=DECAY, epsilon=EPS, name="norm"),
            keras.layers.ReLU(),
            keras.layers.Dropout(0.5, seed=seed),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(OUT, name="logits"),
        ]
    )
    randomise_keras(model, seed)
    return model


def randomise_keras(model, seed):
    rng = np.random.default_rng(seed)
    for v in model.variables:
        if v.path.endswith("seed_generator_state"):
            continue
        values = (
            rng.uniform(0.5, 1.5, v.shape)
            if "variance" in v.path
            else 0.3 * rng.standard_normal(v.shape)
        )
        v.assign(values.astype(v.dtype))


class NNXCNN(nnx.Module):
    def __init__(self, rngs):
        self.conv1 = nnx.Conv(C_IN, C, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(C, momentum=DECAY, epsilon=EPS, rngs=rngs)
        self.fc = nnx.Linear(C, OUT, rngs=rngs)

    def __call__(self, x):
        return self.fc(jnp.mean(nnx.relu(self.bn1(self.conv1(x))), axis=(1, 2)))


def nnx_cnn(seed):
    model = NNXCNN(nnx.Rngs(seed))
    state = nnx.state(model)
    nnx.update(model, randomised(jax.tree.map(lambda v: v, state), seed))
    return model


class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(C, (3, 3), name="stem")(x)
        x = nn.BatchNorm(not train, momentum=DECAY, epsilon=EPS, name="stem_norm")(x)
        return nn.Dense(OUT, name="out")(jnp.mean(nn.relu(x), axis=(1, 2)))


def linen_cnn(seed):
    module = LinenCNN()
    shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), X))
    return module, randomised(shapes, seed)


class EqxCNN(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    linear: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(C_IN, C, 3, padding="SAME", key=k1)
        self.norm = eqx.nn.BatchNorm(C, "batch", momentum=DECAY, eps=EPS, mode="ema")
        self.linear = eqx.nn.Linear(C, OUT, key=k2)

    def __call__(self, x, state):
        """`x`: one example, channel last `(H, W, C)` (moved for the conv)."""
        y, state = self.norm(self.conv(jnp.moveaxis(x, -1, 0)), state)
        return self.linear(jnp.mean(jax.nn.relu(y), axis=(1, 2))), state


def equinox_cnn(seed):
    model, state = eqx.nn.make_with_state(EqxCNN)(jax.random.key(seed))
    rng = np.random.default_rng(seed)
    mean, var = rng.standard_normal(C), rng.uniform(0.5, 1.5, C)
    state = state.set(
        model.norm.ema_state_index,
        (jnp.asarray(mean, jnp.float32), jnp.asarray(var, jnp.float32)),
    )
    state = state.set(model.norm.ema_first_time_index, jnp.array(False))
    params, static = eqx.partition(model, eqx.is_array)
    return eqx.combine(randomised(params, seed), static), state


def torch_cnn(seed):
    from torch import nn as tnn

    class CNN(tnn.Module):
        def __init__(self):
            super().__init__()
            self.conv = tnn.Conv2d(C_IN, C, 3, padding="same")
            self.bn = tnn.BatchNorm2d(C, eps=EPS, momentum=1 - DECAY)
            self.classifier = tnn.Linear(C, OUT)

        def forward(self, x):  # channel-last images, as the others take them
            y = torch.relu(self.bn(self.conv(x.permute(0, 3, 1, 2))))
            return self.classifier(y.mean(dim=(2, 3)))

    torch.manual_seed(seed)
    model = CNN().eval()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if p.dtype.is_floating_point:
                p.copy_(
                    torch.rand(p.shape) + 0.5
                    if "var" in name
                    else 0.3 * torch.randn(p.shape)
                )
    return model


MAKE = {
    "haiku": haiku,
    "keras": keras_cnn,
    "nnx": nnx_cnn,
    "linen": linen_cnn,
    "equinox": equinox_cnn,
    "torch": torch_cnn,
}


def run(name, model):
    """The model's output on `X`, evaluation mode, as a numpy array."""
    if name == "haiku":
        fn, params, state = model
        return np.asarray(fn.apply(params, state, None, X, False)[0])
    if name == "keras":
        return np.asarray(model(X, training=False))
    if name == "linen":
        return np.asarray(model[0].apply(model[1], X))
    if name == "nnx":
        evaluated = nnx.clone(model)
        evaluated.eval()
        return np.asarray(evaluated(X))
    if name == "equinox":
        inner = eqx.nn.inference_mode(model[0])
        return np.asarray(jax.vmap(lambda x: inner(x, model[1])[0])(X))
    with torch.no_grad():
        return model(torch.from_numpy(np.array(X))).numpy()


def native(name, target, ported):
    """A port's result as `run` takes it (a state dict goes into the module)."""
    if name == "torch":
        target.load_state_dict(ported, strict=True)
        return target
    return ported


NAMES = list(MAKE)
PAIRS = [(a, b) for a in NAMES for b in NAMES if a != b]


@pytest.mark.parametrize("source, target", PAIRS)
def test_every_direction_between_the_six_frameworks(source, target):
    src, tgt = MAKE[source](1), MAKE[target](2)
    with warnings.catch_warnings():  # paddings written two ways (Keras's "same")
        warnings.simplefilter("ignore", bridge.PortWarning)
        ported = bridge.port(src, tgt)
    got = run(target, native(target, tgt, ported))
    assert np.abs(got - run(source, src)).max() < 1e-5


@pytest.mark.parametrize("other", ["nnx", "equinox", "torch", "linen"])
@pytest.mark.parametrize("framework", ["haiku", "keras"])
def test_through_a_checkpoint_both_ways(framework, other, tmp_path):
    for a, b in ((framework, other), (other, framework)):
        src, tgt = MAKE[a](3), MAKE[b](4)
        path = tmp_path / f"{a}.safetensors"
        bridge.save(path, src)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", bridge.PortWarning)
            loaded = bridge.load(path, like=tgt)
        assert np.abs(run(b, native(b, tgt, loaded)) - run(a, src)).max() < 1e-5


def test_haiku_batch_statistics_are_ported_as_averages_and_train_on():
    """Into Haiku: `average` is the statistic, `hidden` the same, `counter` 2**30,
    so one training step moves the average as Flax's momentum does (a counter of 0
    would replace it by the batch's statistics)."""
    source = nnx_cnn(5)
    ported = bridge.port(source, bridge.from_haiku(*haiku(6)[1:], fn=HAIKU))
    fn, params, state = bridge.to_native(ported)
    mean = np.asarray(source.bn1.mean[...])
    ema = state["bn/~/mean_ema"]
    assert np.array_equal(np.asarray(ema["average"]).reshape(-1), mean)
    assert (
        np.array_equal(ema["hidden"], ema["average"]) and int(ema["counter"]) == 2**30
    )
    # one training pass of each: the same moving averages
    _, after = fn.apply(params, state, None, X, True)
    flax_model = nnx.clone(source)
    flax_model.train()
    flax_model(X)
    got = np.asarray(after["bn/~/mean_ema"]["average"]).reshape(-1)
    assert np.allclose(got, flax_model.bn1.mean[...], rtol=1e-6, atol=1e-6)
    # and back: Haiku's averages are read, its hidden and counter are not
    back = bridge.port((fn, params, after), nnx_cnn(7))
    assert np.allclose(back.bn1.mean[...], got, rtol=0, atol=0)


def test_keras_seed_states_are_carried_never_ported(tmp_path):
    """A dropout's seed state is the model's own random stream: a port keeps the
    target's; a file of the same model restores it (resuming, as NNX's RNG state);
    into another framework it goes nowhere. Its scope is numbered by place
    (`seed_generator_0`), not by Keras's per-process counter."""
    source, target = keras_cnn(8), keras_cnn(9)
    tree = bridge.from_keras(target)
    kept = np.asarray(tree.seed_generator_0.seed_generator_state)
    mine = np.asarray(bridge.from_keras(source).seed_generator_0.seed_generator_state)
    assert not np.array_equal(kept, mine)
    ported = bridge.from_keras(bridge.port(source, target))
    assert np.array_equal(ported.seed_generator_0.seed_generator_state, kept)
    path = tmp_path / "k.safetensors"
    bridge.save(path, source)
    loaded = bridge.from_keras(bridge.load(path, like=target))
    assert np.array_equal(loaded.seed_generator_0.seed_generator_state, mine)
    # the moving statistics are ported, as batch statistics
    assert bridge.roles(loaded).norm.moving_variance == "batch_stats"
    want = source.get_layer("norm").moving_variance.value
    assert np.array_equal(loaded.norm.moving_variance, want)
    into_nnx = bridge.load(path, like=nnx_cnn(10))
    assert np.array_equal(into_nnx.bn1.var[...], want)
