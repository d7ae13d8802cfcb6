"""The same tiny architectures written in Linen, NNX and Equinox.

Each `make_*` returns the native model (Linen: `(module, variables)`; Equinox:
`model` or `(model, state)`) and an input batch. Shapes are tiny on purpose.
Flax models take channel-last batches; Equinox models take one example (vmap them).
A factory whose model needs a newer framework API than the installed one skips the
test that calls it (`helpers.skip_unless`), naming the feature.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from .helpers import skip_unless


D_IN, D_HID, D_OUT = 3, 5, 2
VOCAB, SEQ, D_MODEL, HEADS = 11, 4, 8, 2


def mlp_input(batch=4):
    return jax.random.normal(jax.random.key(1), (batch, D_IN))


def cnn_input(batch=2):
    return jax.random.normal(jax.random.key(2), (batch, 6, 6, 2))


def tokens(batch=2):
    return jax.random.randint(jax.random.key(3), (batch, SEQ), 0, VOCAB)


# --- MLP ----------------------------------------------------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jax.nn.relu(nn.Dense(D_HID)(x))
        x = jax.nn.relu(nn.Dense(D_HID)(x))
        return nn.Dense(D_OUT)(x)


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List(
            [
                nnx.Linear(D_IN, D_HID, rngs=rngs),
                nnx.Linear(D_HID, D_HID, rngs=rngs),
                nnx.Linear(D_HID, D_OUT, rngs=rngs),
            ]
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def linen_mlp(seed=0):
    module = LinenMLP()
    return module, module.init(jax.random.key(seed), mlp_input())


def nnx_mlp(seed=0):
    skip_unless("NNX")
    return NNXMLP(nnx.Rngs(seed))


def equinox_mlp(seed=0):
    return eqx.nn.MLP(
        D_IN, D_OUT, D_HID, depth=2, activation=jax.nn.relu, key=jax.random.key(seed)
    )


# --- CNN with BatchNorm --------------------------------------------------------------


class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Conv(4, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = jax.nn.relu(x).mean(axis=(1, 2))
        return nn.Dense(D_OUT)(x)


class NNXCNN(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(2, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)
        self.head = nnx.Linear(4, D_OUT, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.bn(self.conv(x))).mean(axis=(1, 2))
        return self.head(x)


class EquinoxCNN(eqx.Module):
    conv: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key, mode="batch"):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(2, 4, 3, padding="SAME", key=k1)
        self.bn = eqx.nn.BatchNorm(4, "batch", momentum=0.9, mode=mode)
        self.head = eqx.nn.Linear(4, D_OUT, key=k2)

    def __call__(self, x, state):
        """`x`: one example, channel-last `(H, W, C)` like the Flax models."""
        x = self.conv(jnp.transpose(x, (2, 0, 1)))
        x, state = self.bn(x, state)
        return self.head(jax.nn.relu(x).mean(axis=(1, 2))), state


def linen_cnn(seed=0):
    module = LinenCNN()
    return module, module.init(jax.random.key(seed), cnn_input())


def nnx_cnn(seed=0):
    skip_unless("NNX")
    return NNXCNN(nnx.Rngs(seed))


def equinox_cnn(seed=0, mode="batch"):
    skip_unless("eqx.nn.BatchNorm(mode=...)")
    return eqx.nn.make_with_state(EquinoxCNN)(jax.random.key(seed), mode=mode)


# --- transformer block ---------------------------------------------------------------


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, D_MODEL)(ids)
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(h, h)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(D_MODEL)(h)


class NNXBlock(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, D_MODEL, rngs=rngs)
        self.norm1 = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, D_MODEL, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.dense = nnx.Linear(D_MODEL, D_MODEL, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        h = self.norm1(x)
        x = x + self.attn(h)
        return x + self.dense(self.norm2(x))


class EquinoxBlock(eqx.Module):
    embed: eqx.nn.Embedding
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    dense: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, D_MODEL, key=k1)
        self.norm1 = eqx.nn.LayerNorm(D_MODEL, eps=1e-6)
        self.attn = eqx.nn.MultiheadAttention(
            HEADS,
            D_MODEL,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            key=k2,
        )
        self.norm2 = eqx.nn.LayerNorm(D_MODEL, eps=1e-6)
        self.dense = eqx.nn.Linear(D_MODEL, D_MODEL, key=k3)

    def __call__(self, ids):
        """`ids`: one sequence `(SEQ,)`."""
        x = jax.vmap(self.embed)(ids)
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.dense)(jax.vmap(self.norm2)(x))


def linen_block(seed=0):
    module = LinenBlock()
    return module, module.init(jax.random.key(seed), tokens())


def nnx_block(seed=0):
    skip_unless("NNX")
    return NNXBlock(nnx.Rngs(seed))


def equinox_block(seed=0):
    return EquinoxBlock(jax.random.key(seed))
