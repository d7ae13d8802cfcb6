"""Every codec alone, in every direction: after the port the outputs equal the
source's, before they differed."""

import itertools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import bridge

from .helpers import requires


FRAMEWORKS = ("linen", "nnx", "equinox")
KEY = jax.random.key


def _randomize(model, seed):
    """Every float array random (positive, so variances stay valid), integer
    counters 3, flags False: nothing a fresh layer of another seed would match."""
    tree = bridge.to_neutral(model)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(KEY(seed), len(leaves))
    new = []
    for k, leaf in zip(keys, leaves):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            new.append(jax.random.uniform(k, leaf.shape, leaf.dtype, 0.5, 1.5))
        elif leaf.dtype == jnp.bool_:
            new.append(jnp.zeros_like(leaf))
        elif jnp.issubdtype(leaf.dtype, jnp.integer):
            new.append(jnp.full_like(leaf, 3))
        else:
            new.append(leaf)
    tree = jax.tree_util.tree_unflatten(treedef, new)
    if isinstance(model, tuple) and isinstance(model[0], nn.Module):
        return model[0], bridge.to_linen(tree)
    return bridge.to_native(tree)


def _linen(module, x):
    return module, module.init(KEY(0), x)


class SelfAttention(eqx.Module):
    """Equinox attention called like Flax's self-attention: `attn(x)`."""

    attn: eqx.nn.MultiheadAttention

    def __call__(self, x):
        return self.attn(x, x, x)


def _eqx_attention():
    attn = eqx.nn.MultiheadAttention(
        2,
        8,
        use_query_bias=True,
        use_key_bias=True,
        use_value_bias=True,
        use_output_bias=True,
        key=KEY(0),
    )
    return SelfAttention(attn)


def _zero_rms_bias(model):
    return eqx.tree_at(lambda m: m.bias, model, jnp.zeros_like(model.bias))


X2 = jax.random.normal(KEY(9), (4, 5))
IMAGE = jax.random.normal(KEY(9), (2, 5, 5, 4))

