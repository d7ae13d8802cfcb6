"""The cache of codec shapes (issue 28): one trace per codec function, shapes,
settings and JAX flags; refusals cached as refusals; bounded; behaviour unchanged."""

import contextlib
import gc
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bridge._port import _shapes
from bridge._port._codec import Codec


def _codec(traces: list):
    def decode(leaves, hyper):
        traces.append(hyper)
        if hyper.get("refuse"):
            raise ValueError(f"refused {leaves['w'].shape}")
        if "heads" not in hyper and hyper.get("need"):
            raise KeyError("heads")
        return {"kernel": leaves["w"].T * hyper.get("scale", 1)}

    def encode(canonical, like, hyper):
        traces.append(hyper)
        return {"w": canonical["kernel"].T.astype(like["w"].dtype)}

    return Codec("Dense", "test", lambda cls, leaves: True, decode, encode)


@pytest.fixture(autouse=True)
def _empty():
    _shapes.clear()
    yield
    _shapes.clear()


def test_one_trace_per_function_shapes_settings():
    traces: list = []
    codec = _codec(traces)
    w = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    first = _shapes.decoded(codec, {"w": w}, {})
    again = _shapes.decoded(codec, {"w": np.zeros((2, 3), np.float32)}, {})
    assert len(traces) == 1
    assert first == again == {"kernel": jax.ShapeDtypeStruct((3, 2), jnp.float32)}
    # every part of the key traces again: shape, dtype, name, settings (typed)
    _shapes.decoded(codec, {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)}, {})
    _shapes.decoded(codec, {"w": jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)}, {})
    assert len(traces) == 3
    one = _shapes.decoded(codec, {"w": w}, {"scale": 1})
    half = _shapes.decoded(codec, {"w": w}, {"scale": 0.5})
    true = _shapes.decoded(codec, {"w": w}, {"scale": True})
    assert len(traces) == 6
    assert one["kernel"].dtype == true["kernel"].dtype == jnp.float32
    assert half["kernel"].dtype == jnp.float32
    # another codec with the same functions shares the entry; other functions do not
    _shapes.decoded(codec._replace(layout="x"), {"w": w}, {})
    assert len(traces) == 6
    _shapes.decoded(_codec(traces), {"w": w}, {})
    assert len(traces) == 7


def test_results_are_fresh_containers():
    codec = _codec([])
    w = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    first = _shapes.decoded(codec, w, {})
    first["kernel"] = None
    assert _shapes.decoded(codec, w, {})["kernel"].shape == (3, 2)


def _enable_x64():
    """`jax.enable_x64(True)`, or `jax.experimental.enable_x64()` where jax has no
    `jax.enable_x64` (jax 0.6)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64

    return enable_x64()


def test_x64_flag_is_part_of_the_key():
    traces: list = []
    codec = _codec(traces)
    w = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    narrow = _shapes.decoded(codec, w, {"scale": 2.0})
    with _enable_x64():
        _shapes.decoded(codec, w, {"scale": 2.0})
    assert len(traces) == 2
    assert narrow["kernel"].dtype == jnp.float32


def test_refusals_are_cached_and_hold_no_frames():
    traces: list = []
    codec = _codec(traces)
    w = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}

    class Big:
        pass

    def caller(refs: list) -> None:
        big = Big()  # a caller's local: a cached traceback would hold it
        refs.append(weakref.ref(big))
        _shapes.decoded(codec, w, {"refuse": True})

    refs: list = []
    for _ in range(2):
        with pytest.raises(ValueError, match=r"refused \(2, 3\)"):
            caller(refs)
    assert len(traces) == 1
    gc.collect()
    assert [ref() for ref in refs] == [None, None]
    with pytest.raises(KeyError) as error:
        _shapes.decoded(codec, w, {"need": True})
    assert error.value.args == ("heads",)
    with pytest.raises(KeyError):
        _shapes.decoded(codec, w, {"need": True})
    assert len(traces) == 2


def test_unhashable_settings_are_traced_each_time():
    traces: list = []
    codec = _codec(traces)
    w = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    for _ in range(2):
        assert _shapes.decoded(codec, w, {"table": [1, 2]})["kernel"].shape == (3, 2)
    assert len(traces) == 2


def test_encode_and_bound(monkeypatch):
    traces: list = []
    codec = _codec(traces)
    monkeypatch.setattr(_shapes, "SIZE", 2)
    kernel = {"kernel": jax.ShapeDtypeStruct((3, 2), jnp.float32)}
    like = {"w": jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)}
    made = _shapes.encoded(codec, kernel, like, {})
    assert made == {"w": jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)}
    _shapes.encoded(codec, kernel, like, {})
    assert len(traces) == 1
    for n in (4, 5, 6):
        _shapes.decoded(codec, {"w": jax.ShapeDtypeStruct((n, 3), jnp.float32)}, {})
    assert len(_shapes._cache) == 2
    _shapes.encoded(codec, kernel, like, {})  # left the cache: traced again
    assert len(traces) == 5


def test_flax_layout_codecs_give_a_traces_shapes_without_one():
    """`same` and `same_as_like` (Flax's own layout) are not traced: their shapes
    are the input's, with the dtypes a trace gives (64-bit ones narrowed without
    x64), and nothing enters the cache."""
    from bridge._port._codec import same, same_as_like

    codec = Codec("Dense", "test", lambda cls, leaves: True, same, same_as_like)
    key = jax.eval_shape(lambda: jax.random.key(0))
    leaves = {
        "kernel": jax.ShapeDtypeStruct((2, 3), jnp.float64),
        "count": np.zeros((4,), np.int64),
        "scale": jax.ShapeDtypeStruct((3,), jnp.bfloat16),
        "key": key,
    }
    like = {"scale": leaves["scale"], "kernel": leaves["kernel"]}

    for wide in (False, True):
        with _enable_x64() if wide else _narrowed():
            decoded = _shapes.decoded(codec, leaves, {})
            traced = jax.eval_shape(lambda x: same(x, {}), leaves)
            assert decoded == traced and list(decoded) == list(traced)
            assert (decoded["kernel"].dtype == jnp.float64) is wide
            encoded = _shapes.encoded(codec, leaves, like, {})
            traced = jax.eval_shape(lambda c, k: same_as_like(c, k, {}), leaves, like)
            assert encoded == traced and list(encoded) == list(traced)
    assert len(_shapes._cache) == 0


@contextlib.contextmanager
def _narrowed():
    """Without x64 a trace narrows 64-bit dtypes; JAX 0.12 warns as it does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Explicitly requested dtype", UserWarning)
        yield
