"""The Hugging Face families people bring beyond Llama: Qwen2 (q/k/v biases), Qwen3
(an RMSNorm per head of q and k), Mistral and Phi-3 (fused `qkv_proj` and
`gate_up_proj`), tiny (transformers, random weights, no download). Each one's
`save_pretrained` folder is loaded with `bridge.load(folder, like=abstract model)`
into the same model written in NNX (a module per layer) and in Equinox (the layers
one `eqx.filter_vmap` stack), with no rules: logits as transformers'. Written back
with `bridge.save_pretrained(folder, model, config=...)`,
`AutoModelForCausalLM.from_pretrained` opens it: the same weights, the same logits.
Gemma's norms compute `x * (1 + weight)`: refused into Flax's RMSNorm (from a folder,
told by its `config.json`), loaded into a norm of that kind (`same_layout`).
Skipped without torch and transformers (`nox -s tests_torch`)."""

import importlib

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

from .hf_families import (  # noqa: E402
    FAMILIES,
    GEMMA,
    HEAD_DIM,
    HEADS,
    KV,
    CausalLM,
    EqxCausalLM,
    EqxGemmaNorm,
    GemmaNorm,
    hf_model,
)


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
    hf = hf_model(FAMILIES[name], torch, transformers)
    hf.save_pretrained(tmp_path / "hf")
    target = _abstract(fw, FAMILIES[name])
    plan = bridge.port_plan(bridge.load(tmp_path / "hf"), target)
    assert not plan.problems, plan.problems
    assert {s.by for s in plan.steps} == {"path"}, plan  # every layer by its name
    model = bridge.load(tmp_path / "hf", like=target)
    expected = _logits(hf)
    np.testing.assert_allclose(_run(fw, model), expected, **TOL)

    bridge.save_pretrained(tmp_path / "out", model, config=hf.config)
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


def test_the_folder_families_of_offset_norms_are_transformers():
    """Each `model_type` whose folders' norms are read as `x * (1 + weight)` is one
    whose transformers modeling file has such an RMSNorm (checked on its source)."""
    from transformers import CONFIG_MAPPING

    from bridge._families._offset_norms import MODEL_TYPES, one_plus_weight

    for model_type in sorted(MODEL_TYPES):
        config = CONFIG_MAPPING[model_type]
        modeling = config.__module__.replace(".configuration_", ".modeling_")
        module = importlib.import_module(modeling)
        norms = [
            c
            for name, c in vars(module).items()
            if name.endswith("RMSNorm") and isinstance(c, type)
        ]
        assert any(one_plus_weight(c) for c in norms), (model_type, norms)


