"""Hugging Face models from small configs with random weights (no download), saved
with `save_pretrained` (one file and sharded), ported into the same model written in
NNX, Equinox and Linen: outputs equal to transformers' forward; exported back with
`layout="torch"` and read by `from_pretrained`: outputs equal again. Skipped without
torch and transformers (`nox -s tests_torch` installs them)."""

import json
import math

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import requires


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
# minutes of compilation: `nox -s tests_torch` runs them, the fast suite does not
pytestmark = [pytest.mark.slow, requires("NNX")]

H, HEADS, INTER, VOCAB, POS, TYPES, LAYERS = 32, 2, 64, 50, 16, 2, 2
EPS = 1e-12
TOL = dict(rtol=1e-4, atol=1e-4)


def _bert():
    config = transformers.BertConfig(
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTER,
        vocab_size=VOCAB,
        max_position_embeddings=POS,
        type_vocab_size=TYPES,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    with torch.no_grad():  # LayerNorms and biases away from 1 and 0
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


IDS = np.array([[1, 5, 9, 3, 7, 2], [4, 4, 8, 0, 11, 6]])
TYPE_IDS = np.array([[0, 0, 0, 1, 1, 1], [0, 1, 0, 1, 0, 1]])


def _torch_out(model):
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(IDS), token_type_ids=torch.from_numpy(TYPE_IDS)
        )
    return out.last_hidden_state.numpy(), out.pooler_output.numpy()


# --- the same BERT, written once as math over each framework's layers ---------------


