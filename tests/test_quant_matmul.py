"""Matrix products with weights kept quantized, read in their stored form
(`bridge._kept._matmul`): the same outputs and gradients as the dequantizing path, the
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
from bridge._kept._array import QuantizedArray, Scheme, dequantized
from bridge._kept._matmul import kept_matmul, stored_form


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


@pytest.mark.parametrize(
    "kind, dtype",
    [
        ("fp8-block", "float32"),
        ("int4", "float32"),
        ("fp8-block", "bfloat16"),
        ("gptq", "bfloat16"),
    ],
    ids=["fp8-block", "int4", "fp8-block-kernel", "gptq-int4-kernel"],
)
def test_a_lora_step_on_a_kept_base_gives_the_dense_gradients(kind, dtype):
    """In bfloat16 the FP8 and 4-bit products (forward, and the input's gradient in
    the backward) run in the TPU kernels (here in Pallas's interpreter)."""
    if dtype == "bfloat16":
        pytest.importorskip("jax.experimental.pallas.tpu")
    from bridge._kept import _fp8_kernel

    q = KINDS[kind]()

    class Two(eqx.Module):
        fc: eqx.nn.Linear

        def __call__(self, x):
            return jnp.tanh(self.fc(x))

    layer = eqx.nn.Linear(IN, OUT, key=jax.random.key(0), dtype=jnp.dtype(dtype))
    unmoved = QuantizedArray(q.parts, q.scheme._replace(layout=(), dtype=dtype))
    kept = Two(eqx.tree_at(lambda m: m.weight, layer, unmoved))
    x = jax.random.normal(jax.random.key(1), (8, IN), jnp.dtype(dtype))

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
        with _fp8_kernel.interpreted():
            if dtype == "bfloat16" and model is kept:
                assert "pallas_call" in str(jax.make_jaxpr(step)(tree, opt_state, x))
            for _ in range(3):
                tree, opt_state, loss = step(tree, opt_state, x)
        runs.append((tree, before, spec, loss))
    (tree, before, spec, loss), (dense, _, dense_spec, dense_loss) = runs
    tol = {"float32": (1e-5, 1e-4, 1e-6), "bfloat16": (2e-2, 5e-2, 2e-2)}[dtype]
    np.testing.assert_allclose(loss, dense_loss, rtol=tol[0])
    trained = jax.tree.leaves(eqx.filter(tree, spec))
    for a, b in zip(trained, jax.tree.leaves(eqx.filter(dense, dense_spec))):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=tol[1], atol=tol[2] * np.abs(b).max())
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(trained, jax.tree.leaves(eqx.filter(before, spec)))
    )  # the steps moved the factors
    # the base: still kept, its parts the very arrays it started with
    assert isinstance(tree.fc.weight, QuantizedArray)
    for a, b in zip(jax.tree.leaves(tree.fc.weight), jax.tree.leaves(before.fc.weight)):
        assert a is b or np.array_equal(
            np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
        )


# --- the TPU kernel (bridge._kept._fp8_kernel), in Pallas's interpreter on this backend


def _uses_the_kernel(f, *args):
    return "pallas_call" in str(jax.make_jaxpr(f)(*args))


@pytest.mark.parametrize("tile", [128, 1152], ids=["tiles-of-128", "one-tile"])
def test_the_fp8_kernel_decodes_every_code_bit_for_bit(tile, monkeypatch):
    """Products with the identity are the weight itself: every FP8 code decoded,
    scaled and rounded as `dequantize()` rounds it, both ways, its rows in place
    (the kernel decodes them out of order); subnormal codes (zero exponent field)
    are flushed to zero (see bridge._kept._fp8_kernel). Tiles of 128 sum over several
    grid steps."""
    pytest.importorskip("jax.experimental.pallas.tpu")
    from bridge._kept import _fp8_kernel

    monkeypatch.setattr(_fp8_kernel, "_MAX_TILE", tile)

    q = fp8_block(layout=())
    w, s = q.parts["weight"], q.parts["scale"]
    subnormal = (np.asarray(w).view(np.uint8) & 0x78) == 0
    dense = np.where(subnormal, 0, np.asarray(q.dequantize(), np.float32))
    with _fp8_kernel.interpreted():
        assert _fp8_kernel.applies(jnp.eye(IN, dtype=jnp.bfloat16), q.parts, q.scheme)
        forward = _fp8_kernel.fp8_block_matmul(
            jnp.eye(IN, dtype=jnp.bfloat16), w, s, "in"
        )
        backward = _fp8_kernel.fp8_block_matmul(
            jnp.eye(OUT, dtype=jnp.bfloat16), w, s, "out"
        )
    assert forward.dtype == backward.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(forward, np.float32), dense.T)
    assert np.array_equal(np.asarray(backward, np.float32), dense)
    codes = np.asarray(w).view(np.uint8) & 0x7F
    assert subnormal.any() and (codes > 0x70).any()  # the smallest and the largest