@pytest.mark.parametrize("family,cls", OFFSET_NORMS)
def test_a_norm_computing_one_plus_weight_is_not_a_flax_rms_norm(family, cls):
    """Ported as Flax's RMSNorm, such a norm's output moved by 2.1 (measured before
    the fix, with no error): it is refused, naming the layer and the fix."""
    module = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    norm = getattr(module, cls)(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_()
    with pytest.raises(bridge.PortError, match=r"1 source layer\(s\) \(\(root\)\) com"):
        bridge.port(norm, nnx.RMSNorm(8, epsilon=1e-6, rngs=nnx.Rngs(0)))


# --- Gemma: norms computing x * (1 + weight) ------------------------------------------


@pytest.fixture
def gemma_norm():
    """`GemmaNorm` (NNX) and `EqxGemmaNorm` (`scale` both) registered as the layer
    kind of Hugging Face's Gemma norms, as docs/guides/torch-layouts.md says."""
    norms = [GemmaNorm, EqxGemmaNorm]
    built_in = bridge.unregister_codec("GemmaRMSNorm", "nnx")
    built_in += bridge.unregister_codec("GemmaRMSNorm", "equinox")
    bridge.register_codec(*bridge.Codec.same_layout("GemmaRMSNorm", norms))
    yield
    bridge.unregister_codec("GemmaRMSNorm", "nnx")
    bridge.unregister_codec("GemmaRMSNorm", "equinox")
    bridge.register_codec(*built_in)  # bridge's own, for norms written by hand


def _gemma_with_flax_norms():
    """Gemma written with Flax's RMSNorm (`x * scale`): not what Gemma computes."""
    return nnx.eval_shape(lambda: CausalLM(GEMMA._replace(gemma=False), nnx.Rngs(0)))


def test_gemma_folder_into_flax_rms_norms_is_refused(tmp_path):
    """Loaded as Flax RMSNorm scales, Gemma's norm weights moved the logits by 4.2
    (measured before the fix), with no error."""
    hf = hf_model(GEMMA, torch, transformers)
    hf.save_pretrained(tmp_path / "hf")
    target = _gemma_with_flax_norms()
    del target.lm_head  # Gemma ties it to the embedding
    with pytest.raises(bridge.PortError) as info:
        bridge.load(tmp_path / "hf", like=target)
    message = str(info.value)
    assert "unexpected: source layer .model.norm (GemmaRMSNorm: scale (32,))" in message
    assert "missing: target layer .model.norm (RMSNorm: scale (32,))" in message
    assert "x * (1 + weight)" in message
    assert 'same_layout("GemmaRMSNorm"' in message  # the fix
    with pytest.raises(bridge.PortError, match=r"GemmaRMSNorm"):
        bridge.port(hf, target)  # the module: the same


@pytest.mark.parametrize(
    "fw,source", [("nnx", "folder"), ("nnx", "module"), ("equinox", "folder")]
)
def test_gemma_into_its_own_norm_and_back(tmp_path, gemma_norm, fw, source):
    hf = hf_model(GEMMA, torch, transformers)
    hf.save_pretrained(tmp_path / "hf")
    target = _abstract(fw, GEMMA)
    if source == "folder":
        model = bridge.load(tmp_path / "hf", like=target)
    else:
        model = bridge.port(hf, target)
    expected = _logits(hf)
    np.testing.assert_allclose(_run(fw, model), expected, **TOL)

    bridge.save_pretrained(tmp_path / "out", model, config=hf.config)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    loaded = back.state_dict()
    assert all(torch.equal(v, loaded[k]) for k, v in hf.state_dict().items())
    assert np.array_equal(_logits(back), expected)


# --- Phi-3 into separate q/k/v and gate/up layers -------------------------------------

# grouped-query attention: qkv_proj's rows are HEADS * HEAD_DIM of q, then KV *
# HEAD_DIM of k and of v, unequal parts
PHI3_SPLIT = {
    r"model\.layers\.\d+\.self_attn\.qkv_proj": {
        "q_proj": HEADS * HEAD_DIM,
        "k_proj": KV * HEAD_DIM,
        "v_proj": KV * HEAD_DIM,
    },
    r"model\.layers\.\d+\.mlp\.gate_up_proj": ("gate_proj", "up_proj"),
}


def test_phi3_split_into_separate_layers_and_fused_back(tmp_path):
    """Phi-3 written as Llama (no fused layers): the folder's state dict split as it
    is read (`from_torch(..., split=)` with each part's rows), and fused again on the
    way out. Before sizes could be given, the split was refused: 'its output size 64
    is not a multiple' of 3."""
    hf = hf_model(FAMILIES["phi3"], torch, transformers)
    hf.save_pretrained(tmp_path / "hf")
    llama_like = FAMILIES["phi3"]._replace(fused=False)
    target = nnx.eval_shape(lambda: CausalLM(llama_like, nnx.Rngs(0)))
    with pytest.raises(bridge.PortError) as info:  # the fused layers pair with nothing
        bridge.load(tmp_path / "hf", like=target)
    fused = [p for p in info.value.problems if p.startswith("fused:")]
    assert len(fused) == 2, info.value.problems  # one per name, whatever the layer
    qkv = next(p for p in fused if "qkv_proj" in p)
    assert ".model.layers[0].self_attn.q_proj (32 rows)" in qkv
    assert f"split={{r'{list(PHI3_SPLIT)[0]}': {{...}}}}" in qkv  # the fix
    state = bridge.to_torch(bridge.load(tmp_path / "hf"))
    model = bridge.port(bridge.from_torch(state, split=PHI3_SPLIT), target)
    expected = _logits(hf)
    np.testing.assert_allclose(_run("nnx", model), expected, **TOL)

    fresh = bridge.from_torch(hf.state_dict(), split=PHI3_SPLIT)  # the fused layout
    bridge.save_pretrained(
        tmp_path / "out", bridge.port(model, fresh), config=hf.config
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    loaded = back.state_dict()
    assert all(torch.equal(v, loaded[k]) for k, v in hf.state_dict().items())
    assert np.array_equal(_logits(back), expected)


def test_split_sizes_must_add_up():
    state = {"qkv.weight": np.zeros((64, 32), "f4")}
    with pytest.raises(ValueError, match=r"output size 64 is not 32 \+ 16 \+ 8\."):
        bridge.from_torch(state, split={"qkv": {"q": 32, "k": 16, "v": 8}})


@pytest.mark.parametrize("layout", ["flax", "equinox"])
def test_gemma_folder_is_not_converted_without_the_model(tmp_path, layout, capsys):
    """`bridge convert --to-layout flax` wrote Gemma's norm weights as Flax RMSNorm
    scales (measured before the fix: exit 0), which a Flax RMSNorm then reads as
    `x * scale`, silently; both layouts now refuse, naming each norm."""
    from bridge._cli import main

    hf = hf_model(GEMMA, torch, transformers)
    hf.save_pretrained(tmp_path / "hf")
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(tmp_path / "hf"), str(out), "--to-layout", layout]) == 1
    assert ".model.norm (GemmaRMSNorm) has no" in capsys.readouterr().err
    assert not out.exists()
