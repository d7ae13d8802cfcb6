"""The 4-bit group-scaled TPU kernel (`bridge._kept._int4_kernel`), run in Pallas's
interpreter on this backend: GPTQ, AWQ and compressed-tensors weights give the
dequantizing path's products, forward and input gradient, through `kept_matmul`.
The oracle: the same product with `QuantizedArray.dequantize()`'s dense weight."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bridge._kept._array import QuantizedArray, Scheme
from bridge._kept._matmul import stored_form


pytest.importorskip("jax.experimental.pallas.tpu")
from bridge._kept import _fp8_kernel, _int4_kernel  # noqa: E402


OUT, IN = 128, 256  # two groups of 128 inputs; not square
RNG = np.random.default_rng(0)
GROUPS = (("group_size", 128),)


def words(shape):
    return jnp.asarray(RNG.integers(0, 2**32, shape, dtype=np.uint32).view(np.int32))


def scales(shape, dtype):
    return jnp.asarray(RNG.uniform(1e-3, 1e-2, shape), dtype)


def gptq(scale_dtype=jnp.float16):
    parts = {
        "weight": words((IN // 8, OUT)),
        "zero": words((IN // 128, OUT // 8)),
        "scale": scales((IN // 128, OUT), scale_dtype),
    }
    settings = GROUPS + (("zero_plus_one", True),)
    return QuantizedArray(parts, Scheme("gptq", 4, (OUT, IN), "bfloat16", settings))


def awq(scale_dtype=jnp.float16):
    parts = {
        "weight": words((IN, OUT // 8)),
        "zero": words((IN // 128, OUT // 8)),
        "scale": scales((IN // 128, OUT), scale_dtype),
    }
    return QuantizedArray(parts, Scheme("awq", 4, (OUT, IN), "bfloat16", GROUPS))


def ct(scale_dtype=jnp.bfloat16, zero=None):
    """compressed-tensors' pack-quantized: symmetric, or with zero points `"int8"`
    `(out, groups)` or `"packed"` (int32 words along the rows)."""
    parts = {
        "weight": words((OUT, IN // 8)),
        "scale": scales((OUT, IN // 128), scale_dtype),
    }
    if zero == "int8":
        parts["zero"] = jnp.asarray(RNG.integers(-8, 8, (OUT, IN // 128)), jnp.int8)
    elif zero == "packed":
        parts["zero"] = words((OUT // 8, IN // 128))
    return QuantizedArray(parts, Scheme("int-packed", 4, (OUT, IN), "bfloat16", GROUPS))


KINDS = {
    "gptq": gptq,
    "ct": ct,
    "ct-zero": lambda *a: ct(*a, zero="int8"),
    "ct-packed-zero": lambda *a: ct(*a, zero="packed"),
}


def product(w, x):
    return x @ w.T


def loss(f, q):
    return lambda x: f(q, x).astype(jnp.float32).sum()


def close_in_bf16(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    # a few bfloat16 roundings of the largest value apart, no more
    np.testing.assert_allclose(a, b, rtol=0, atol=4 * 2**-8 * np.abs(b).max())


def compiled_on_a_tpu():
    """The kernel as it runs on a TPU; elsewhere, in Pallas's interpreter. (On a TPU
    the interpreter itself is off for GPTQ's float16 scales: 1.8e-2 where the
    compiled kernel is within 3.4e-3 of a float64 product.)"""
    on_tpu = jax.default_backend() == "tpu"
    return contextlib.nullcontext() if on_tpu else _fp8_kernel.interpreted()


def uses_the_kernel(f, *args):
    return "pallas_call" in str(jax.make_jaxpr(f)(*args))


@pytest.mark.parametrize("batch", [1, 8, 33])
@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_equals_the_dequantizing_path(kind, batch):
    q = KINDS[kind]()
    x = jnp.asarray(RNG.standard_normal((batch, IN)), jnp.bfloat16)
    with compiled_on_a_tpu():
        assert uses_the_kernel(stored_form(product), q, x)
        got = jax.jit(stored_form(product))(q, x)
        got_dx = jax.jit(jax.grad(loss(stored_form(product), q)))(x)
    want = product(q.dequantize(), x)
    assert got.shape == want.shape == (batch, OUT) and got.dtype == jnp.bfloat16
    close_in_bf16(got, want)
    want_dx = jax.grad(loss(product, q.dequantize()))(x)
    assert got_dx.shape == (batch, IN)
    close_in_bf16(got_dx, want_dx)


@pytest.mark.parametrize("unpack", ["nibbles", "pairs"])
@pytest.mark.parametrize("tile", [128, 1536], ids=["tiles-of-128", "one-tile"])
@pytest.mark.parametrize("kind", ["gptq", "ct-zero"])
def test_the_kernel_decodes_every_value_bit_for_bit(kind, tile, unpack, monkeypatch):
    """Products with the identity are the weight itself, both ways: with bfloat16
    scales, `s * (q - z)` rounded once, as `dequantize()` rounds it. Tiles of 128
    sum over several grid steps. Both ways of unpacking the values (one or two an
    operation)."""
    monkeypatch.setattr(_int4_kernel, "_MAX_TILE", tile)
    monkeypatch.setattr(_int4_kernel, "UNPACK", unpack)
    q = KINDS[kind](jnp.bfloat16)
    dense = np.asarray(q.dequantize(), np.float32)
    with compiled_on_a_tpu():
        forward = _int4_kernel.int4_matmul(
            jnp.eye(IN, dtype=jnp.bfloat16), q.parts, q.scheme, "in"
        )
        backward = _int4_kernel.int4_matmul(
            jnp.eye(OUT, dtype=jnp.bfloat16), q.parts, q.scheme, "out"
        )
    assert np.array_equal(np.asarray(forward, np.float32), dense.T)
    assert np.array_equal(np.asarray(backward, np.float32), dense)
    assert len(np.unique(dense)) > 100  # many distinct values, both signs
    assert dense.min() < 0 < dense.max()


@pytest.mark.parametrize("order", ["plain", "activation order"])
def test_a_group_index_runs_the_kernel_only_in_the_plain_order(order):
    """GPTQ's `g_idx`: the plain order (`i // 128`, stored by many checkpoints) is
    the kernel's; any other (`desc_act`) takes the dequantizing path, chosen on the
    device. Either way the products are the dequantizing path's."""
    q = gptq()
    g_idx = np.arange(IN) // 128
    if order != "plain":
        g_idx = RNG.permutation(g_idx)
    q.parts["g_idx"] = jnp.asarray(g_idx, jnp.int32)
    x = jnp.asarray(RNG.standard_normal((8, IN)), jnp.bfloat16)
    with compiled_on_a_tpu():
        got = jax.jit(stored_form(product))(q, x)
        got_dx = jax.jit(jax.grad(loss(stored_form(product), q)))(x)
        kernel = _int4_kernel._kernel_product(
            x, _int4_kernel.kernel_form(q.parts, q.scheme), "in"
        )
    want = product(q.dequantize(), x)
    close_in_bf16(got, want)
    close_in_bf16(got_dx, jax.grad(loss(product, q.dequantize()))(x))
    # the kernel itself ignores the index: right in the plain order only
    error = np.abs(np.asarray(kernel, np.float32) - np.asarray(want, np.float32))
    assert (error.max() <= 4 * 2**-8 * np.abs(want).max()) == (order == "plain")


