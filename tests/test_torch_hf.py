"""Hugging Face models from small configs with random weights (no download), saved
with `save_pretrained` (one file and sharded), ported into the same model written in
NNX, Equinox and Linen: outputs equal to transformers' forward; exported back with
`layout="torch"` and read by `from_pretrained`: outputs equal again. Skipped without
torch and transformers (`nox -s tests_torch` installs them)."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import requires
from .hf_common import (
    Layers,
    attention,
    eqx_call,
    eqx_layers,
    excess,
    export,
    nnx_call,
    nnx_layers,
    node,
    perturb,
)


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# minutes of compilation: `nox -s tests_torch` runs them, the fast suite does not
pytestmark = [pytest.mark.slow, requires("NNX")]

H, HEADS, INTER, VOCAB, POS, TYPES, LAYERS = 32, 2, 64, 50, 16, 2, 2
EPS = 1e-12


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
    return perturb(transformers.BertModel(config), torch)


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
    return attention(query(x), key(x), value(x), HEADS)


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


def _bert_model(layers: Layers):
    """BertModel's layers, named as transformers names them."""
    lin, norm, node = layers.linear, lambda: layers.norm(H, EPS), layers.node

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
            word_embeddings=layers.embed(VOCAB, H),
            position_embeddings=layers.embed(POS, H),
            token_type_embeddings=layers.embed(TYPES, H),
            LayerNorm=norm(),
        ),
        encoder=node(layer=layers.seq([layer() for _ in range(LAYERS)])),
        pooler=node(dense=lin(H, H)),
    )


def _nnx_bert():
    return _bert_model(nnx_layers())


def _nnx_run(model):
    return _bert_forward(model, IDS, TYPE_IDS, nnx_call, nnx_call)


def _eqx_run(model):
    return _bert_forward(
        model,
        IDS,
        TYPE_IDS,
        eqx_call,
        eqx_call,
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
    "nnx": (_nnx_bert, _nnx_run),
    "equinox": (lambda: _bert_model(eqx_layers()), _eqx_run),
    "linen": (_linen_target, _linen_run),
}


@pytest.mark.parametrize("fw", list(FRAMEWORKS))
def test_bert_module_and_back(fw):
    """From the module (classes known), and back into BertModel, strict."""
    hf = _bert()
    expected = _torch_out(hf)
    make, run = FRAMEWORKS[fw]
    ported = bridge.port(hf, make())
    assert excess(run(ported), expected) <= 0
    fresh = transformers.BertModel(hf.config).eval()
    fresh.load_state_dict(bridge.port(ported, fresh), strict=True)
    assert excess(_torch_out(fresh), expected) <= 0


@pytest.mark.parametrize("fw", list(FRAMEWORKS))
def test_bert_files_sharded_and_export(tmp_path, fw):
    """save_pretrained (one file, then sharded) -> load(like=...) -> save(layout=
    "torch") -> from_pretrained. Linen's `setup` list `encoder.layer` (named
    `layer_0`, `layer_1`) is written as `encoder.layer.0`, `nn.ModuleList`'s names,
    with no reference to read them from."""
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
        assert excess(run(bridge.load(path, like=make())), expected) <= 0
    model = bridge.load(tmp_path / "sharded", like=make())
    assert excess(_torch_out(export(tmp_path / "export", model, hf)), expected) <= 0


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
    ported = bridge.port(source, _nnx_bert(), rules=rules)
    assert excess(_nnx_run(ported), expected) <= 0
    bridge.save_state_dict(
        tmp_path / "m.safetensors", ported, rules=rules, prefix="bert."
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
        bridge.load(tmp_path, like=_nnx_bert())
    source = bridge.load(tmp_path)
    with pytest.warns(bridge.PortWarning, match=r"pooler\.dense.*bfloat16 -> float32"):
        bridge.port(source, _nnx_bert(), strict=False)
    model = bridge.load(tmp_path, like=_nnx_bert(), dtype=jnp.bfloat16)
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
    with torch.no_grad():  # statistics far from their init
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(torch.randn_like(b))
            elif name.endswith("running_var"):
                b.copy_(torch.rand_like(b) + 0.5)
    return perturb(model, torch)


PIXELS = np.random.default_rng(1).normal(size=(2, 3, 16, 16)).astype("f4")


def _resnet_torch_out(model):
    with torch.no_grad():
        out = model(torch.from_numpy(PIXELS))
    return out.last_hidden_state.numpy(), out.pooler_output.numpy()


def _conv_layer(rngs, cin, cout, k, stride):
    return node(
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
        return node(**parts)

    return node(
        embedder=node(embedder=_conv_layer(rngs, 3, 8, 7, 2)),
        encoder=node(
            stages=nnx.List(
                [
                    node(layers=nnx.List([basic(8, 8, 1)])),
                    node(layers=nnx.List([basic(8, 16, 2)])),
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
        excess(_nnx_resnet_run(bridge.port(hf, _nnx_resnet(nnx.Rngs(0)))), expected)
        <= 0
    )
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="4KB")
    model = bridge.load(tmp_path / "sharded", like=_nnx_resnet(nnx.Rngs(0)))
    assert excess(_nnx_resnet_run(model), expected) <= 0
    fresh = transformers.ResNetModel(hf.config).eval()
    fresh.load_state_dict(bridge.port(model, fresh), strict=True)
    assert excess(_resnet_torch_out(fresh), expected) <= 0
    again = export(tmp_path / "export", model, hf)
    assert excess(_resnet_torch_out(again), expected) <= 0
