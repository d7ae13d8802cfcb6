"""`bridge.port_opt_state(opt_state, source, target)` without `like`: the state
comes in the target framework's usual form, built from the source state's
structure (`tx.init(params)` for Linen, `tx.init(eqx.filter(model, eqx.is_array))`
for Equinox, `nnx.Optimizer(model, tx, wrt=nnx.Param)` for NNX when the optax
optimizer is known). The oracle is each framework's own loop, as in
test_opt_state.py: K steps in A, N more in B from the ported state, equal to K + N
steps in A."""

import jax
import pytest
from flax import nnx

import bridge
from bridge._adapters._nnx import as_pure

from .helpers import tree_allclose
from .test_opt_state import OPTIMIZERS, RUNS, K, N, copied, train


FRAMEWORKS = ["linen", "nnx", "equinox"]
FAST = [("nnx", "equinox"), ("equinox", "nnx"), ("linen", "nnx"), ("nnx", "linen")]
PAIRS = [(a, b) for a in FRAMEWORKS for b in FRAMEWORKS if a != b]


def _state(opt):
    return opt.opt_state if isinstance(opt, nnx.Optimizer) else opt


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "a,b", [p if p in FAST else pytest.param(*p, marks=pytest.mark.slow) for p in PAIRS]
)
def test_without_like_is_the_targets_usual_state(a, b, optimizer):
    tx = OPTIMIZERS[optimizer]()
    ra, rb = RUNS[a], RUNS[b]
    model = ra.model(0)
    model, opt = train(ra, model, ra.init(model, tx), tx, 0, K)
    target = copied(bridge.port(model, rb.model(1)))
    # tx: the NNX way is an nnx.Optimizer, which holds it (an nnx.Optimizer source
    # gives its own)
    given = None if a == "nnx" else tx
    ported = bridge.port_opt_state(opt, model, target, tx=given)
    usual = rb.init(target, tx)
    assert type(ported) is type(usual)
    assert jax.tree.structure(_state(ported)) == jax.tree.structure(_state(usual))
    model_b, _ = train(rb, target, ported, tx, K, N)
    model_a, _ = train(ra, model, opt, tx, K, N)
    reference = bridge.to_neutral(model_a)
    assert tree_allclose(
        reference, bridge.port(model_b, reference), rtol=1e-5, atol=1e-6
    )


def test_without_tx_an_nnx_target_gets_the_bare_state():
    """No optax optimizer known (a bare source state, no `tx`): the state NNX's
    functional loop updates, `tx.init(nnx.state(model, nnx.Param))`."""
    tx = OPTIMIZERS["adam"]()
    model = RUNS["equinox"].model(0)
    model, opt = train(
        RUNS["equinox"], model, RUNS["equinox"].init(model, tx), tx, 0, 1
    )
    target = bridge.port(model, RUNS["nnx"].model(1))
    ported = bridge.port_opt_state(opt, model, target)
    usual = tx.init(nnx.state(target, nnx.Param))
    assert jax.tree.structure(ported) == jax.tree.structure(as_pure(usual))
    assert int(ported[0].count) == 1
