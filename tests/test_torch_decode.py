"""The PyTorch and Equinox codecs change the layout of a host (numpy) weight on the
host: a numpy view, copied once into a JAX array when placed, nothing traced or
compiled per weight (an eager `jnp.transpose` compiles once per distinct shape), and
the same bits as the eager transpose."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

import bridge  # noqa: F401  (registers the codecs)
from bridge._buffers import to_jax
from bridge._port._codec import codec_of

from .helpers import tree_equal_bits


_TRACED: list[str] = []
_COUNTING = [False]


def _listen(name: str, secs: float, **kwargs) -> None:
    if _COUNTING[0] and name == "/jax/core/compile/jaxpr_trace_duration":
        _TRACED.append(name)


monitoring.register_event_duration_secs_listener(_listen)


def _traces(fn, *args):
    """`fn(*args)` and how many JAX programs it traced."""
    _TRACED.clear()
    _COUNTING[0] = True
    try:
        out = jax.block_until_ready(fn(*args))
    finally:
        _COUNTING[0] = False
    return out, len(_TRACED)


def _weights(seed: int, **shapes: tuple[int, ...]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


# odd shapes, used nowhere else: a transpose of them was never compiled before
CASES = [
    ("Dense", "torch", _weights(0, weight=(23, 19), bias=(23,)), {}),
    ("Conv", "torch", _weights(1, weight=(11, 3, 5, 7), bias=(11,)), {}),
    ("ConvTranspose", "torch", _weights(2, weight=(3, 13, 5, 7), bias=(13,)), {}),
    ("Dense", "equinox", _weights(3, weight=(29, 17), bias=(29,)), {}),
    ("Conv", "equinox", _weights(4, weight=(9, 3, 5, 7), bias=(9, 1, 1)), {}),
]


@pytest.mark.parametrize("kind, framework, leaves, hyper", CASES)
def test_a_host_weight_changes_layout_on_the_host(kind, framework, leaves, hyper):
    codec = codec_of(kind, framework)
    assert codec is not None
    decoded, traced = _traces(codec.decode, leaves, hyper)
    assert traced == 0, f"{kind} ({framework}) decode traced {traced} programs"
    # the same bits as the codec computes on JAX arrays (the eager jnp path)
    expected = codec.decode({k: jnp.asarray(v) for k, v in leaves.items()}, hyper)
    assert tree_equal_bits(decoded, expected)
    # and back: encoding host arrays gives the file's arrays again, bit for bit
    host = {k: np.asarray(v) for k, v in decoded.items()}
    encoded, traced = _traces(codec.encode, host, leaves, hyper)
    assert tree_equal_bits(encoded, leaves)
    if framework == "torch":  # (Equinox's conv bias is reshaped by jnp)
        assert traced == 0, f"{kind} ({framework}) encode traced {traced} programs"


def test_a_transposed_host_weight_is_a_view_copied_once_into_jax():
    codec = codec_of("Dense", "torch")
    assert codec is not None
    weight = _weights(5, weight=(4, 3))["weight"]
    kernel = codec.decode({"weight": weight}, {})["kernel"]
    # a view of the weight read (no copy yet): the port copies it once
    assert isinstance(kernel, np.ndarray) and np.shares_memory(kernel, weight)
    placed = to_jax(kernel)
    assert isinstance(placed, jax.Array) and placed.shape == (3, 4)
    assert placed.dtype == jnp.float32 and not placed.weak_type
    expected = weight.T.copy()
    assert np.array_equal(np.asarray(placed), expected)
    weight[...] = 0  # the caller's memory is not the model's
    assert np.array_equal(np.asarray(placed), expected)