def _attention(x, query, key, value):
    b, n, _ = x.shape
    split = lambda y: jnp.reshape(y, (b, n, HEADS, H // HEADS))  # noqa: E731
    q, k, v = split(query(x)), split(key(x)), split(value(x))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(H // HEADS)
    ctx = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return jnp.reshape(ctx, (b, n, H))


def _layer(x, m, call):
    """One encoder layer; `call(module, x)` runs a layer of the framework."""
    att = m.attention
    sa = att.self
    ctx = _attention(
        x,
        lambda y: call(sa.query, y),
        lambda y: call(sa.key, y),
        lambda y: call(sa.value, y),
    )
    x = call(att.output.LayerNorm, call(att.output.dense, ctx) + x)
    h = jax.nn.gelu(call(m.intermediate.dense, x), approximate=False)
    return call(m.output.LayerNorm, call(m.output.dense, h) + x)


def _bert_forward(m, ids, type_ids, call, embed):
    e = m.embeddings
    positions = jnp.arange(ids.shape[1])[None]
    x = (
        embed(e.word_embeddings, ids)
        + embed(e.position_embeddings, positions)
        + embed(e.token_type_embeddings, type_ids)
    )
    x = call(e.LayerNorm, x)
    for layer in m.encoder.layer:
        x = _layer(x, layer, call)
    pooled = jnp.tanh(call(m.pooler.dense, x[:, 0]))
    return x, pooled


# NNX


class _Node(nnx.Module):
    def __init__(self, children):
        for name, child in children.items():
            setattr(self, name, child)


def _node(**children):  # a lambda's keywords may be called `self`
    return _Node(children)


def _nnx_bert(rngs):
    lin = lambda i, o: nnx.Linear(i, o, rngs=rngs)  # noqa: E731
    norm = lambda: nnx.LayerNorm(H, epsilon=EPS, rngs=rngs)  # noqa: E731

    def layer():
        return _node(
            attention=_node(
                self=_node(query=lin(H, H), key=lin(H, H), value=lin(H, H)),
                output=_node(dense=lin(H, H), LayerNorm=norm()),
            ),
            intermediate=_node(dense=lin(H, INTER)),
            output=_node(dense=lin(INTER, H), LayerNorm=norm()),
        )

    return _node(
        embeddings=_node(
            word_embeddings=nnx.Embed(VOCAB, H, rngs=rngs),
            position_embeddings=nnx.Embed(POS, H, rngs=rngs),
            token_type_embeddings=nnx.Embed(TYPES, H, rngs=rngs),
            LayerNorm=norm(),
        ),
        encoder=_node(layer=nnx.List([layer() for _ in range(LAYERS)])),
        pooler=_node(dense=lin(H, H)),
    )


def _nnx_run(model):
    return _bert_forward(
        model, IDS, TYPE_IDS, lambda mod, x: mod(x), lambda mod, i: mod(i)
    )


# Equinox: plain containers with the same field names


def _eqx_class(*fields):
    """An Equinox module with these fields (some may be called `self`)."""

    def init(this, **children):
        for name in fields:
            setattr(this, name, children[name])

    namespace = {"__annotations__": dict.fromkeys(fields, object), "__init__": init}
    return type("EqxNode_" + "_".join(fields), (eqx.Module,), namespace)


_EQX_CLASSES: dict = {}


def _eqx_node(**children):
    fields = tuple(children)
    if fields not in _EQX_CLASSES:
        _EQX_CLASSES[fields] = _eqx_class(*fields)
    return _EQX_CLASSES[fields](**children)


def _eqx_bert(key):
    keys = iter(jax.random.split(key, 64))
    lin = lambda i, o: eqx.nn.Linear(i, o, key=next(keys))  # noqa: E731
    norm = lambda: eqx.nn.LayerNorm(H, eps=EPS)  # noqa: E731
    node = _eqx_node

    def layer():
        return node(
            attention=node(
                self=node(query=lin(H, H), key=lin(H, H), value=lin(H, H)),
                output=node(dense=lin(H, H), LayerNorm=norm()),
            ),
            intermediate=node(dense=lin(H, INTER)),
            output=node(dense=lin(INTER, H), LayerNorm=norm()),
        )

    return node(
        embeddings=node(
            word_embeddings=eqx.nn.Embedding(VOCAB, H, key=next(keys)),
            position_embeddings=eqx.nn.Embedding(POS, H, key=next(keys)),
            token_type_embeddings=eqx.nn.Embedding(TYPES, H, key=next(keys)),
            LayerNorm=norm(),
        ),
        encoder=node(layer=[layer() for _ in range(LAYERS)]),
        pooler=node(dense=lin(H, H)),
    )


def _over_leading(fn, x):
    for _ in range(x.ndim - (1 if x.dtype.kind == "f" else 0)):
        fn = jax.vmap(fn)
    return fn(x)


def _eqx_run(model):
    return _bert_forward(
        model,
        IDS,
        TYPE_IDS,
        lambda mod, x: _over_leading(mod, x),
        lambda mod, i: _over_leading(mod, jnp.asarray(i)),
    )


# Linen: setup names the children as HF does (lists become layer_0, layer_1)


class _LinenSelf(nn.Module):
    def setup(self):
        self.query, self.key, self.value = nn.Dense(H), nn.Dense(H), nn.Dense(H)


class _LinenDenseNorm(nn.Module):
    def setup(self):
        self.dense = nn.Dense(H)
        self.LayerNorm = nn.LayerNorm(epsilon=EPS)


class _LinenDense(nn.Module):
    features: int

    def setup(self):
        self.dense = nn.Dense(self.features)


class _LinenAttention(nn.Module):
    def setup(self):
        self.self = _LinenSelf()
        self.output = _LinenDenseNorm()


class _LinenLayer(nn.Module):
    def setup(self):
        self.attention = _LinenAttention()
        self.intermediate = _LinenDense(INTER)
        self.output = _LinenDenseNorm()

    def __call__(self, x):
        return _layer(x, self, lambda mod, y: mod(y))


class _LinenEmbeddings(nn.Module):
    def setup(self):
        self.word_embeddings = nn.Embed(VOCAB, H)
        self.position_embeddings = nn.Embed(POS, H)
        self.token_type_embeddings = nn.Embed(TYPES, H)
        self.LayerNorm = nn.LayerNorm(epsilon=EPS)


class _LinenEncoder(nn.Module):
    def setup(self):
        self.layer = [_LinenLayer() for _ in range(LAYERS)]


class LinenBert(nn.Module):
    def setup(self):
        self.embeddings = _LinenEmbeddings()
        self.encoder = _LinenEncoder()
        self.pooler = _LinenDense(H)

    def __call__(self, ids, type_ids):
        return _bert_forward(self, ids, type_ids, lambda m, x: m(x), lambda m, i: m(i))


def _linen_target():
    module = LinenBert()
    return module, module.init(jax.random.key(0), IDS, TYPE_IDS)


def _linen_run(ported):
    module, variables = ported
    return module.apply(variables, IDS, TYPE_IDS)


FRAMEWORKS = {
    "nnx": (lambda: _nnx_bert(nnx.Rngs(0)), _nnx_run),
    "equinox": (lambda: _eqx_bert(jax.random.key(0)), _eqx_run),
    "linen": (_linen_target, _linen_run),
}


def _excess(got, expected) -> float:
    """How far the outputs are beyond `TOL` (`|a - b| - atol - rtol |b|`, the
    largest over every output): <= 0 when all are close. Outputs of another count
    are infinitely far."""
    got, expected = list(got), list(expected)
    if not expected or len(got) != len(expected):
        return float("inf")
    return max(
        float(np.max(np.abs(np.asarray(a) - b) - TOL["atol"] - TOL["rtol"] * np.abs(b)))
        for a, b in zip(got, expected)
    )


@pytest.mark.parametrize("fw", list(FRAMEWORKS))
def test_bert_module_and_back(fw):
    """From the module (classes known), and back into BertModel, strict."""
    hf = _bert()
    expected = _torch_out(hf)
    make, run = FRAMEWORKS[fw]
    ported = bridge.port(hf, make())
    assert _excess(run(ported), expected) <= 0
    fresh = transformers.BertModel(hf.config).eval()
    fresh.load_state_dict(bridge.port(ported, fresh), strict=True)
    assert _excess(_torch_out(fresh), expected) <= 0


@pytest.mark.parametrize("fw", ["nnx", "equinox"])
def test_bert_files_sharded_and_export(tmp_path, fw):
    """save_pretrained (one file, then sharded) -> load(like=...) -> save(layout=
    "torch") -> from_pretrained."""
    hf = _bert()
    expected = _torch_out(hf)
    make, run = FRAMEWORKS[fw]
    hf.save_pretrained(tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded/model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    for path in (
        tmp_path / "one/model.safetensors",
        tmp_path / "sharded",
        tmp_path / "sharded/model.safetensors.index.json",
    ):
        assert _excess(run(bridge.load(path, like=make())), expected) <= 0
    model = bridge.load(tmp_path / "sharded", like=make())
    out = tmp_path / "export"
    out.mkdir()
    hf.config.save_pretrained(out)
    bridge.save(out / "model.safetensors", model, layout="torch")
    again = transformers.BertModel.from_pretrained(out).eval()
    assert _excess(_torch_out(again), expected) <= 0


def test_bert_prefix_and_rules_round_trip(tmp_path):
    """A BertForMaskedLM-style file (names under `bert.`) into an NNX model whose
    encoder blocks are called `blocks`: prefix and rules on import, the same rules
    read backwards on export."""
    hf = _bert()
    expected = _torch_out(hf)
    state = {f"bert.{k}": v for k, v in hf.state_dict().items()}
    rules = {
        r"\.encoder\.layer\[(\d+)\]\.attention\.self\.(query|key|value)": (
            r".encoder.layer[\1].attention.self.\2"
        )
    }
    source = bridge.from_torch(state, prefix="bert.")
    ported = bridge.port(source, _nnx_bert(nnx.Rngs(0)), rules=rules)
    assert _excess(_nnx_run(ported), expected) <= 0
    bridge.save(
        tmp_path / "m.safetensors", ported, layout="torch", rules=rules, prefix="bert."
    )
    import safetensors.numpy

    saved = safetensors.numpy.load_file(tmp_path / "m.safetensors")
    assert set(saved) == set(state)
    for name, value in state.items():
        np.testing.assert_allclose(saved[name], value.numpy(), rtol=1e-6)


def test_bert_dtype_policy(tmp_path):
    """A bfloat16 file into a float32 model: an error by default, a PortWarning
    naming the layers with strict=False, cast with dtype=."""
    hf = _bert().to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    with pytest.raises(bridge.PortError, match="bfloat16 in the source"):
        bridge.load(tmp_path, like=_nnx_bert(nnx.Rngs(0)))
    source = bridge.load(tmp_path)
    with pytest.warns(bridge.PortWarning, match=r"pooler\.dense.*bfloat16 -> float32"):
        bridge.port(source, _nnx_bert(nnx.Rngs(0)), strict=False)
    model = bridge.load(tmp_path, like=_nnx_bert(nnx.Rngs(0)), dtype=jnp.bfloat16)
    assert model.pooler.dense.kernel[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(model.pooler.dense.kernel[...]).T.view("u2"),
        hf.pooler.dense.weight.detach().view(torch.int16).numpy().view("u2"),
    )


# --- ResNet: convolutions without bias and BatchNorm statistics ----------------------


def _resnet():
    config = transformers.ResNetConfig(
        num_channels=3,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        hidden_act="relu",
        downsample_in_first_stage=False,
    )
    torch.manual_seed(0)
    model = transformers.ResNetModel(config).eval()
    with torch.no_grad():  # statistics and affine parameters far from their init
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(torch.randn_like(b))
            elif name.endswith("running_var"):
                b.copy_(torch.rand_like(b) + 0.5)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


PIXELS = np.random.default_rng(1).normal(size=(2, 3, 16, 16)).astype("f4")


def _resnet_torch_out(model):
    with torch.no_grad():
        out = model(torch.from_numpy(PIXELS))
    return out.last_hidden_state.numpy(), out.pooler_output.numpy()


def _conv_layer(rngs, cin, cout, k, stride):
    return _node(
        convolution=nnx.Conv(
            cin, cout, (k, k), strides=stride, padding=k // 2, use_bias=False, rngs=rngs
        ),
        normalization=nnx.BatchNorm(
            cout, use_running_average=True, epsilon=1e-5, momentum=0.9, rngs=rngs
        ),
    )


def _nnx_resnet(rngs):
    def basic(cin, cout, stride):
        parts = {}
        if cin != cout or stride != 1:
            parts["shortcut"] = _conv_layer(rngs, cin, cout, 1, stride)
        parts["layer"] = nnx.List(
            [
                _conv_layer(rngs, cin, cout, 3, stride),
                _conv_layer(rngs, cout, cout, 3, 1),
            ]
        )
        return _node(**parts)

    return _node(
        embedder=_node(embedder=_conv_layer(rngs, 3, 8, 7, 2)),
        encoder=_node(
            stages=nnx.List(
                [
                    _node(layers=nnx.List([basic(8, 8, 1)])),
                    _node(layers=nnx.List([basic(8, 16, 2)])),
                ]
            )
        ),
    )


def _nnx_resnet_run(m):
    def conv_layer(c, x, act=True):
        x = c.normalization(c.convolution(x))
        return jax.nn.relu(x) if act else x

    x = conv_layer(m.embedder.embedder, jnp.moveaxis(PIXELS, 1, -1))
    x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for stage in m.encoder.stages:
        for block in stage.layers:
            skip = (
                conv_layer(block.shortcut, x, False) if "shortcut" in vars(block) else x
            )
            h = conv_layer(block.layer[1], conv_layer(block.layer[0], x), False)
            x = jax.nn.relu(h + skip)
    pooled = jnp.mean(x, axis=(1, 2), keepdims=True)
    return jnp.moveaxis(x, -1, 1), jnp.moveaxis(pooled, -1, 1)


def test_resnet_nnx_sharded_and_back(tmp_path):
    hf = _resnet()
    expected = _resnet_torch_out(hf)
    assert (
        _excess(_nnx_resnet_run(bridge.port(hf, _nnx_resnet(nnx.Rngs(0)))), expected)
        <= 0
    )
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="4KB")
    model = bridge.load(tmp_path / "sharded", like=_nnx_resnet(nnx.Rngs(0)))
    assert _excess(_nnx_resnet_run(model), expected) <= 0
    fresh = transformers.ResNetModel(hf.config).eval()
    fresh.load_state_dict(bridge.port(model, fresh), strict=True)
    assert _excess(_resnet_torch_out(fresh), expected) <= 0
    out = tmp_path / "export"
    out.mkdir()
    hf.config.save_pretrained(out)
    bridge.save(out / "model.safetensors", model, layout="torch")
    assert (
        _excess(
            _resnet_torch_out(transformers.ResNetModel.from_pretrained(out)), expected
        )
        <= 0
    )