# name: (input, channel_first for Equinox, {framework: builder})
CASES = {
    "dense": (
        jax.random.normal(KEY(9), (4, 2)),
        False,
        {
            "linen": lambda x: _linen(nn.Dense(3), x),
            "nnx": lambda x: nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
            "equinox": lambda x: eqx.nn.Linear(2, 3, key=KEY(0)),
        },
    ),
    "dense_no_bias": (
        jax.random.normal(KEY(9), (4, 2)),
        False,
        {
            "linen": lambda x: _linen(nn.Dense(3, use_bias=False), x),
            "nnx": lambda x: nnx.Linear(2, 3, use_bias=False, rngs=nnx.Rngs(0)),
            "equinox": lambda x: eqx.nn.Linear(2, 3, use_bias=False, key=KEY(0)),
        },
    ),
    "conv1d_groups_strides": (
        jax.random.normal(KEY(9), (2, 9, 4)),
        True,
        {
            "linen": lambda x: _linen(
                nn.Conv(6, (3,), strides=2, feature_group_count=2, padding="VALID"), x
            ),
            "nnx": lambda x: nnx.Conv(
                4,
                6,
                (3,),
                strides=2,
                feature_group_count=2,
                padding="VALID",
                rngs=nnx.Rngs(0),
            ),
            "equinox": lambda x: eqx.nn.Conv1d(4, 6, 3, stride=2, groups=2, key=KEY(0)),
        },
    ),
    "conv2d": (
        IMAGE,
        True,
        {
            "linen": lambda x: _linen(nn.Conv(3, (3, 3)), x),
            "nnx": lambda x: nnx.Conv(4, 3, (3, 3), rngs=nnx.Rngs(0)),
            "equinox": lambda x: eqx.nn.Conv2d(4, 3, 3, padding=1, key=KEY(0)),
        },
    ),
    "conv3d": (
        jax.random.normal(KEY(9), (1, 4, 4, 4, 2)),
        True,
        {
            "linen": lambda x: _linen(nn.Conv(3, (2, 2, 2), padding="VALID"), x),
            "nnx": lambda x: nnx.Conv(
                2, 3, (2, 2, 2), padding="VALID", rngs=nnx.Rngs(0)
            ),
            "equinox": lambda x: eqx.nn.Conv3d(2, 3, 2, key=KEY(0)),
        },
    ),
    "conv_transpose": (
        IMAGE,
        True,
        {
            "linen": lambda x: _linen(
                nn.ConvTranspose(3, (3, 3), strides=(2, 2), padding="VALID"), x
            ),
            "nnx": lambda x: nnx.ConvTranspose(
                4, 3, (3, 3), strides=2, padding="VALID", rngs=nnx.Rngs(0)
            ),
            "equinox": lambda x: eqx.nn.ConvTranspose2d(4, 3, 3, stride=2, key=KEY(0)),
        },
    ),
    "embed": (
        jnp.arange(6) % 5,
        False,
        {
            "linen": lambda x: _linen(nn.Embed(5, 4), x),
            "nnx": lambda x: nnx.Embed(5, 4, rngs=nnx.Rngs(0)),
            "equinox": lambda x: eqx.nn.Embedding(5, 4, key=KEY(0)),
        },
    ),
    "layer_norm": (
        X2,
        False,
        {
            "linen": lambda x: _linen(nn.LayerNorm(), x),
            "nnx": lambda x: nnx.LayerNorm(5, rngs=nnx.Rngs(0)),
            "equinox": lambda x: eqx.nn.LayerNorm(5, eps=1e-6),
        },
    ),
    "rms_norm": (
        X2,
        False,
        {
            "linen": lambda x: _linen(nn.RMSNorm(), x),
            "nnx": lambda x: nnx.RMSNorm(5, rngs=nnx.Rngs(0)),
            "equinox": lambda x: eqx.nn.RMSNorm(5, eps=1e-6),
        },
    ),
    "group_norm": (
        IMAGE,
        True,
        {
            "linen": lambda x: _linen(nn.GroupNorm(num_groups=2), x),
            "nnx": lambda x: nnx.GroupNorm(4, num_groups=2, rngs=nnx.Rngs(0)),
            "equinox": lambda x: eqx.nn.GroupNorm(2, 4, eps=1e-6),
        },
    ),
    "batch_norm": (
        X2,
        False,
        {
            "linen": lambda x: _linen(
                nn.BatchNorm(use_running_average=True, momentum=0.9), x
            ),
            "nnx": lambda x: nnx.BatchNorm(5, momentum=0.9, rngs=nnx.Rngs(0)),
            "equinox": lambda x: eqx.nn.make_with_state(eqx.nn.BatchNorm)(
                5, "batch", momentum=0.9, mode="batch"
            ),
        },
    ),
    "batch_norm_ema": (
        X2,
        False,
        {
            "linen": lambda x: _linen(
                nn.BatchNorm(use_running_average=True, momentum=0.9), x
            ),
            "nnx": lambda x: nnx.BatchNorm(5, momentum=0.9, rngs=nnx.Rngs(0)),
            "equinox": lambda x: eqx.nn.make_with_state(eqx.nn.BatchNorm)(
                5, "batch", momentum=0.9, mode="ema"
            ),
        },
    ),
    "attention": (
        jax.random.normal(KEY(9), (2, 3, 8)),
        False,
        {
            "linen": lambda x: _linen(nn.MultiHeadDotProductAttention(num_heads=2), x),
            "nnx": lambda x: nnx.MultiHeadAttention(
                2, 8, decode=False, rngs=nnx.Rngs(0)
            ),
            "equinox": lambda x: _eqx_attention(),
        },
    ),
    "dense_general": (
        jax.random.normal(KEY(9), (2, 4)),
        False,
        {
            "linen": lambda x: _linen(nn.DenseGeneral((2, 3)), x),
            "nnx": lambda x: nnx.LinearGeneral(4, (2, 3), rngs=nnx.Rngs(0)),
        },
    ),
}