@pytest.mark.parametrize("shape", [(8,), (5,), (2, 3)], ids=["b8", "b5", "2x3"])
@pytest.mark.parametrize("build", [nnx_linear, eqx_linear], ids=["nnx", "equinox"])
def test_the_fp8_kernel_equals_the_dequantizing_path(shape, build):
    pytest.importorskip("jax.experimental.pallas.tpu")
    from bridge._kept import _fp8_kernel

    model, forward = build(fp8_block())
    if build is eqx_linear and len(shape) > 1:
        forward = lambda m, x: jax.vmap(jax.vmap(m))(x)  # noqa: E731
    x = jnp.asarray(RNG.standard_normal((*shape, IN)), jnp.bfloat16)
    loss = lambda f: lambda x: f(model, x).astype(jnp.float32).sum()  # noqa: E731
    with _fp8_kernel.interpreted():
        assert _uses_the_kernel(stored_form(forward), model, x)
        got = jax.jit(bridge.quantized_matmuls(forward))(model, x)
        got_dx = jax.grad(loss(stored_form(forward)))(x)
    want = jax.jit(lambda m, x: forward(dequantized(m), x))(model, x)
    assert got.shape == want.shape == (*shape, OUT) and got.dtype == want.dtype
    close_in_bf16(got, want)
    close_in_bf16(got_dx, jax.grad(loss(lambda m, x: forward(dequantized(m), x)))(x))


@pytest.mark.parametrize(
    "why", ["float32 weight", "64x64 blocks", "int4 groups of 64", "rows not of 128"]
)
def test_the_kernel_leaves_what_it_cannot_compute_to_xla(why):
    pytest.importorskip("jax.experimental.pallas.tpu")
    from bridge._kept import _fp8_kernel

    q, dtype = fp8_block(layout=()), jnp.bfloat16
    if why == "float32 weight":  # its products run in float32
        q, dtype = (
            QuantizedArray(q.parts, q.scheme._replace(dtype="float32")),
            jnp.float32,
        )
    elif why == "64x64 blocks":
        q = QuantizedArray(q.parts, q.scheme._replace(settings=(("block", (64, 64)),)))
        q.parts["scale"] = jnp.ones((OUT // 64, IN // 64), jnp.float32)
    elif why == "int4 groups of 64":  # the 4-bit kernel takes groups of 128
        q = int4_packed(layout=())
        q.parts["scale"] = q.parts["scale"].repeat(2, axis=1)
        q = QuantizedArray(q.parts, q.scheme._replace(settings=(("group_size", 64),)))
    else:
        parts = {"weight": q.parts["weight"][:200], "scale": q.parts["scale"]}
        q = QuantizedArray(parts, q.scheme._replace(stored=(200, IN)))
    x = jnp.ones((8, IN), dtype)
    f = lambda w, x: x @ w.T  # noqa: E731
    with _fp8_kernel.interpreted():
        assert not _uses_the_kernel(stored_form(f), q, x)
        got = stored_form(f)(q, x)
    close_in_bf16(got, f(q.dequantize(), x))


def _products(jaxpr):
    """The `dot_general`s of `jaxpr` and of every jaxpr inside it (a kernel's body)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for param in eqn.params.values():
            for inner in param if isinstance(param, tuple | list) else [param]:
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's, `cond`'s
                if hasattr(inner, "eqns"):
                    yield from _products(inner)


@pytest.mark.parametrize("contract", ["in", "out"])
@pytest.mark.parametrize("kind", ["fp8-block", "int4"])
def test_the_kernels_set_the_precision_of_their_products(kind, contract):
    """Every product in a kernel's body says its precision: a float32 program's
    `jax.default_matmul_precision("highest")` (the tests' own on an accelerator)
    would reach a bfloat16 product there, which Mosaic refuses on a TPU ("Bad lhs
    type")."""
    pytest.importorskip("jax.experimental.pallas.tpu")
    from bridge._kept import _fp8_kernel, _int4_kernel

    q = fp8_block(layout=()) if kind == "fp8-block" else int4_packed(layout=())
    x = jnp.ones((8, IN if contract == "in" else OUT), jnp.bfloat16)
    if kind == "fp8-block":
        w, s = q.parts["weight"], q.parts["scale"]
        kernel = lambda x: _fp8_kernel.fp8_block_matmul(x, w, s, contract)  # noqa: E731
    else:
        kernel = lambda x: _int4_kernel.int4_matmul(  # noqa: E731
            x, q.parts, q.scheme, contract
        )
    with _fp8_kernel.interpreted(), jax.default_matmul_precision("highest"):
        jaxpr = jax.make_jaxpr(kernel)(x)
    (call,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    products = list(_products(call.params["jaxpr"]))
    assert products
    default = (jax.lax.Precision.DEFAULT,) * 2
    assert [tuple(e.params["precision"] or ()) for e in products] == [default] * len(
        products
    )
