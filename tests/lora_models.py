"""One small model in Linen, NNX and Equinox (an embedding, a dense layer, a
convolution over the sequence, a bias-free head), with the same layer names as the
PyTorch model of `tests/test_lora_peft.py`, for the LoRA tests."""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from .helpers import missing, skip_unless


VOCAB, WIDTH, OUT, LENGTH = 10, 8, 4, 5


class NNXModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.emb = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.q = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.conv = nnx.Conv(WIDTH, WIDTH, (3,), padding=1, rngs=rngs)
        self.head = nnx.Linear(WIDTH, OUT, use_bias=False, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return self.head(self.conv(jax.nn.relu(self.q(self.emb(ids)))))


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        x = nn.Embed(VOCAB, WIDTH, name="emb")(ids)
        x = jax.nn.relu(nn.Dense(WIDTH, name="q")(x))
        x = nn.Conv(WIDTH, (3,), padding=1, name="conv")(x)
        return nn.Dense(OUT, use_bias=False, name="head")(x)


class EqxModel(eqx.Module):
    emb: eqx.nn.Embedding
    q: eqx.nn.Linear
    conv: eqx.nn.Conv1d
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k = jax.random.split(key, 4)
        self.emb = eqx.nn.Embedding(VOCAB, WIDTH, key=k[0])
        self.q = eqx.nn.Linear(WIDTH, WIDTH, key=k[1])
        self.conv = eqx.nn.Conv1d(WIDTH, WIDTH, 3, padding=1, key=k[2])
        self.head = eqx.nn.Linear(WIDTH, OUT, use_bias=False, key=k[3])

    def __call__(self, ids: jax.Array) -> jax.Array:
        """`ids`: `(batch, length)` -> `(batch, length, OUT)`."""

        def one(row):
            x = jax.vmap(self.emb)(row)
            x = jax.nn.relu(jax.vmap(self.q)(x))
            x = self.conv(x.T).T
            return jax.vmap(self.head)(x)

        return jax.vmap(one)(ids)


class _Models(dict):
    """The models of the frameworks the installed releases have: asking for the NNX
    one under a flax without NNX skips the test."""

    def __missing__(self, framework: str) -> object:
        skip_unless("NNX")
        raise KeyError(framework)


def models() -> dict[str, object]:
    """Each framework's model, as `bridge.lora` takes it."""
    ids = jnp.zeros((1, LENGTH), jnp.int32)
    linen = LinenModel()
    built = _Models(
        linen=(linen, linen.init(jax.random.key(0), ids)),
        equinox=EqxModel(jax.random.key(0)),
    )
    if missing("NNX") is None:
        built["nnx"] = NNXModel(nnx.Rngs(0))
    return built


def run(model: object, ids: jax.Array) -> jax.Array:
    """A model in the form `models()` gives it, run on `ids`."""
    if isinstance(model, tuple):
        module, variables = model
        return module.apply(variables, ids)
    return model(ids)  # pyright: ignore[reportCallIssue]


def nonzero(tree: object) -> object:
    """Adapters as after training: lora_a and lora_b both nonzero."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: (
            x + 0.3 * jax.random.normal(jax.random.key(len(p)), x.shape)
            if "lora" in jax.tree_util.keystr(p)
            else x
        ),
        tree,
    )
