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
    assert refused.value.problems[0].startswith(
        "The PyTorch side of this Tree could not be traced: its config.json is not "
    )  # the reason first, in one line
    assert "Without the source's trace, example= cannot pair" in str(refused.value)
    assert "Give example inputs" not in str(refused.value)


class _Registered(torch.nn.Module):
    """Two same-shape layers registered (created) in the order `zeta`, `alpha`:
    the names sort the other way."""

    def __init__(self):
        super().__init__()
        self.zeta = torch.nn.Linear(4, 4)
        self.alpha = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.alpha(torch.tanh(self.zeta(x)))


class _UpDown(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(4, 4, rngs=rngs)
        self.down = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.numpy.tanh(self.up(x)))


def test_a_torch_module_pairs_in_registration_order_without_example():
    """A torch module registers its submodules in the order `__init__` creates
    them (not the keys of a dict): with NNX's unsorted attributes on the other
    side, the two pair in creation order with no example inputs, both ways."""
    module, model = _Registered(), _UpDown(nnx.Rngs(0))
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    plan = bridge.port_plan(module, model)
    assert {(s.source, s.target, s.by) for s in plan.steps} == {
        (".zeta", ".up", "order"),
        (".alpha", ".down", "order"),
    }
    ported = bridge.port(module, model)
    np.testing.assert_allclose(
        ported(x), module(torch.from_numpy(x)).detach().numpy(), atol=1e-6
    )
    back = _Registered()
    back.load_state_dict(bridge.port(ported, back), strict=True)
    np.testing.assert_allclose(
        back(torch.from_numpy(x)).detach().numpy(), ported(x), atol=1e-6
    )


class _Mixed(torch.nn.Module):
    """A parameter of the module and one of a submodule, alike: torch keeps the
    two in separate dicts, so which was created first is not recorded."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Module()
        self.inner.scale = torch.nn.Parameter(torch.ones(4))
        self.shift = torch.nn.Parameter(torch.zeros(4))


class _MixedNNX(nnx.Module):
    def __init__(self):
        self.b = nnx.Param(jax.numpy.ones(4))
        self.a = nnx.Param(jax.numpy.zeros(4))


def test_a_torch_parameter_and_a_submodule_are_not_ordered():
    """A module's own parameter against a submodule's: not ordered (torch's
    `state_dict` lists own parameters first, whatever was created first), so two
    alike are refused as ambiguous instead of paired by that listing."""
    with pytest.raises(bridge.PortError, match=r"ambiguous: .*\.inner\.scale"):
        bridge.port(_Mixed(), _MixedNNX())
