"""Matrix products with weights kept quantized, read in their stored form
(`bridge._qmatmul`): the same outputs and gradients as the dequantizing path, the
backward pass holds no dense weight as a residual, a kept base stays bit-identical
through LoRA steps. The oracle: the same function on `bridge.dequantize`'s model."""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import bridge
from bridge._qarray import QuantizedArray, Scheme, dequantized
from bridge._qmatmul import kept_matmul, stored_form


OUT, IN = 256, 384
RNG = np.random.default_rng(0)
T = (("transpose", (1, 0)),)  # a Flax kernel: (in, out) from the stored (out, in)


def words(shape):
    return jnp.asarray(RNG.integers(0, 2**32, shape, dtype=np.uint32).view(np.int32))


def fp8_block(layout=T):
    codes = RNG.integers(0, 0x7F, (OUT, IN), dtype=np.uint8)  # no NaN
    codes |= RNG.integers(0, 2, (OUT, IN), dtype=np.uint8) << 7
    parts = {
        "weight": jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn)),
        "scale": jnp.asarray(RNG.uniform(1e-3, 1e-2, (2, 3)).astype(np.float32)),
    }
    settings = (("block", (128, 128)),)
    return QuantizedArray(
        parts, Scheme("fp8-block", 8, (OUT, IN), "bfloat16", settings, layout)
    )


def int8_rows(layout=T):
    parts = {
        "weight": jnp.asarray(RNG.integers(-127, 128, (OUT, IN)), jnp.int8),
        "scale": jnp.asarray(RNG.uniform(1e-3, 1e-2, (OUT, 1)), jnp.bfloat16),
    }
    return QuantizedArray(parts, Scheme("int", 8, (OUT, IN), "bfloat16", (), layout))


