"""`bridge.load(..., keep_quantized=True)`: quantized weights kept as
`bridge.QuantizedArray`s, dequantized inside `jax.jit` (by `bridge.dequantize` or
`bridge.make_step`). The oracles: the checkpoint's own tensors (read with
safetensors), the dequantizing load (itself checked against transformers and
compressed-tensors in test_quant_torch.py) bit for bit, the dense model's forward
pass and LoRA training."""

import json

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import safetensors.flax
from flax import nnx

import bridge
from bridge._quant import _fp8

from . import quant_llama as ql
from .helpers import needs_devices, requires, skip_unless


C = ql.Config(dim=128, hidden=256, layers=1, heads=2, kv_heads=1)
TOKENS = jnp.asarray([[1, 5, 9, 3, 7, 2, 8, 4]])
MAKERS = {"nnx": ql.nnx_layers, "equinox": ql.eqx_layers}


def _abstract(name):
    make = MAKERS[name]
    if name == "equinox":
        return eqx.filter_eval_shape(lambda: ql.make(make(), ql.HF, C))
    return nnx.eval_shape(lambda: ql.make(make(), ql.HF, C))


def _leaves(model):
    return jax.tree.leaves(bridge.to_neutral(model))


def _bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


_DTYPES = {
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F32": np.float32,
    "BF16": ml_dtypes.bfloat16,
    "I32": np.int32,
}


