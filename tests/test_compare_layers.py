"""`bridge.compare` layer by layer (issue 52): the result is a float as before, and
when looked at it tells the largest difference of each pair of layers along the
model: the first layer where two ports part. The oracle: a port made wrong at a
known layer (one bias moved by 0.01)."""

import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bridge

from .helpers import requires
from .test_display import _balanced


KEY = jax.random.key


class Four(nnx.Module):
    """Equinox's MLP(2, 1, 8, depth=3) in NNX."""

    def __init__(self, rngs):
        sizes = [(2, 8), (8, 8), (8, 8), (8, 1)]
        self.layers = nnx.List([nnx.Linear(i, o, rngs=rngs) for i, o in sizes])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


@requires("NNX")
def test_the_first_layer_where_two_ports_part():
    source = eqx.nn.MLP(2, 1, 8, 3, key=KEY(0))
    target = bridge.port(source, Four(nnx.Rngs(0)))
    target.layers[2].bias[...] += 0.01  # wrong from the third layer on
    x = jax.random.normal(KEY(1), (4, 2))
    c = bridge.compare(source, target, x)
    assert isinstance(c, float) and 0 < c < 0.1
    assert [(x.a, x.b) for x in c.layers] == [(f".layers[{i}]",) * 2 for i in range(4)]
    differences = [x.difference for x in c.layers]
    assert max(differences[:2]) < 1e-6  # the same up to float rounding
    np.testing.assert_allclose(differences[2], 0.01, rtol=1e-4)
    lines = repr(c).splitlines()
    assert lines[0] == f"Comparison: {float(c):.2e}  # the outputs' largest difference"
    bars = lines[1].removeprefix("  4 layers along a: ")[:4]
    assert bars[2] == "█" and max(bars[:2]) < "▄"  # low until the third layer
    assert lines[2] == "  first above 1e-04: .layers[2] -> .layers[2]  1.00e-02"
    page = c._repr_html_()
    _balanced(page)
    assert "<svg" in page and ".layers[2]" in page


@requires("NNX")
def test_channels_first_and_last_compare_layer_by_layer():
    """An NNX convolution (channel-last) against its Equinox port (channel-first,
    one example at a time): the layouts differ, the values are compared."""
    source = nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0))
    target = bridge.port(source, eqx.nn.Conv2d(3, 4, 3, padding=1, key=KEY(1)))
    x = jax.random.normal(KEY(2), (2, 8, 8, 3))
    c = bridge.compare(source, target, x, channel_first=(False, True))
    assert c.layers[0].difference is not None and c.layers[0].difference < 1e-5


def test_a_comparison_is_a_float():
    """As before: compared, formatted, printed and pickled as a float."""
    layer = eqx.nn.Linear(2, 3, key=KEY(0))
    c = bridge.compare(layer, layer, jnp.ones((4, 2)))
    assert c == 0.0 and c < 1e-6 and f"{c:.1e}" == "0.0e+00" and str(c) == "0.0"
    assert type(pickle.loads(pickle.dumps(c))) is float
    assert c.why == "" and [x.difference for x in c.layers] == [0.0]  # one model
