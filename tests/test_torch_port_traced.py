"""A Hugging Face folder (or a torch module) ported into a model with its own names,
no rules: both forward passes are traced on one example input (the PyTorch one on
fake tensors built from the folder's `config.json`), and the order in which each
uses its parameters pairs them (issue 37)."""

import jax
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import requires
from .llamas import (
    DIM,
    EPS,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    VOCAB,
    attend,
    llama_config,
    rotary,
    rotate,
    tokens,
)


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = requires("NNX")


class Block(nnx.Module):
    """A Llama decoder layer with names of its own, created in another order than
    it is called (`wo` first, the norms last)."""

    def __init__(self, rngs):
        hd = DIM // HEADS
        self.wo = nnx.Linear(HEADS * hd, DIM, use_bias=False, rngs=rngs)
        self.w_down = nnx.Linear(HIDDEN, DIM, use_bias=False, rngs=rngs)
        self.wv = nnx.Linear(DIM, KV_HEADS * hd, use_bias=False, rngs=rngs)
        self.wk = nnx.Linear(DIM, KV_HEADS * hd, use_bias=False, rngs=rngs)
        self.wq = nnx.Linear(DIM, HEADS * hd, use_bias=False, rngs=rngs)
        self.w_in = nnx.Linear(DIM, HIDDEN, use_bias=False, rngs=rngs)
        self.w_gate = nnx.Linear(DIM, HIDDEN, use_bias=False, rngs=rngs)
        self.pre_ffn = nnx.RMSNorm(DIM, epsilon=EPS, rngs=rngs)
        self.pre_attn = nnx.RMSNorm(DIM, epsilon=EPS, rngs=rngs)

    def __call__(self, x, cos, sin):
        b, t, _ = x.shape
        hd = DIM // HEADS
        h = self.pre_attn(x)
        q = rotate(self.wq(h).reshape(b, t, HEADS, hd), cos, sin)
        k = rotate(self.wk(h).reshape(b, t, KV_HEADS, hd), cos, sin)
        v = self.wv(h).reshape(b, t, KV_HEADS, hd)
        x = x + self.wo(attend(q, k, v).reshape(b, t, DIM))
        h = self.pre_ffn(x)
        return x + self.w_down(jax.nn.silu(self.w_gate(h)) * self.w_in(h))


class Decoder(nnx.Module):
    def __init__(self, rngs):
        self.out = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)
        self.final = nnx.RMSNorm(DIM, epsilon=EPS, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.vocab = nnx.Embed(VOCAB, DIM, rngs=rngs)

    def __call__(self, ids):
        cos, sin = rotary(ids.shape[1], DIM // HEADS)
        x = self.vocab(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.out(self.final(x))


def _hf():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config()).eval()


def _logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(ids))).logits.numpy()


def test_folder_into_own_names_by_both_traces(tmp_path):
    """No rules, no name in common: refused without example inputs (nothing tells
    the order of a file's layers), exact with one."""
    hf = _hf()
    hf.save_pretrained(tmp_path / "hf")
    ids = tokens()
    with pytest.raises(bridge.PortError, match="ambiguous"):
        bridge.load(tmp_path / "hf", like=Decoder(nnx.Rngs(0)))
    model = bridge.load(tmp_path / "hf", like=Decoder(nnx.Rngs(0)), example=(ids,))
    np.testing.assert_allclose(model(ids), _logits(hf, ids), atol=1e-5, rtol=1e-5)


def test_module_into_own_names_by_both_traces():
    """The torch module itself: the same, its forward pass traced as it is."""
    hf = _hf()
    ids = tokens()
    model = bridge.port(hf, Decoder(nnx.Rngs(0)), example=(ids,))
    np.testing.assert_allclose(model(ids), _logits(hf, ids), atol=1e-5, rtol=1e-5)
    fresh = _hf()
    state = bridge.port(model, fresh, example=(ids,))  # and back: a state dict
    fresh.load_state_dict(state, strict=True)
    for name, tensor in hf.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_without_a_trace_the_refusal_says_which_side(tmp_path):
    """A folder whose model cannot be built (a model type transformers does not
    know): the port is refused, saying the source has no forward pass and why, not
    asking for example inputs that were given."""
    hf = _hf()
    hf.save_pretrained(tmp_path / "hf")
    config = tmp_path / "hf" / "config.json"
    text = config.read_text().replace("LlamaForCausalLM", "NoSuchModel")
    config.write_text(text.replace('"llama"', '"no_such_type"'))
    with pytest.raises(bridge.PortError) as refused:
        bridge.load(tmp_path / "hf", like=Decoder(nnx.Rngs(0)), example=(tokens(),))
    assert "the source has no forward pass to trace" in str(refused.value)
    assert "Give example inputs" not in str(refused.value)
