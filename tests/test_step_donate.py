"""Donation: a step consumes the trainable leaves and the optimizer state given."""

import jax
import optax
import pytest

import bridge

from . import models
from .helpers import fresh, tree_equal_bits


TARGET = models.mlp_input()[:, : models.D_OUT]


def mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


def head_step(tree, **kwargs):
    spec = bridge.trainable(tree, lambda t: t.layers[-1])
    return bridge.make_step(mse, optax.adam(1e-2), spec, **kwargs)


def test_donated_step_consumes_trainable_leaves_and_state_only():
    tree = bridge.from_nnx(models.nnx_mlp())
    keep = head_step(tree, donate=False)
    oracle, oracle_state, _ = keep(tree, keep.init(tree), models.mlp_input(), TARGET)

    step = head_step(tree)
    given, state = fresh(tree), step.init(tree)
    new, new_state, _ = step(given, state, models.mlp_input(), TARGET)
    assert given.layers[-1].kernel.is_deleted() and given.layers[-1].bias.is_deleted()
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(state))
    assert new.layers[0].kernel is given.layers[0].kernel  # frozen: reused, alive
    assert not given.layers[0].kernel.is_deleted()
    assert tree_equal_bits(new, oracle)
    assert tree_equal_bits(new_state, oracle_state)
    # and the next step takes what this one returned
    step(new, new_state, models.mlp_input(), TARGET)


def test_donate_false_keeps_the_inputs():
    tree = bridge.from_nnx(models.nnx_mlp())
    step = head_step(tree, donate=False)
    state = step.init(tree)
    first = step(tree, state, models.mlp_input(), TARGET)
    again = step(tree, state, models.mlp_input(), TARGET)
    assert not tree.layers[-1].kernel.is_deleted()
    assert tree_equal_bits(first, again)


def test_a_consumed_tree_or_state_says_to_use_the_returned_one():
    tree = fresh(bridge.from_nnx(models.nnx_mlp()))
    step = head_step(tree)
    state = step.init(tree)
    new, new_state, _ = step(tree, state, models.mlp_input(), TARGET)
    match = r"(?s)This Tree was consumed by a step.*Use the Tree and\s+`opt_state` the"
    with pytest.raises(RuntimeError, match=match):
        step(tree, new_state, models.mlp_input(), TARGET)
    with pytest.raises(
        RuntimeError, match=r"(?s)This `opt_state` was consumed.*donate=F"
    ):
        step(new, state, models.mlp_input(), TARGET)


@pytest.mark.parametrize(
    "xla_says",
    ids=["cpu", "tpu-gpu", "pjrt"],
    argvalues=[
        "Array has been deleted with shape=float32[4,1].",  # CPU
        "INVALID_ARGUMENT: Donation requested for invalid buffer",  # TPU, GPU
        "Invalid buffer passed to Execute() as argument 3: Buffer has been deleted "
        "or donated.",  # PJRT's other wording
    ],
)
def test_a_consumed_state_reads_the_same_whatever_xla_says(monkeypatch, xla_says):
    tree = fresh(bridge.from_nnx(models.nnx_mlp()))
    step = head_step(tree)
    state = step.init(tree)
    new, _, _ = step(tree, state, models.mlp_input(), TARGET)

    def xla_refuses(*args):
        raise RuntimeError(xla_says)

    ((key, layout),) = step._layouts.items()
    monkeypatch.setitem(step._layouts, key, layout._replace(jit=xla_refuses))
    with pytest.raises(RuntimeError, match=r"(?s)This `opt_state` was consumed") as e:
        step(fresh(new), state, models.mlp_input(), TARGET)  # (the layout looked up)
    assert str(e.value.__cause__) == xla_says