def _build(case, framework, seed):
    x, _, builders = CASES[case]
    model = _randomize(builders[framework](x), seed)
    if case == "rms_norm" and framework == "equinox":
        model = _zero_rms_bias(model)  # Flax has no place for a non-zero bias
    return model


# Linen <-> NNX share the layout (identity codecs on both sides): slow tier; the
# six-direction model tests cover that pair in the default run.
def _marks(case: str, a: str, b: str, builders) -> list:
    marks = []
    if {a, b} == {"linen", "nnx"} and "equinox" in builders:
        marks.append(pytest.mark.slow)
    if "nnx" in (a, b):
        marks.append(requires("NNX"))
    if case.startswith("batch_norm") and "equinox" in (a, b):
        marks.append(requires("eqx.nn.BatchNorm(mode=...)"))
    return marks


PARAMS = [
    pytest.param(case, a, b, marks=_marks(case, a, b, builders))
    for case, (_, _, builders) in CASES.items()
    for a, b in itertools.permutations(builders, 2)
]


@pytest.mark.parametrize("case,source_fw,target_fw", PARAMS)
def test_codec(case, source_fw, target_fw):
    x, channel_first, _ = CASES[case]
    flags = (
        channel_first and source_fw == "equinox",
        channel_first and target_fw == "equinox",
    )
    source = _build(case, source_fw, seed=1)
    target = _build(case, target_fw, seed=2)
    assert bridge.compare(source, target, x, channel_first=flags) > 1e-3
    ported = bridge.port(source, target)
    assert bridge.compare(source, ported, x, channel_first=flags) < 1e-5


@requires("eqx.nn.BatchNorm(mode=...)")
def test_equinox_batch_mode_counter_makes_ported_stats_exact():
    """Flax statistics go into State with a counter where 1 - momentum**counter == 1."""
    source = _build("batch_norm", "linen", seed=1)
    bn, state = bridge.port(source, _build("batch_norm", "equinox", seed=2))
    assert int(state.get(bn.batch_counter)) == 2**30
    mean, _ = state.get(bn.batch_state_index)
    assert jnp.array_equal(mean, source[1]["batch_stats"]["mean"])


@requires("NNX")
def test_containers_and_dropout():
    """nn.Sequential, nnx.Sequential and eqx.nn.Sequential, with Dropout (no weights,
    NNX's RNG state is not ported)."""
    x = jax.random.normal(KEY(9), (4, 2))
    # a tuple: the adapter hashes the module, and a list is not hashable
    linen = nn.Sequential(
        (nn.Dense(5), jax.nn.relu, nn.Dropout(0.5, deterministic=True), nn.Dense(2))
    )
    rngs = nnx.Rngs(0)
    models = {
        "linen": (linen, linen.init(KEY(0), x)),
        "nnx": nnx.Sequential(
            nnx.Linear(2, 5, rngs=rngs),
            jax.nn.relu,
            nnx.Dropout(0.5, rngs=rngs),
            nnx.Linear(5, 2, rngs=rngs),
        ),
        "equinox": eqx.nn.Sequential(
            [
                eqx.nn.Linear(2, 5, key=KEY(0)),
                eqx.nn.Lambda(jax.nn.relu),
                eqx.nn.Dropout(0.5),
                eqx.nn.Linear(5, 2, key=KEY(1)),
            ]
        ),
    }
    for a, b in itertools.permutations(FRAMEWORKS, 2):
        source, target = _randomize(models[a], 1), _randomize(models[b], 2)
        assert bridge.compare(source, target, x) > 1e-3
        assert bridge.compare(source, bridge.port(source, target), x) < 1e-5
