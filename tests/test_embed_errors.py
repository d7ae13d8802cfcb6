"""The wrappers' errors: each names the problem and the fix; the guide runs."""

from pathlib import Path

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .embed_models import inputs, native
from .helpers import requires, run_markdown


@pytest.mark.parametrize("wrap", [bridge.as_nnx, bridge.as_linen, bridge.as_equinox])
def test_not_a_model(wrap):
    with pytest.raises(
        TypeError, match=r"wraps `model`, a model of another framework, but got a int"
    ):
        wrap(3)
    with pytest.raises(TypeError, match=r"got a tuple of str, int"):
        wrap(("a", 1))


@pytest.mark.parametrize("wrap", [bridge.as_nnx, bridge.as_equinox])
def test_linen_module_without_variables(wrap):
    with pytest.raises(
        TypeError, match=r"(?s)without variables.*module\.init\(jax\.random\.key\(0\)"
    ):
        wrap(nn.Dense(3))
    module, variables = native("linen", "mlp")
    with pytest.raises(TypeError, match=r"variables without their module"):
        wrap(variables)


@requires("NNX")
def test_same_framework():
    with pytest.raises(TypeError, match=r"already a model of that framework"):
        bridge.as_nnx(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"Flax Linen model, which is already"):
        bridge.as_linen(native("linen", "mlp"))
    with pytest.raises(TypeError, match=r"Equinox model, which is already"):
        bridge.as_equinox(native("equinox", "mlp"))


@requires("NNX")
def test_missing_mutable_collection_or_state():
    x, _ = inputs("cnn")
    layer = bridge.as_linen(native("nnx", "cnn"))
    variables = layer.init(jax.random.key(0), x)
    with pytest.raises(
        ValueError, match=r"(?s)\['batch_stats'\].*mutable=\['batch_stats'\]"
    ):
        layer.apply(variables, x)
    wrapper = bridge.as_equinox(native("nnx", "cnn"))
    with pytest.raises(
        TypeError, match=r"(?s)has state \(batch_stats\).*wrapper\(\*args, state\)"
    ):
        wrapper(x)


def test_an_equinox_wrapper_called_with_another_model_s_state():
    """Was a raw `KeyError: <object object at 0x...>` from `eqx.nn.State.get`."""
    x, _ = inputs("cnn")
    wrapper = bridge.as_equinox(native("nnx", "cnn"))
    other = eqx.nn.State(bridge.as_equinox(native("nnx", "cnn")))
    _, foreign = eqx.nn.make_with_state(eqx.nn.BatchNorm)(2, "batch")
    for state in (other, foreign):
        with pytest.raises(
            ValueError,
            match=r"(?s)The `eqx.nn.State` given to this wrapper holds no entry for "
            r"\.model\.\S+, .* state arrays \(its batch_stats\): it was made for "
            r"another model\..*eqx\.nn\.State\(model\)",
        ):
            wrapper(x, state)
    y, _ = wrapper(x, eqx.nn.State(wrapper))  # its own state: runs
    assert y.shape[0] == x.shape[0]


@requires("NNX")
def test_name_collision_in_nnx_wrapper():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x * self.param("rngs", nn.initializers.ones, (1,))

    variables = Model().init(jax.random.key(0), jnp.ones(1))
    with pytest.raises(ValueError, match=r"top-level entry named 'rngs'"):
        bridge.as_nnx((Model(), variables))


@requires("NNX")
def test_an_equinox_model_called_on_a_batch_is_told_to_map_over_it():
    wrapper = bridge.as_nnx(eqx.nn.MLP(2, 3, 4, 1, key=jax.random.key(0)))
    with pytest.raises(TypeError, match="dot_general") as error:
        wrapper(jnp.ones((5, 2)))
    notes = "\n".join(error.value.__notes__)
    assert "The wrapped Equinox model failed on arguments of shapes [(5, 2)]" in notes
    assert "jax.vmap(self.model)(x)" in notes
    assert wrapper(jnp.ones(2)).shape == (3,)  # one example is what it takes


@requires("NNX")
def test_a_batched_linen_model_gets_no_equinox_hint():
    module = nn.Dense(3)
    variables = module.init(jax.random.key(0), jnp.ones((1, 2)))
    wrapper = bridge.as_nnx((module, variables))
    with pytest.raises(Exception, match="shape") as error:  # Flax's own error
        wrapper(jnp.ones((5, 4)))
    assert "The wrapped" not in "".join(getattr(error.value, "__notes__", []))


@requires("NNX")
@pytest.mark.slow
def test_mixing_guide_runs():
    code = run_markdown(Path(__file__).parent.parent / "docs/guides/mixing.md")
    assert all(f"bridge.as_{fw}(" in code for fw in ("nnx", "linen", "equinox"))


def test_a_model_bridge_cannot_run_is_refused():
    state_dict = {"layer.weight": np.ones((2, 3), np.float32)}
    with pytest.raises(
        TypeError, match=r"(?s)cannot run a PyTorch-layout model.*bridge\.port\("
    ):
        bridge.as_nnx(state_dict)


def test_an_equinox_model_with_state_must_return_it():
    class Counter(eqx.Module):
        index: eqx.nn.StateIndex

        def __init__(self):
            self.index = eqx.nn.StateIndex(jnp.zeros(()))

        def __call__(self, x, state):
            return x + state.get(self.index)  # forgets to return the state

    model, state = eqx.nn.make_with_state(Counter)()
    wrapper = bridge.as_linen((model, state))
    with pytest.raises(
        TypeError,
        match=r"(?s)must return `\(output, new_state\)`, but it returned.a ArrayImpl",
    ):
        wrapper.init(jax.random.key(0), jnp.ones(2))