def _stored(path):
    """The tensors of a safetensors file, read from its bytes as the format is
    published (an 8-byte header length, a JSON header of dtypes, shapes and
    offsets, the data): no bridge code, and NumPy's safetensors reader has no FP8."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        raw = data[8 + n + start : 8 + n + end]
        out[name] = np.frombuffer(raw, _DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def _same_bits(a, b):
    return (
        a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_bits(a), _bits(b))
    )


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """A Llama folder written FP8 block-scaled (128x128) by `bridge.save`."""
    skip_unless("NNX")  # written from an NNX model
    folder = tmp_path_factory.mktemp("fp8")
    source = ql.make(ql.nnx_layers(), ql.HF, C)
    bridge.save_quantized(folder / "model.safetensors", source, "fp8-block")
    return folder


def _forward(name):
    layers = MAKERS[name]()
    return jax.jit(lambda model, x: ql.forward(layers, ql.HF, model, x, C))


@pytest.mark.parametrize("name", ["nnx", "equinox"])
def test_kept_weights_are_the_files_tensors_and_dequantize_bit_equal(fp8, name):
    dense = bridge.load(fp8, like=_abstract(name))
    kept = bridge.load(fp8, like=_abstract(name), keep_quantized=True)
    tree = bridge.to_neutral(kept)
    where = "kernel" if name == "nnx" else "weight"
    q = getattr(tree.model.layers[0].mlp.down_proj, where)
    assert isinstance(q, bridge.QuantizedArray) and q.scheme.name == "fp8-block"
    stored = _stored(fp8 / "model.safetensors")
    name_ = "model.layers.0.mlp.down_proj.weight"
    assert _same_bits(np.asarray(q.parts["weight"]), stored[name_])
    assert _same_bits(np.asarray(q.parts["scale"]), stored[name_ + "_scale_inv"])
    assert q.nbytes < np.prod(q.shape) * 4 / 3.9  # FP8 and its scales, not float32
    # the output head is dense in the file: dense in the model
    head = getattr(tree.lm_head, where)
    assert not isinstance(head, bridge.QuantizedArray)
    want, got = _leaves(dense), _leaves(bridge.dequantize(kept))
    assert len(want) == len(got)
    assert all(_same_bits(np.asarray(a), np.asarray(b)) for a, b in zip(want, got))


@pytest.mark.parametrize(
    "name", [pytest.param("nnx", marks=pytest.mark.slow), "equinox"]
)
def test_kept_logits_equal_the_dense_models(fp8, name):
    dense = bridge.load(fp8, like=_abstract(name))
    kept = bridge.load(fp8, like=_abstract(name), keep_quantized=True)
    # inside jit, the forward pass of the dequantized model
    forward = _forward(name)
    logits = np.asarray(forward(dense, TOKENS))
    kept_logits = np.asarray(
        jax.jit(lambda m, x: forward(bridge.dequantize(m), x))(kept, TOKENS)
    )
    # bit-equal weights; XLA may fold NNX's transposed kernel into the dot
    np.testing.assert_allclose(kept_logits, logits, rtol=1e-5, atol=1e-5)
    # without bridge.dequantize: JAX takes each QuantizedArray where it needs an
    # array (`__jax_array__`), dequantized there
    direct = np.asarray(forward(kept, TOKENS))
    np.testing.assert_allclose(direct, logits, rtol=1e-5, atol=1e-5)
    if name == "equinox":
        assert np.array_equal(kept_logits, logits) and np.array_equal(direct, logits)


def test_partial_blocks_and_bfloat16(tmp_path):
    """Blocks that do not divide the weight (qwix's QArray cannot hold them), into
    bfloat16."""
    rng = np.random.default_rng(0)
    block = (48, 80)
    state = {}
    for name, (rows, cols) in {"fc1": (100, 70), "fc2": (30, 100)}.items():
        w = rng.normal(size=(rows, cols)).astype(np.float32)
        q, scale = _fp8.quantize_blocks(w, block)
        state[f"{name}.weight"], state[f"{name}.weight_scale_inv"] = q, scale
        state[f"{name}.bias"] = rng.normal(size=rows).astype(np.float32)
    arrays = {k: jnp.asarray(v) for k, v in state.items()}
    safetensors.flax.save_file(arrays, tmp_path / "model.safetensors")
    config = {
        "quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}
    }
    (tmp_path / "config.json").write_text(json.dumps(config))

    class Net(eqx.Module):
        fc1: eqx.nn.Linear
        fc2: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.fc1 = eqx.nn.Linear(70, 100, key=k1, dtype=jnp.bfloat16)
            self.fc2 = eqx.nn.Linear(100, 30, key=k2, dtype=jnp.bfloat16)

    like = eqx.filter_eval_shape(Net, jax.random.key(0))
    dense = bridge.load(tmp_path, like=like, dtype=jnp.bfloat16)
    kept = bridge.load(tmp_path, like=like, dtype=jnp.bfloat16, keep_quantized=True)
    assert isinstance(kept.fc1.weight, bridge.QuantizedArray)
    assert kept.fc1.weight.dtype == jnp.bfloat16 and kept.fc1.weight.shape == (100, 70)
    assert _same_bits(np.asarray(kept.fc1.bias), np.asarray(dense.fc1.bias))
    for a, b in zip(_leaves(dense), _leaves(bridge.dequantize(kept))):
        assert _same_bits(np.asarray(a), np.asarray(b))
    # a weight written by hand: w * s per block, in float32, as the published
    # reference does it
    raw = state["fc2.weight"].astype(np.float32)
    scales = np.repeat(np.repeat(state["fc2.weight_scale_inv"], 48, 0), 80, 1)
    want = (raw * scales[:30, :100]).astype(ml_dtypes.bfloat16)
    assert _same_bits(
        np.asarray(jax.jit(lambda q: q.dequantize())(kept.fc2.weight)), want
    )


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(128)(x)


def test_linen(tmp_path):
    module = MLP()
    variables = module.init(jax.random.key(0), jnp.ones((1, 128)))
    path = tmp_path / "model.safetensors"
    bridge.save_quantized(path, (module, variables), "fp8-block")
    like = (module, jax.eval_shape(module.init, jax.random.key(1), jnp.ones((1, 128))))
    _, dense = bridge.load(path, like=like)
    _, kept = bridge.load(path, like=like, keep_quantized=True)
    kernel = kept["params"]["Dense_0"]["kernel"]
    assert isinstance(kernel, bridge.QuantizedArray) and kernel.shape == (128, 256)
    x = jax.random.normal(jax.random.key(2), (4, 128))
    run = jax.jit(lambda v, x: module.apply(bridge.dequantize(v), x))
    np.testing.assert_allclose(
        run(kept, x), module.apply(dense, x), rtol=1e-5, atol=1e-5
    )
    assert _same_bits(
        np.asarray(bridge.dequantize(kept)["params"]["Dense_1"]["kernel"]),
        np.asarray(dense["params"]["Dense_1"]["kernel"]),
    )


def test_a_pytree_under_jax_and_equinox(fp8):
    kept = bridge.load(fp8, like=_abstract("nnx"), keep_quantized=True)
    tree = bridge.to_neutral(kept)
    q = tree.model.layers[0].self_attn.q_proj.kernel
    # eval_shape: the dense shape and dtype, no FLOPs
    shaped = jax.eval_shape(bridge.dequantize, tree)
    assert shaped.model.layers[0].self_attn.q_proj.kernel.shape == q.shape
    # partition/combine: a spec at every part, then back
    spec = jax.tree.map(lambda _: False, tree)
    diff, static = eqx.partition(tree, spec)
    back = eqx.combine(diff, static)
    assert back.model.layers[0].self_attn.q_proj.kernel.scheme == q.scheme
    # tree_at into a part; the Tree rebuilds its model
    scale = q.parts["scale"] * 2
    doubled = eqx.tree_at(
        lambda t: t.model.layers[0].self_attn.q_proj.kernel.parts["scale"], tree, scale
    )
    model = bridge.to_native(doubled)
    d = np.asarray(
        bridge.dequantize(model).model.layers[0].self_attn.q_proj.kernel[...]
    )
    assert np.array_equal(d, 2 * np.asarray(q.dequantize()))
    assert "QuantizedArray(fp8-block 8-bit: float32[128,128])" in repr(tree)


def _loss(name):
    layers = MAKERS[name]()

    def loss_fn(model, x):
        logits = ql.forward(layers, ql.HF, model, x[:, :-1], C)
        return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()

    return loss_fn


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nnx", "equinox"])
def test_lora_on_a_quantized_base_trains_as_on_the_dense_one(fp8, name):
    runs = []
    for keep in (False, True):
        model = bridge.load(fp8, like=_abstract(name), keep_quantized=keep)
        model = bridge.lora(model, "q_proj|v_proj", rank=4, key=jax.random.key(1))
        tree = bridge.to_neutral(model)
        before = [np.asarray(x) for x in jax.tree.leaves(tree)]
        spec = bridge.trainable(tree, "lora")
        step = bridge.make_step(_loss(name), optax.adam(1e-2), spec, donate=False)
        opt_state = step.init(tree)
        losses = []
        for _ in range(3):
            tree, opt_state, loss = step(tree, opt_state, TOKENS)
            losses.append(float(loss))
        trained = {
            jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(eqx.filter(tree, spec))[0]
        }
        runs.append((losses, trained, tree, before, spec))
    (dense_losses, dense_lora, *_), (losses, lora, tree, before, spec) = runs
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, dense_losses, rtol=1e-5)
    assert lora.keys() == dense_lora.keys() and len(lora) == 4 * C.layers
    for k in lora:
        np.testing.assert_allclose(lora[k], dense_lora[k], rtol=1e-4, atol=1e-5)
    # the quantized base: still quantized, untouched bit for bit
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    kept = bridge._kept._array.quantized_positions(tree)
    assert len(kept) == 2 * 7 * C.layers  # weight and scale of each projection
    after = [np.asarray(x) for _, x in flat]
    frozen = jax.tree.leaves(jax.tree.map(lambda s: not s, spec))
    assert all(
        _same_bits(a, b) for a, b, f in zip(before, after, frozen, strict=True) if f
    )


def test_quantized_weights_are_never_trainable(fp8):
    kept = bridge.load(fp8, like=_abstract("equinox"), keep_quantized=True)
    tree = bridge.to_neutral(kept)
    # trainable leaves them out, as it leaves out non-params leaves
    with pytest.raises(ValueError, match="only weights kept quantized"):
        bridge.trainable(tree, r"\.mlp\.")
    spec = bridge.trainable(tree, "layernorm|norm|lm_head")
    assert sum(jax.tree.leaves(spec)) == 2 * C.layers + 2  # norms and the dense head
    # a spec that marks a part trainable is refused, naming the weight
    spec = eqx.tree_at(
        lambda t: t.model.layers[0].self_attn.q_proj.weight.parts["weight"], spec, True
    )
    step = bridge.make_step(_loss("equinox"), optax.sgd(1e-2), spec)
    with pytest.raises(ValueError, match=r"(?s)kept quantized.*\.q_proj\.weight"):
        step.init(tree)


def test_forward_memory_of_the_kept_model_is_smaller(fp8):
    """The compiled forward pass's arguments: FP8 weights and their scales, not
    float32 (its temporaries depend on XLA's scheduler: benchmarks/quantized.py
    --keep measures the peak)."""
    dense = bridge.load(fp8, like=_abstract("equinox"))
    kept = bridge.load(fp8, like=_abstract("equinox"), keep_quantized=True)
    forward = _forward("equinox")
    run = jax.jit(lambda m, x: forward(bridge.dequantize(m), x))
    a = forward.lower(dense, TOKENS).compile().memory_analysis()
    b = run.lower(kept, TOKENS).compile().memory_analysis()
    assert b.argument_size_in_bytes < 0.5 * a.argument_size_in_bytes


def test_refusals(fp8, tmp_path):
    with pytest.raises(TypeError, match="keep_quantized=True needs `like`"):
        bridge.load(fp8, keep_quantized=True)
    kept = bridge.load(fp8, like=_abstract("nnx"), keep_quantized=True)
    out = tmp_path / "out.safetensors"
    for save in (bridge.save, bridge.save_state_dict):
        with pytest.raises(ValueError, match=r"(?s)kept quantized.*bridge\.dequantize"):
            save(out, kept)
        assert not out.exists() and list(tmp_path.iterdir()) == []
    # the dense model saves
    bridge.save(out, bridge.dequantize(kept))
    assert out.exists()
    torch_like = bridge.from_torch(
        {k: np.zeros(s, np.float32) for k, s in _torch_shapes(fp8).items()}
    )
    with pytest.raises(ValueError, match="not in a PyTorch-layout model"):
        bridge.load(fp8, like=torch_like, keep_quantized=True)


def _torch_shapes(folder):
    stored = _stored(folder / "model.safetensors")
    return {k: v.shape for k, v in stored.items() if not k.endswith("_scale_inv")}


@requires("NNX")
def test_nothing_quantized_loads_as_usual(tmp_path):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    bridge.save(tmp_path / "m.safetensors", model)
    got = bridge.load(
        tmp_path / "m.safetensors",
        like=nnx.Linear(2, 3, rngs=nnx.Rngs(1)),
        keep_quantized=True,
    )
    assert np.array_equal(got.kernel[...], model.kernel[...])


class Two(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(128, 256, key=k1)
        self.fc2 = eqx.nn.Linear(256, 128, key=k2)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


def test_lora_steps_on_a_quantized_base_small(tmp_path):
    path = tmp_path / "model.safetensors"
    bridge.save_quantized(path, Two(jax.random.key(0)), "fp8-block")
    like = eqx.filter_eval_shape(Two, jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (8, 128))
    y = jax.random.normal(jax.random.key(3), (8, 128))

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    runs = []
    for keep in (False, True):
        model = bridge.load(path, like=like, keep_quantized=keep)
        model = bridge.lora(model, "fc1|fc2", rank=2, key=jax.random.key(4))
        tree = bridge.to_neutral(model)
        spec = bridge.trainable(tree, "lora")
        step = bridge.make_step(loss_fn, optax.adam(1e-2), spec, donate=False)
        opt_state, losses = step.init(tree), []
        for _ in range(3):
            new, opt_state, loss = step(tree, opt_state, x, y)
            losses.append(float(loss))
            if keep:  # the base: the same arrays, still quantized
                assert new.fc1.weight.parts["weight"] is tree.fc1.weight.parts["weight"]
                assert isinstance(new.fc2.weight, bridge.QuantizedArray)
            tree = new
        runs.append((losses, eqx.filter(tree, spec)))
    (dense_losses, dense), (losses, kept) = runs
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, dense_losses, rtol=1e-6)
    adapters = jax.tree.leaves(kept)
    assert len(adapters) == 4  # lora_a and lora_b of fc1 and fc2
    for a, b in zip(jax.tree.leaves(dense), adapters, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.torch
def test_qwix_arrays_of_the_kept_weights(fp8, tmp_path):
    """qwix's own QArray, dequantization and dot_general as the oracle."""
    qwix = pytest.importorskip("qwix")
    kept = bridge.load(fp8, like=_abstract("nnx"), keep_quantized=True)
    whole = lambda x: isinstance(x, bridge.QuantizedArray)  # noqa: E731
    weights = [
        x for x in jax.tree.leaves(bridge.to_neutral(kept), is_leaf=whole) if whole(x)
    ]
    assert len(weights) == 7 * C.layers
    x = jax.random.normal(jax.random.key(0), (3, C.dim))
    converted = 0
    for q in weights:
        if any(d % 128 for d in q.scheme.stored):  # k/v_proj (64, 128): a half block
            with pytest.raises(ValueError, match=r"128x128 do not divide"):
                q.to_qwix()
            continue
        converted += 1
        qa = q.to_qwix()
        assert isinstance(qa, qwix.QArray) and qa.shape == q.shape
        assert qa.qvalue.dtype == jnp.float8_e4m3fn
        dense = q.dequantize()
        assert _same_bits(
            np.asarray(qwix.dequantize(qa).astype(q.dtype)), np.asarray(dense)
        )
        if q.shape[0] == C.dim:  # qwix's own matmul on its QArray
            dims = (((1,), (0,)), ((), ()))
            got = qwix.dot_general(x, qa, dims)
            np.testing.assert_allclose(got, x @ dense, rtol=1e-5, atol=1e-5)
    assert converted == 5 * C.layers
    # partial blocks: refused, naming why
    state = {}
    w = np.random.default_rng(0).normal(size=(100, 70)).astype(np.float32)
    state["fc.weight"], state["fc.weight_scale_inv"] = _fp8.quantize_blocks(w, (48, 80))
    arrays = {k: jnp.asarray(v) for k, v in state.items()}
    safetensors.flax.save_file(arrays, tmp_path / "model.safetensors")
    config = {"quant_method": "fp8", "weight_block_size": [48, 80]}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": config}))
    like = nnx.eval_shape(lambda: nnx.Linear(70, 100, use_bias=False, rngs=nnx.Rngs(0)))
    odd = bridge.load(tmp_path, like=like, keep_quantized=True).kernel[...]
    with pytest.raises(ValueError, match=r"blocks of 48x80 do not divide"):
        odd.to_qwix()


@pytest.mark.parametrize("name", ["nnx", "equinox"])
def test_peft_files_and_merge_on_a_quantized_base(fp8, tmp_path, name):
    kept = bridge.load(fp8, like=_abstract(name), keep_quantized=True)
    dense = bridge.load(fp8, like=_abstract(name))
    adapted = [
        bridge.lora(m, "q_proj|v_proj", rank=2, key=jax.random.key(0))
        for m in (kept, dense)
    ]
    # the adapters alone: PEFT's files, as from the dequantized model
    for i, model in enumerate(adapted):
        bridge.save_peft(tmp_path / str(i), model)
    files = [_stored(tmp_path / str(i) / "adapter_model.safetensors") for i in (0, 1)]
    assert files[0].keys() == files[1].keys() and len(files[0]) == 4 * C.layers
    assert all(_same_bits(files[0][k], files[1][k]) for k in files[0])
    back = bridge.load_peft(tmp_path / "0", kept)
    whole = lambda x: isinstance(x, bridge.QuantizedArray)  # noqa: E731
    kept_leaves = jax.tree.leaves(bridge.to_neutral(back), is_leaf=whole)
    assert sum(map(whole, kept_leaves)) == 7 * C.layers
    # merging: the adapted layers' weights dequantized, then W + s A B, bit for bit
    # as on the dequantized model; the other layers stay quantized
    adapted = [
        eqx.tree_at(
            lambda t: [t.model.layers[0].self_attn.q_proj.lora_b],
            bridge.to_neutral(m),
            [
                jnp.ones_like(
                    bridge.to_neutral(m).model.layers[0].self_attn.q_proj.lora_b
                )
            ],
        )
        for m in adapted
    ]
    merged = [bridge.merge_lora(m) for m in adapted]
    leaves = [jax.tree.leaves(m, is_leaf=whole) for m in merged]
    assert sum(map(whole, leaves[0])) == 5 * C.layers  # q_proj, v_proj merged
    for a, b in zip(
        jax.tree.leaves(bridge.dequantize(merged[0])), jax.tree.leaves(merged[1])
    ):
        assert _same_bits(np.asarray(a), np.asarray(b))


@pytest.mark.torch
def test_gguf_is_not_kept(tmp_path):
    pytest.importorskip("gguf")
    from . import test_quant_gguf as qg

    path = tmp_path / "tiny.gguf"
    qg.write_gguf(path, qg.gguf_state(qg._dense()))
    target = eqx.filter_eval_shape(lambda: ql.make(ql.eqx_layers(), ql.GGUF))
    with pytest.raises(ValueError, match=r"tiny\.gguf: keep_quantized=True does not"):
        bridge.load(path, like=target, keep_quantized=True)
    assert bridge.load(path, like=target) is not None  # dequantized, as it says


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.Dense(128, use_bias=False)(nn.Dense(256, use_bias=False)(x)), None


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(
            Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
        )
        return scan()(x, None)[0]


def test_a_stack_is_not_kept(tmp_path):
    module = Stack()
    variables = module.init(jax.random.key(0), jnp.ones((1, 128)))
    path = tmp_path / "model.safetensors"
    bridge.save_quantized(path, (module, variables), "fp8-block")
    with pytest.raises(
        ValueError, match=r"(?s)cannot keep 6 weight.*Dense_1: a layer of a stack"
    ):
        bridge.load(path, like=(module, variables), keep_quantized=True)
    _, dense = bridge.load(path, like=(module, variables))  # as the error says
    assert dense["params"]["ScanBlock_0"]["Dense_1"]["kernel"].shape == (3, 128, 256)


@needs_devices(2)
def test_a_sharded_like_is_refused(fp8):
    """Kept weights go to the default device: a `like` sharded over several devices
    is refused (its shardings would be lost), not loaded unsharded."""
    model = ql.make(ql.nnx_layers(), ql.HF, C)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    nnx.update(model, jax.device_put(nnx.state(model), replicated))
    with pytest.raises(
        ValueError, match=r"sharded over several devices \(\.lm_head\.kernel"
    ):
        bridge.load(fp8, like=model, keep_quantized=True)
    # without keep_quantized the shardings are kept
    loaded = bridge.load(fp8, like=model)
    assert all(leaf.sharding == replicated for leaf in _leaves(loaded))
