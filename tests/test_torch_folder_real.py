"""A folder's model that a build of no memory (meta or fake tensors) cannot stand
for (issue 54 item 9, `bridge/_adapters/_torch_real.py`): a forward pass that reads
values (Gemma 3's multimodal model counts its image tokens: a `.item()`,
`DataDependentOutputException` on fake tensors) is traced on the model built with
real tensors, or on its twin of small widths past `MOST_REAL` bytes; and a buffer in
no file (Gemma 3's `embed_scale`) takes the value the real model computes. A tiny
Gemma 3 folder then loads into a JAX model with names of its own (bonsai's, vendored
in `tests/public/bonsai`) by example, and that model saves back into a folder
`from_pretrained` opens, outputs as transformers' (both refused on the old code:
`embed_scale` had no value). Skipped without torch and transformers."""

import numpy as np
import pytest


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import bridge  # noqa: E402
from bridge._adapters import _torch, _torch_real  # noqa: E402
from bridge._adapters._torch_folder import folder_module  # noqa: E402
from bridge._adapters._torch_trace import trace_module  # noqa: E402
from tests.public import bonsai_models  # noqa: E402


@pytest.fixture(scope="module")
def gemma3():
    with bonsai_models._quiet():
        return bonsai_models.CASES["gemma3"]()


@pytest.fixture(autouse=True)
def _fresh():
    _torch_real._BUILT.clear()  # no real model of another test's bound
    yield
    _torch_real._BUILT.clear()


def test_a_gemma3_folder_loads_into_a_jax_model_by_example(gemma3):
    outcome = bonsai_models.run_route(gemma3, "folder->nnx")
    assert outcome.outcome == "exact", outcome


def test_a_jax_model_saves_into_a_gemma3_folder_by_example(gemma3, tmp_path):
    with bonsai_models._quiet():
        source = bonsai_models.perturb_torch(gemma3.make_torch(), 2)
        source.save_pretrained(tmp_path / "theirs")
        mine = bonsai_models.perturb_nnx(gemma3.make_nnx(), 3)
        want = gemma3.nnx_call(mine)
        bridge.save_pretrained(
            tmp_path / "out",
            mine,
            like=tmp_path / "theirs",
            config=tmp_path / "theirs",
            example=gemma3.example,
            example_kwargs=(gemma3.nnx_kwargs, gemma3.torch_kwargs),
        )
        back = transformers.Gemma3ForCausalLM.from_pretrained(tmp_path / "out")
        got = gemma3.torch_call(back.eval())
    scale = max(1.0, float(np.abs(want).max()))
    assert np.abs(got - want).max() / scale <= gemma3.tolerance


MULTIMODAL = dict(
    text_config=dict(
        **dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2),
        **dict(num_attention_heads=2, num_key_value_heads=1, head_dim=8),
        **dict(sliding_window=3, vocab_size=99),
    ),
    vision_config=dict(
        **dict(hidden_size=8, image_size=8, intermediate_size=16),
        **dict(num_attention_heads=2, num_hidden_layers=1, patch_size=4),
        vision_use_head=False,
    ),
    mm_tokens_per_image=4,
    image_token_index=98,
    boi_token_index=96,
    eoi_token_index=97,
)
IDS = np.array([[3, 96, 98, 98, 98, 98, 97, 5, 6]], np.int64)  # one image's tokens
PIXELS = np.zeros((1, 3, 8, 8), np.float32)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """A tiny Gemma 3 with its vision tower, saved; and its trace on an image,
    of the model built on the CPU as transformers builds it (the oracle)."""
    config = transformers.Gemma3Config(**MULTIMODAL)
    config.use_cache = False
    torch.manual_seed(0)
    cls = transformers.Gemma3ForConditionalGeneration
    model = cls._from_config(config, attn_implementation="eager").eval()
    folder = tmp_path_factory.mktemp("gemma3") / "multimodal"
    model.save_pretrained(folder)
    return folder, trace_module(model, (IDS,), {"pixel_values": PIXELS})


@pytest.mark.parametrize("most", [_torch_real.MOST_REAL, 20_000])
def test_a_forward_pass_reading_values_is_traced_on_real_tensors(
    multimodal, monkeypatch, most
):
    """On fake tensors the model's pass raises (a `.item()`); the folder's trace
    comes from the model with real tensors (30 KB), or past the bound (20 KB here)
    from its twin of small widths: either records what the model built by hand
    does with every parameter."""
    folder, want = multimodal
    monkeypatch.setattr(_torch_real, "MOST_REAL", most)
    built = folder_module(folder)  # meta or fake: the pass cannot run
    with pytest.raises(Exception, match="_local_scalar_dense"):  # `.item()`
        trace_module(built.module, (IDS,), {"pixel_values": PIXELS})
    tree = bridge.load(folder)
    uses = _torch.trace(tree, (IDS,), {"pixel_values": PIXELS})
    assert len(uses.positions) == len(want.positions) == 52
    real = _torch_real.real_module(folder)
    assert real.twin == (most < 30_000)
    assert trace_module(real.module, (IDS,), {"pixel_values": PIXELS}) == want


def test_a_twin_gives_no_constants(gemma3, tmp_path, monkeypatch):
    """A twin's buffers are of its widths (`embed_scale` sqrt(8), not sqrt(16)):
    past the bound the folder's constants are unknown, and the load by example
    names the array it cannot fill, as before."""
    monkeypatch.setattr(_torch_real, "MOST_REAL", 10_000)  # the model: 25 KB
    with bonsai_models._quiet():
        gemma3.make_torch().save_pretrained(tmp_path)
    tree = bridge.load(tmp_path)
    assert _torch_real.real_module(tmp_path, keys=None).twin
    assert _torch.constants(tree) == {}
    with pytest.raises(bridge.PortError, match="embed_tokens.embed_scale"):
        bridge.load(
            tmp_path,
            like=gemma3.make_nnx(),
            example=gemma3.example,
            example_kwargs=(gemma3.torch_kwargs, gemma3.nnx_kwargs),
        )
