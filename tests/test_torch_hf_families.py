"""The Hugging Face families people bring beyond Llama: Qwen2 (q/k/v biases), Qwen3
(an RMSNorm per head of q and k), Mistral and Phi-3 (fused `qkv_proj` and
`gate_up_proj`), tiny (transformers, random weights, no download). Each one's
`save_pretrained` folder is loaded with `bridge.load(folder, like=abstract model)`
into the same model written in NNX (a module per layer) and in Equinox (the layers
one `eqx.filter_vmap` stack), with no rules: logits as transformers'. Written back
with `bridge.save(folder, model, layout="torch", config=...)`,
`AutoModelForCausalLM.from_pretrained` opens it: the same weights, the same logits.
Skipped without torch and transformers (`nox -s tests_torch`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge

from .helpers import requires


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, requires("NNX")]

from .hf_families import FAMILIES, CausalLM, EqxCausalLM, hf_model  # noqa: E402


IDS = np.array([[1, 5, 9, 3, 7, 2, 11, 40], [4, 8, 15, 16, 23, 42, 0, 95]])
# float32 through other summation orders (matmuls, softmax): 2e-6 measured on logits
# of magnitude ~3; a misplaced or transposed weight moves them by 0.1 or more
TOL = dict(rtol=1e-5, atol=1e-5)


def _logits(hf):
    with torch.no_grad():
        return hf(torch.tensor(IDS)).logits.numpy()


def _abstract(fw, family):
    if fw == "nnx":
        return nnx.eval_shape(lambda: CausalLM(family, nnx.Rngs(0)))
    return eqx.filter_eval_shape(EqxCausalLM, family, jax.random.key(0))


def _run(fw, model):
    ids = jnp.asarray(IDS)
    return np.asarray(model(ids) if fw == "nnx" else jax.vmap(model)(ids))


@pytest.mark.parametrize("fw", ["nnx", "equinox"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_folder_in_and_out_without_rules(tmp_path, name, fw):
    hf = hf_model(name, torch, transformers)
    hf.save_pretrained(tmp_path / "hf")
    target = _abstract(fw, FAMILIES[name])
    plan = bridge.port_plan(bridge.load(tmp_path / "hf"), target)
    assert not plan.problems, plan.problems
    assert {s.by for s in plan.steps} == {"path"}, plan  # every layer by its name
    model = bridge.load(tmp_path / "hf", like=target)
    expected = _logits(hf)
    np.testing.assert_allclose(_run(fw, model), expected, **TOL)

    bridge.save(tmp_path / "out", model, layout="torch", config=hf.config)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(hf)
    loaded = back.state_dict()
    assert loaded.keys() == hf.state_dict().keys()
    assert all(torch.equal(v, loaded[k]) for k, v in hf.state_dict().items())
    assert np.array_equal(_logits(back), expected)


# Hugging Face RMSNorms computing `x * (1 + weight)` under names that do not start with
# "Gemma" (transformers 5.x); their weight is not Flax's RMSNorm scale
OFFSET_NORMS = [
    ("qwen3_next", "Qwen3NextRMSNorm"),
    ("qwen3_5", "Qwen3_5RMSNorm"),
    ("vaultgemma", "VaultGemmaRMSNorm"),
    ("recurrent_gemma", "RecurrentGemmaRMSNorm"),
]


@pytest.mark.parametrize("family,cls", OFFSET_NORMS)
def test_a_norm_computing_one_plus_weight_is_not_a_flax_rms_norm(family, cls):
    """Ported as Flax's RMSNorm, such a norm's output would change (by 2.1 on this
    input, measured before the fix): it is refused, naming the layer."""
    module = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    norm = getattr(module, cls)(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_()
    with pytest.raises(bridge.PortError, match=r"unexpected: source layer \.weight"):
        bridge.port(norm, nnx.RMSNorm(8, epsilon=1e-6, rngs=nnx.Rngs(0)))
