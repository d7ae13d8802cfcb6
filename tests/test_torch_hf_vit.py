"""Hugging Face `ViTModel` (small config, random weights, no download) ported into the
same ViT written in NNX and Equinox: a patch convolution, loose `cls_token` and
`position_embeddings` arrays next to it, pre-norm encoder layers. Outputs equal to
transformers' forward; back into a fresh `ViTModel` (strict), and through a sharded
`save_pretrained` folder, `layout="torch"` and `from_pretrained`: outputs equal
again. Skipped without torch and transformers (`nox -s tests_torch`).

transformers v5 names the module's layers `layers.0.attention.q_proj`, but
`save_pretrained` (and the hub's files) keep the names of v4:
`encoder.layer.0.attention.attention.query`. The test model is named as the module;
the file pairs with it through `FILE_RULES`, read backwards on export."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

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
    perturb,
)


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, requires("NNX")]

H, HEADS, INTER, LAYERS, EPS = 32, 2, 64, 2, 1e-12
CHANNELS, IMAGE, PATCH = 3, 8, 4
TOKENS = (IMAGE // PATCH) ** 2 + 1  # the patches and the class token
PIXELS = np.random.default_rng(2).normal(size=(2, CHANNELS, IMAGE, IMAGE))
PIXELS = PIXELS.astype("f4")


def _hf():
    config = transformers.ViTConfig(
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTER,
        image_size=IMAGE,
        patch_size=PATCH,
        num_channels=CHANNELS,
        layer_norm_eps=EPS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return perturb(transformers.ViTModel(config), torch)


def _torch_out(model):
    with torch.no_grad():
        out = model(pixel_values=torch.from_numpy(PIXELS))
    return out.last_hidden_state.numpy(), out.pooler_output.numpy()


# --- the same ViT, written once over each framework's layers -------------------------


class Ops(NamedTuple):
    """How a framework runs a layer on `(..., features)`, reads a loose array, and
    embeds NCHW pixels into `(batch, patches, H)` with a convolution."""

    call: Any
    value: Any
    patches: Any


def _vit_forward(m, ops: Ops):
    e = m.embeddings
    patches = ops.patches(e.patch_embeddings.projection, PIXELS)
    cls = jnp.broadcast_to(ops.value(e.cls_token), (patches.shape[0], 1, H))
    x = jnp.concatenate([cls, patches], axis=1) + ops.value(e.position_embeddings)
    for layer in m.layers:
        a = layer.attention
        y = ops.call(layer.layernorm_before, x)
        q, k, v = (ops.call(p, y) for p in (a.q_proj, a.k_proj, a.v_proj))
        x = x + ops.call(a.o_proj, attention(q, k, v, HEADS))
        y = ops.call(layer.layernorm_after, x)
        h = jax.nn.gelu(ops.call(layer.mlp.fc1, y), approximate=False)
        x = x + ops.call(layer.mlp.fc2, h)
    x = ops.call(m.layernorm, x)
    return x, jnp.tanh(ops.call(m.pooler.dense, x[:, 0]))


def _vit(layers: Layers):
    """The ViT, named as transformers v5 names ViTModel's modules."""
    lin, norm, node = layers.linear, lambda: layers.norm(H, EPS), layers.node

    def layer():
        return node(
            attention=node(
                q_proj=lin(H, H), k_proj=lin(H, H), v_proj=lin(H, H), o_proj=lin(H, H)
            ),
            layernorm_before=norm(),
            layernorm_after=norm(),
            mlp=node(fc1=lin(H, INTER), fc2=lin(INTER, H)),
        )

    return node(
        embeddings=node(
            cls_token=layers.array((1, 1, H)),
            position_embeddings=layers.array((1, TOKENS, H)),
            patch_embeddings=node(projection=layers.conv(CHANNELS, H, PATCH, PATCH)),
        ),
        layers=layers.seq([layer() for _ in range(LAYERS)]),
        layernorm=norm(),
        pooler=node(dense=lin(H, H)),
    )


def _nnx_patches(conv, pixels):
    y = conv(jnp.moveaxis(pixels, 1, -1))  # NHWC, patches in row-major order
    return jnp.reshape(y, (y.shape[0], -1, H))


def _eqx_patches(conv, pixels):
    y = jax.vmap(conv)(jnp.asarray(pixels))  # (batch, H, h, w)
    return jnp.swapaxes(jnp.reshape(y, (y.shape[0], H, -1)), 1, 2)


FRAMEWORKS = {
    "nnx": (
        lambda: _vit(nnx_layers()),
        Ops(nnx_call, lambda p: p[...], _nnx_patches),
    ),
    "equinox": (lambda: _vit(eqx_layers()), Ops(eqx_call, lambda a: a, _eqx_patches)),
}

_LAYER = r"\.encoder\.layer\[(\d+)\]"
FILE_RULES = {
    **{
        rf"{_LAYER}\.attention\.attention\.{old}": rf".layers[\1].attention.{new}"
        for old, new in [("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")]
    },
    rf"{_LAYER}\.attention\.output\.dense": r".layers[\1].attention.o_proj",
    rf"{_LAYER}\.intermediate\.dense": r".layers[\1].mlp.fc1",
    rf"{_LAYER}\.output\.dense": r".layers[\1].mlp.fc2",
    rf"{_LAYER}\.(layernorm_before|layernorm_after)": r".layers[\1].\2",
}
"""The names of a ViT file (v4's, `save_pretrained`'s) -> the module's (v5's)."""


@pytest.mark.parametrize("fw", list(FRAMEWORKS))
def test_vit_module_files_and_back(tmp_path, fw):
    """From the module; back into ViTModel (strict); from a sharded save_pretrained
    folder; exported with layout="torch" and read by from_pretrained."""
    hf = _hf()
    expected = _torch_out(hf)
    make, ops = FRAMEWORKS[fw]
    ported = bridge.port(hf, make())
    assert excess(_vit_forward(ported, ops), expected) <= 0
    fresh = transformers.ViTModel(hf.config).eval()
    fresh.load_state_dict(bridge.port(ported, fresh), strict=True)
    assert excess(_torch_out(fresh), expected) <= 0
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    model = bridge.port(bridge.load(tmp_path / "sharded"), make(), rules=FILE_RULES)
    assert excess(_vit_forward(model, ops), expected) <= 0
    again = export(tmp_path / "export", model, hf, rules=FILE_RULES)
    saved = safetensors.numpy.load_file(tmp_path / "export/model.safetensors")
    shards = (tmp_path / "sharded").glob("*.safetensors")
    assert set(saved) == set().union(*map(safetensors.numpy.load_file, shards))
    assert excess(_torch_out(again), expected) <= 0
