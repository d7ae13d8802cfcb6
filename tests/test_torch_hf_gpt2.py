"""Hugging Face GPT-2 (tiny config, random weights, no download): `Conv1D` weights
stored `(in, out)`, the fused `c_attn`, and `lm_head.weight` tied to `wte.weight`.
Ported into the same GPT-2 written in NNX and Equinox in the two forms the guide
documents: `c_attn` split into `query`/`key`/`value` layers (`bridge.from_torch(...,
split=...)`), or one fused Dense `c_attn` (the codecs read a `Conv1D` as a Dense).
Outputs equal to transformers' forward; exported back, read by `load_state_dict`
(strict) and `from_pretrained`: outputs equal again. Skipped without torch and
transformers (`nox -s tests_torch`)."""

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

E, HEADS, LAYERS, VOCAB, POS, EPS = 32, 2, 2, 50, 16, 1e-5
IDS = np.array([[1, 5, 9, 3, 7, 2], [4, 4, 8, 0, 11, 6]])
SPLIT = {r"h\.\d+\.attn\.c_attn": ("query", "key", "value")}
PREFIX = "transformer."  # GPT2LMHeadModel's base_model_prefix


def _config():
    return transformers.GPT2Config(
        n_embd=E,
        n_layer=LAYERS,
        n_head=HEADS,
        vocab_size=VOCAB,
        n_positions=POS,
        layer_norm_epsilon=EPS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def _hf(cls):
    torch.manual_seed(0)
    return perturb(cls(_config()), torch)


def _torch_out(model):
    """The last hidden state (after `ln_f`), and the logits of an LM head."""
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(IDS), output_hidden_states=True)
    hidden = out.hidden_states[-1].numpy()
    return (hidden, out.logits.numpy()) if hasattr(out, "logits") else (hidden,)


# --- the same GPT-2, written once over each framework's layers -----------------------


def _gpt2_forward(m, call, logits=None):
    n = IDS.shape[1]
    x = call(m.wte, IDS) + call(m.wpe, np.arange(n)[None])
    for block in m.h:
        a, y = block.attn, call(block.ln_1, x)
        fused = getattr(a, "c_attn", None)
        if fused is not None:
            q, k, v = jnp.split(call(fused, y), 3, axis=-1)
        else:
            q, k, v = call(a.query, y), call(a.key, y), call(a.value, y)
        x = x + call(a.c_proj, attention(q, k, v, HEADS, causal=True))
        h = jax.nn.gelu(call(block.mlp.c_fc, call(block.ln_2, x)), approximate=True)
        x = x + call(block.mlp.c_proj, h)
    x = call(m.ln_f, x)
    return (x,) if logits is None else (x, logits(m.wte, x))


def _gpt2(layers: Layers, fused: bool):
    """GPT2Model's layers, `c_attn` fused or as `query`, `key`, `value`."""
    lin, norm, node = layers.linear, lambda: layers.norm(E, EPS), layers.node

    def attn():
        if fused:
            return node(c_attn=lin(E, 3 * E), c_proj=lin(E, E))
        qkv = dict(query=lin(E, E), key=lin(E, E), value=lin(E, E))
        return node(**qkv, c_proj=lin(E, E))

    def block():
        return node(
            ln_1=norm(),
            attn=attn(),
            ln_2=norm(),
            mlp=node(c_fc=lin(E, 4 * E), c_proj=lin(4 * E, E)),
        )

    return node(
        wte=layers.embed(VOCAB, E),
        wpe=layers.embed(POS, E),
        h=layers.seq([block() for _ in range(LAYERS)]),
        ln_f=norm(),
    )


FRAMEWORKS = {
    # make(fused), call, the tied LM head: logits = x @ wte^T
    "nnx": (
        lambda fused: _gpt2(nnx_layers(), fused),
        nnx_call,
        lambda wte, x: wte.attend(x),
    ),
    "equinox": (
        lambda fused: _gpt2(eqx_layers(), fused),
        eqx_call,
        lambda wte, x: x @ wte.weight.T,
    ),
}


@pytest.mark.parametrize("fw", list(FRAMEWORKS))
def test_gpt2_lm_split_qkv_and_back(tmp_path, fw):
    """GPT2LMHeadModel: `c_attn` split on import, fused again on export; the tie
    reported by the plan and written back (one array under both names)."""
    hf = _hf(transformers.GPT2LMHeadModel)
    expected = _torch_out(hf)
    make, call, logits = FRAMEWORKS[fw]
    source = bridge.from_torch(hf, prefix=PREFIX, split=SPLIT)
    assert "lm_head.weight = wte.weight" in str(bridge.port_plan(source, make(False)))
    ported = bridge.port(source, make(False))
    assert excess(_gpt2_forward(ported, call, logits), expected) <= 0
    fresh = transformers.GPT2LMHeadModel(hf.config).eval()
    back = bridge.port(ported, bridge.from_torch(fresh, prefix=PREFIX, split=SPLIT))
    state = bridge.to_torch(back, tensors=True)
    assert (
        state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    )
    fresh.load_state_dict(state, strict=True)
    assert excess(_torch_out(fresh), expected) <= 0
    again = export(tmp_path / "export", back, hf)
    assert excess(_torch_out(again), expected) <= 0


@pytest.mark.parametrize("fw", list(FRAMEWORKS))
def test_gpt2_fused_from_file_and_export(tmp_path, fw):
    """GPT2Model's file (no classes) into a fused `c_attn` Dense: the Conv1D layout
    told by the bias and, for the square `attn.c_proj`, by the name; written back
    under the same names and layouts."""
    hf = _hf(transformers.GPT2Model)
    expected = _torch_out(hf)
    make, call, _ = FRAMEWORKS[fw]
    hf.save_pretrained(tmp_path / "hf")
    model = bridge.load(tmp_path / "hf", like=make(True))
    assert excess(_gpt2_forward(model, call), expected) <= 0
    again = export(tmp_path / "export", model, hf)
    assert excess(_torch_out(again), expected) <= 0
    saved = safetensors.numpy.load_file(tmp_path / "export/model.safetensors")
    original = safetensors.numpy.load_file(tmp_path / "hf/model.safetensors")
    assert saved.keys() == original.keys()
    for name, value in original.items():  # (in, out) kept: bits unchanged
        np.testing.assert_array_equal(saved[name], value)


def test_gpt2_file_split_needs_the_state_dict(tmp_path):
    """A file's tree is split by giving its state dict to `from_torch`; a state dict
    records no classes, and GPT-2's square `attn.c_proj` under its Conv1D name may be
    stored either way (GPT-Neo's `c_proj` is an `nn.Linear`): refused, never guessed.
    The module's classes tell, and its split parts port into query/key/value
    layers."""
    hf = _hf(transformers.GPT2Model)
    hf.save_pretrained(tmp_path / "hf")
    state = bridge.to_torch(bridge.load(tmp_path / "hf"))
    with pytest.raises(
        bridge.PortError, match=r"(?s)attn\.c_proj holds a square weight"
    ):
        bridge.port(bridge.from_torch(state, split=SPLIT), _gpt2(nnx_layers(), False))
    ported = bridge.port(bridge.from_torch(hf, split=SPLIT), _gpt2(nnx_layers(), False))
    assert excess(_gpt2_forward(ported, nnx_call), _torch_out(hf)) <= 0
