"""Eight threads at once: `port` and `make_step` never fail and never mix results.

Each thread works on models of its own seed; what it gets must be, bit for bit, what
the same work gives when done alone in the main thread first. (The adapters' own
8-thread test is in tests/test_adapters.py.)
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import bridge

from . import models
from .helpers import fresh, in_threads, requires, tree_equal_bits


SEEDS = range(8)
# one direction per thread (thread k takes DIRECTIONS[k % 3]): the codecs of every
# framework are looked up at once
DIRECTIONS = [
    (models.nnx_block, models.equinox_block),
    (models.linen_block, models.nnx_block),
    (models.equinox_block, models.linen_block),
]


def _port(k: int):
    source, target = DIRECTIONS[k % 3]
    return bridge.to_neutral(bridge.port(source(k), target(99)))


@requires("NNX")
def test_port_from_eight_threads_gives_what_it_gives_alone():
    alone = [_port(k) for k in SEEDS]
    together = in_threads(lambda k: [_port(k) for _ in range(3)])
    for k in SEEDS:
        assert all(tree_equal_bits(t, alone[k]) for t in together[k]), k


def _mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@requires("NNX")
@pytest.mark.parametrize("shared", [True, False], ids=["one step", "a step each"])
def test_make_step_from_eight_threads_gives_what_it_gives_alone(shared):
    x, y = models.mlp_input(), jnp.ones((4, models.D_OUT))
    trees = [bridge.from_nnx(models.nnx_mlp(seed)) for seed in SEEDS]
    spec = bridge.trainable(trees[0], lambda t: t.layers[-1])
    step = bridge.make_step(_mse, optax.adam(1e-2), spec)

    def train(k: int):
        run = step if shared else bridge.make_step(_mse, optax.adam(1e-2), spec)
        tree = fresh(trees[k])  # the step donates its input: keep trees[k]
        opt_state = run.init(tree)
        for _ in range(3):
            tree, opt_state, loss = run(tree, opt_state, x, y)
        return tree, opt_state, loss

    alone = [train(k) for k in SEEDS]
    assert not tree_equal_bits(alone[0][0], alone[1][0])  # the seeds differ
    together = in_threads(train)
    for k in SEEDS:
        assert tree_equal_bits(together[k], alone[k]), k
    assert jax.tree.structure(together[0][0]) == jax.tree.structure(trees[0])