@pytest.mark.parametrize(
    "why", ["groups of 64", "float32 weight", "8 bits", "out not of 128", "AWQ"]
)
def test_the_kernel_leaves_what_it_cannot_compute_to_xla(why):
    q, dtype = gptq(), jnp.bfloat16
    scheme = q.scheme
    if why == "groups of 64":
        q.parts["scale"] = q.parts["scale"].repeat(2, axis=0)
        q.parts["zero"] = q.parts["zero"].repeat(2, axis=0)
        scheme = scheme._replace(settings=(("group_size", 64), ("zero_plus_one", True)))
    elif why == "float32 weight":  # its products run in float32
        scheme, dtype = scheme._replace(dtype="float32"), jnp.float32
    elif why == "8 bits":
        q.parts["weight"] = words((IN // 4, OUT))
        q.parts["zero"] = words((IN // 128, OUT // 4))
        scheme = scheme._replace(bits=8)
    elif why == "AWQ":  # repacked in every call it measured 86x dense on a v5e
        q = awq()
        scheme = q.scheme
    else:
        q = ct()
        q.parts = {"weight": q.parts["weight"][:64], "scale": q.parts["scale"][:64]}
        scheme = q.scheme._replace(stored=(64, IN))
    q = QuantizedArray(q.parts, scheme)
    x = jnp.asarray(RNG.standard_normal((8, IN)), dtype)
    with compiled_on_a_tpu():
        assert not _int4_kernel.applies(x, q.parts, q.scheme)
        assert not uses_the_kernel(stored_form(product), q, x)
        got = stored_form(product)(q, x)
    close_in_bf16(got, product(q.dequantize(), x))