def int4_packed(layout=T):  # compressed-tensors' pack-quantized, groups of 128
    parts = {
        "weight": words((OUT, IN // 8)),
        "scale": jnp.asarray(RNG.uniform(1e-3, 1e-2, (OUT, IN // 128)), jnp.bfloat16),
    }
    settings = (("group_size", 128),)
    scheme = Scheme("int-packed", 4, (OUT, IN), "bfloat16", settings, layout)
    return QuantizedArray(parts, scheme)


def gptq(layout=T):  # 4-bit, groups of 128, zero points
    parts = {
        "weight": words((IN // 8, OUT)),
        "zero": words((IN // 128, OUT // 8)),
        "scale": jnp.asarray(RNG.uniform(1e-3, 1e-2, (IN // 128, OUT)), jnp.float16),
    }
    settings = (("group_size", 128), ("zero_plus_one", True))
    return QuantizedArray(
        parts, Scheme("gptq", 4, (OUT, IN), "bfloat16", settings, layout)
    )


KINDS = {"fp8-block": fp8_block, "int8": int8_rows, "int4": int4_packed, "gptq": gptq}


def nnx_linear(q):
    layer = nnx.Linear(
        IN, OUT, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
    )
    layer.kernel = nnx.Param(q)
    graph, state = nnx.split(layer)
    return state, lambda state, x: nnx.merge(graph, state)(x)


def nnx_module(q):  # the module itself, through the public name
    layer = nnx.Linear(
        IN, OUT, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
    )
    layer.kernel = nnx.Param(q)
    return layer, lambda m, x: m(x)


def eqx_linear(q):
    layer = eqx.nn.Linear(IN, OUT, key=jax.random.key(0), dtype=jnp.bfloat16)
    unmoved = QuantizedArray(q.parts, q.scheme._replace(layout=()))  # (out, in)
    return eqx.tree_at(lambda m: m.weight, layer, unmoved), lambda m, x: jax.vmap(m)(x)


def close_in_bf16(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    # a few bfloat16 roundings of the largest value apart, no more
    np.testing.assert_allclose(a, b, rtol=0, atol=4 * 2**-8 * np.abs(b).max())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "build", [nnx_linear, nnx_module, eqx_linear], ids=["nnx", "nnx-module", "equinox"]
)
def test_products_read_the_stored_form_and_equal_the_dequantizing_path(kind, build):
    model, forward = build(KINDS[kind]())
    x = jnp.asarray(RNG.standard_normal((8, IN)), jnp.bfloat16)
    assert "custom_vjp_call" in str(jax.make_jaxpr(stored_form(forward))(model, x))
    got = jax.jit(bridge.quantized_matmuls(forward))(model, x)
    want = jax.jit(lambda m, x: forward(dequantized(m), x))(model, x)
    assert got.shape == want.shape == (8, OUT) and got.dtype == want.dtype
    close_in_bf16(got, want)
    # the gradient of the input: from the recomputed dense weight
    loss = lambda f: lambda x: f(model, x).astype(jnp.float32).sum()  # noqa: E731
    got = jax.grad(loss(stored_form(forward)))(x)
    want = jax.grad(loss(lambda m, x: forward(dequantized(m), x)))(x)
    close_in_bf16(got, want)


def test_other_uses_get_the_dense_weight_bit_for_bit():
    q = int8_rows()
    f = lambda w, x: (x @ w, w.sum(), w[:, :3])  # noqa: E731  (in, out) as a kernel
    x = jnp.ones((2, IN), jnp.bfloat16)
    _, total, corner = stored_form(f)(q, x)
    assert total == q.dequantize().sum()
    assert np.array_equal(corner, q.dequantize()[:, :3])


def test_the_backward_pass_keeps_no_dense_weight():
    """The residuals of a kept product are its stored parts: the dense weight of the
    backward pass is recomputed there, a temporary."""
    q = fp8_block(layout=())
    x = jnp.ones((8, IN), jnp.bfloat16)
    _, residuals = jax.vjp(lambda x: kept_matmul(x, q.parts, q.scheme), x)
    kept = jax.tree.leaves(residuals)
    assert {a.dtype for a in kept} <= {q.parts["weight"].dtype, np.dtype(np.float32)}
    assert all(a.shape != (OUT, IN) or a.dtype.itemsize == 1 for a in kept)


@pytest.mark.parametrize("kind", ["fp8-block", "int4"])
def test_a_lora_step_on_a_kept_base_gives_the_dense_gradients(kind):
    q = KINDS[kind]()

    class Two(eqx.Module):
        fc: eqx.nn.Linear

        def __call__(self, x):
            return jnp.tanh(self.fc(x))

    layer = eqx.nn.Linear(IN, OUT, key=jax.random.key(0), dtype=jnp.float32)
    unmoved = QuantizedArray(q.parts, q.scheme._replace(layout=(), dtype="float32"))
    kept = Two(eqx.tree_at(lambda m: m.weight, layer, unmoved))
    x = jax.random.normal(jax.random.key(1), (8, IN))

    def loss_fn(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    runs = []
    for model in (kept, bridge.dequantize(kept)):
        tree = bridge.to_neutral(
            bridge.lora(model, "fc", rank=4, key=jax.random.key(2))
        )
        spec = bridge.trainable(tree, "lora")
        step = bridge.make_step(loss_fn, optax.sgd(0.1), spec, donate=False)
        opt_state, before = step.init(tree), tree
        for _ in range(3):
            tree, opt_state, loss = step(tree, opt_state, x)
        runs.append((tree, before, spec, loss))
    (tree, before, spec, loss), (dense, _, dense_spec, dense_loss) = runs
    np.testing.assert_allclose(loss, dense_loss, rtol=1e-5)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(tree, spec)),
        jax.tree.leaves(eqx.filter(dense, dense_spec)),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # the base: still kept, its parts the very arrays it started with
    assert isinstance(tree.fc.weight, QuantizedArray)
    for a, b in zip(jax.tree.leaves(tree.fc.weight), jax.tree.leaves(before.fc.weight)):
        assert a is b or np.array_equal(
            np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
        )
