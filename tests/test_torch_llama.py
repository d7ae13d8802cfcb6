"""transformers' `LlamaForCausalLM` (its module) ported into a Llama written in NNX:
Hugging Face norm classes (`LlamaRMSNorm`, `Qwen2RMSNorm`) are recognised by their
structure, not an exact class name; logits compared with transformers' own."""

import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import requires
from .llamas import LlamaForCausalLM, llama_config, tokens


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = requires("NNX")


def _hf_logits(model, ids):
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(ids), dtype=torch.long))
    return out.logits.numpy()


def test_llama_module_into_nnx_llama_without_rules():
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(llama_config()).eval()
    plan = bridge.port_plan(hf, LlamaForCausalLM(nnx.Rngs(0)))
    assert not plan.problems, plan.problems
    norms = {s.source: s.kind for s in plan.steps if "norm" in s.source}
    assert norms[".model.norm"] == "RMSNorm"
    assert norms[".model.layers[1].post_attention_layernorm"] == "RMSNorm"
    ported = bridge.port(hf, LlamaForCausalLM(nnx.Rngs(0)))
    ids = tokens()
    diff = np.max(np.abs(np.asarray(ported(ids)) - _hf_logits(hf, ids)))
    assert diff < 1e-4


def test_hf_norm_epsilon_read_from_variance_epsilon():
    """`LlamaRMSNorm.variance_epsilon` is the setting compared with Flax's epsilon:
    a mismatch warns."""
    cfg = llama_config()
    cfg.rms_norm_eps = 1e-5
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with pytest.warns(bridge.PortWarning, match=r"epsilon is 1e-05 in the source"):
        bridge.port(hf, LlamaForCausalLM(nnx.Rngs(0)))


def test_qwen2_norms_are_rms_norms():
    qwen = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")
    norm = qwen.Qwen2RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_()
    ported = bridge.port(norm, nnx.RMSNorm(8, epsilon=1e-6, rngs=nnx.Rngs(0)))
    assert np.array_equal(np.asarray(ported.scale[...]), norm.weight.detach().numpy())
