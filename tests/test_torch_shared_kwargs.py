"""example_kwargs given for both sides alike (one dict) that only one model takes:
the other side's pass, which fails with them, runs again on the example inputs alone
and pairs the layers, with a PortWarning (bonsai's Qwen3 `cache` against
transformers' own `cache`: tests/test_public_bonsai.py). With a pair, each side's
arguments are its own: a failure is a problem, as it was."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge


torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch


class TwoLinear(torch.nn.Module):
    """Two same-shape layers, `two` after `one`: only the pass tells them apart. Its
    `cache` is a dict of its own (as transformers' models take a `Cache`)."""

    def __init__(self):
        super().__init__()
        self.one = torch.nn.Linear(4, 4)
        self.two = torch.nn.Linear(4, 4)

    def forward(self, x, cache=None):
        h = torch.tanh(self.one(x))
        if cache is not None:
            cache.update(hidden=h)
        return self.two(h)


class Cached(nnx.Module):
    """The same computation, its layers named and created the other way round, and
    a `cache` argument (a list it appends to) that the PyTorch model does not take."""

    def __init__(self, rngs):
        self.last = nnx.Linear(4, 4, rngs=rngs)
        self.first = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x, cache=None):
        h = jnp.tanh(self.first(x))
        if cache is not None:
            cache.append(h)
        return self.last(h)


def test_a_pass_failing_with_the_other_side_s_kwargs_runs_without_them():
    source, target = TwoLinear(), Cached(nnx.Rngs(0))
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    with pytest.warns(bridge.PortWarning) as caught:
        ported = bridge.port(source, target, example=(x,), example_kwargs={"cache": []})
    (message,) = [str(w.message) for w in caught]
    assert (
        "the source's forward pass failed with the example_kwargs given for both"
        in (message)
    )
    assert (
        "['cache']" in message and "'list' object has no attribute 'update'" in message
    )
    assert "ran on the example inputs alone" in message
    want = source(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(ported(jnp.asarray(x)), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(
        ported.first.kernel[...], source.one.weight.detach().numpy().T
    )


def test_a_pair_of_kwargs_is_each_side_s_own():
    """Given as a pair, the PyTorch model's `cache` is its own: its failure is the
    port's problem, no second run."""
    source, target = TwoLinear(), Cached(nnx.Rngs(0))
    x = np.ones((3, 4), np.float32)
    with pytest.raises(bridge.PortError) as error:
        bridge.port(source, target, example=(x,), example_kwargs=({"cache": []}, {}))
    assert "the source's forward pass on the example inputs failed" in str(error.value)
    assert "'list' object has no attribute 'update'" in str(error.value)


def test_a_pass_that_fails_without_the_kwargs_too_reports_the_first_error():
    class Needs(TwoLinear):  # takes no call without its cache
        def forward(self, x, cache):
            return super().forward(x, cache)

    source, target = Needs(), Cached(nnx.Rngs(0))
    x = np.ones((3, 4), np.float32)
    with pytest.raises(bridge.PortError) as error:
        bridge.port(source, target, example=(x,), example_kwargs={"cache": []})
    text = str(error.value)
    assert "the source's forward pass on the example inputs failed" in text
    assert "'list' object has no attribute 'update'" in text  # the first run's error
    assert "missing 1 required positional argument" not in text
    assert "the example_kwargs given for both sides alike" in text


def test_jax_side_failing_with_a_torch_kwarg_runs_without_it():
    """The other way: the NNX model does not take PyTorch's `attention_mask`."""
    source = Cached(nnx.Rngs(1))
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)

    class Masked(TwoLinear):
        def forward(self, x, attention_mask=None):
            return super().forward(x)

    target = Masked()
    with pytest.warns(bridge.PortWarning, match="the source's forward pass failed"):
        ported = bridge.port(
            source, target, example=(x,), example_kwargs={"attention_mask": None}
        )
    target.load_state_dict(ported, strict=True)
    got = target(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(got, source(jnp.asarray(x)), rtol=1e-5, atol=1e-6)
