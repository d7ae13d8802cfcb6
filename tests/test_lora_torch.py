"""LoRA on PyTorch-layout Trees (`bridge.from_torch`, a Hugging Face folder read in
PyTorch layout): adapters in PEFT's orientation; `to_torch` gives the state dict of
PEFT's LoRA model (`peft.inject_adapter_in_model`), `save_peft` PEFT's files,
`merge_lora` the plain state dict. The first tests need no PyTorch; those against
`peft` skip without it (`nox -s tests_torch` installs it)."""

import copy
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bridge

from .lora_models import LENGTH, OUT, VOCAB, WIDTH, models, nonzero, run


KEY = jax.random.key(3)
IDS = np.array([[1, 2, 3, 4, 5], [9, 0, 8, 7, 1]])
assert IDS.shape[1] == LENGTH


def _state_dict():
    """The state dict of `tests/test_lora_peft.py`'s PyTorch model."""
    rng = np.random.default_rng(0)
    shapes = {
        "emb.weight": (VOCAB, WIDTH),
        "q.weight": (WIDTH, WIDTH),
        "q.bias": (WIDTH,),
        "conv.weight": (WIDTH, WIDTH, 3),
        "conv.bias": (WIDTH,),
        "head.weight": (OUT, WIDTH),
    }
    return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def test_adapters_in_peft_orientation_and_peft_state_dict_names():
    sd = _state_dict()
    tree = bridge.lora(
        bridge.from_torch(sd), ["emb", "q", "head"], rank=2, alpha=4, key=KEY
    )
    assert tree.q.lora_a.shape == (2, WIDTH) and tree.q.lora_b.shape == (WIDTH, 2)
    assert tree.head.lora_a.shape == (2, WIDTH) and tree.head.lora_b.shape == (OUT, 2)
    # an embedding by its name, as PEFT's lora_embedding_A (r, num), _B (dim, r)
    assert tree.emb.lora_a.shape == (2, VOCAB) and tree.emb.lora_b.shape == (WIDTH, 2)
    assert list(bridge.to_torch(tree)) == [
        "emb.base_layer.weight",
        "emb.lora_embedding_A.default",
        "emb.lora_embedding_B.default",
        "q.base_layer.weight",
        "q.base_layer.bias",
        "q.lora_A.default.weight",
        "q.lora_B.default.weight",
        "conv.weight",
        "conv.bias",
        "head.base_layer.weight",
        "head.lora_A.default.weight",
        "head.lora_B.default.weight",
    ]
    assert bridge.to_native(tree).keys() == bridge.to_torch(tree).keys()
    assert not np.any(tree.q.lora_b) and not np.any(tree.emb.lora_a)  # as PEFT's
    # lora(state dict) gives a state dict, the given one unchanged
    out = bridge.lora(sd, ["q"], rank=1, key=KEY)
    assert "q.lora_A.default.weight" in out and list(sd)[1] == "q.weight"


def test_merge_is_w_plus_scaled_b_a():
    sd = _state_dict()
    tree = nonzero(
        bridge.lora(bridge.from_torch(sd), ["emb", "q"], rank=2, alpha=6, key=KEY)
    )
    merged = bridge.to_torch(bridge.merge_lora(tree))
    assert list(merged) == list(sd)
    s = 6 / 2
    a, b = np.asarray(tree.q.lora_a), np.asarray(tree.q.lora_b)
    np.testing.assert_allclose(
        merged["q.weight"], sd["q.weight"] + s * b @ a, atol=1e-6
    )
    a, b = np.asarray(tree.emb.lora_a), np.asarray(tree.emb.lora_b)
    np.testing.assert_allclose(
        merged["emb.weight"], sd["emb.weight"] + s * (b @ a).T, atol=1e-6
    )
    assert np.array_equal(merged["conv.weight"], sd["conv.weight"])


def test_conv1d_by_name_or_bias_takes_its_in_out_weight():
    """GPT-2's Conv1D (weight (in, out)): lora_a (r, in), lora_b (out, r); merged
    into the (in, out) weight."""
    rng = np.random.default_rng(1)
    sd = {
        "h.0.mlp.c_fc.weight": rng.normal(size=(4, 6)).astype(np.float32),
        "h.0.mlp.c_fc.bias": rng.normal(size=(6,)).astype(np.float32),
        "h.0.mlp.c_proj.weight": rng.normal(size=(6, 4)).astype(np.float32),
    }
    tree = nonzero(bridge.lora(bridge.from_torch(sd), "c_fc|c_proj", rank=2, key=KEY))
    fc, proj = tree.h[0].mlp.c_fc, tree.h[0].mlp.c_proj
    assert (fc.lora_a.shape, fc.lora_b.shape) == ((2, 4), (6, 2))
    assert (proj.lora_a.shape, proj.lora_b.shape) == ((2, 6), (4, 2))
    merged = bridge.to_torch(bridge.merge_lora(tree))
    want = sd["h.0.mlp.c_fc.weight"] + (np.asarray(fc.lora_b) @ fc.lora_a).T
    np.testing.assert_allclose(merged["h.0.mlp.c_fc.weight"], want, atol=1e-6)


def test_a_stripped_prefix_and_tied_names_follow_the_layer():
    w = np.ones((VOCAB, WIDTH), np.float32)
    sd = {"model.embed.weight": w, "model.q.weight": np.eye(WIDTH, dtype=np.float32),
          "lm_head.weight": w}  # fmt: skip
    tree = bridge.from_torch(sd, prefix="model.")
    adapted = bridge.lora(tree, ["embed", "q"], rank=1, key=KEY)
    out = bridge.to_torch(adapted)
    assert list(out) == [
        "model.embed.base_layer.weight",
        "model.embed.lora_embedding_A.default",
        "model.embed.lora_embedding_B.default",
        "model.q.base_layer.weight",
        "model.q.lora_A.default.weight",
        "model.q.lora_B.default.weight",
        "lm_head.weight",
    ]
    assert out["lm_head.weight"] is out["model.embed.base_layer.weight"]
    assert list(bridge.to_torch(bridge.merge_lora(adapted))) == list(sd)


def test_a_split_part_or_a_convolution_is_refused_by_name():
    sd = {
        "attn.c_attn.weight": np.zeros((4, 12), np.float32),
        "attn.c_attn.bias": np.zeros((12,), np.float32),
    }
    tree = bridge.from_torch(sd, split={r"attn\.c_attn": ("query", "key", "value")})
    with pytest.raises(ValueError, match=r"\.attn\.query: a part of the fused layer"):
        bridge.lora(tree, ["query"], rank=1, key=KEY)
    with pytest.raises(ValueError, match=r"\.conv \(.*\): this kind of layer cannot"):
        bridge.lora(bridge.from_torch(_state_dict()), ["conv"], rank=1, key=KEY)


def test_port_carries_torch_layout_adapters_into_jax_models():
    tree = nonzero(
        bridge.lora(bridge.from_torch(_state_dict()), ["emb", "q"], rank=2, key=KEY)
    )
    nnx_model = bridge.port(tree, models()["nnx"])
    eqx_model = bridge.port(tree, models()["equinox"])
    assert nnx_model.q.lora_a.shape == (WIDTH, 2)  # flax orientation
    assert eqx_model.q.lora_a.shape == (2, WIDTH)
    np.testing.assert_allclose(
        run(nnx_model, IDS), run(eqx_model, IDS), atol=1e-5, rtol=0
    )
    # and the merged state dict ports to the same function
    merged = bridge.port(bridge.merge_lora(tree), models()["nnx"])
    np.testing.assert_allclose(run(merged, IDS), run(nnx_model, IDS), atol=1e-5)


# --- against PEFT ------------------------------------------------------------------


def _torch_model():
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from transformers.pytorch_utils import Conv1D

    class Torch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, WIDTH)
            self.q = torch.nn.Linear(WIDTH, WIDTH)
            self.c_fc = Conv1D(WIDTH, WIDTH)  # nf, nx: weight (in, out)
            self.head = torch.nn.Linear(WIDTH, OUT, bias=False)

        def forward(self, ids):
            x = torch.relu(self.q(self.emb(ids)))
            return self.head(torch.tanh(self.c_fc(x)))

    torch.manual_seed(0)
    return Torch()


TORCH_TARGETS = ["emb", "q", "c_fc", "head"]


def _out(model):
    import torch

    with torch.no_grad():
        return model(torch.tensor(IDS)).numpy()


def test_torch_layout_lora_equals_peft(tmp_path):
    """bridge.lora on bridge.from_torch(module): to_torch loads strictly into PEFT's
    LoRA model of the same config; save_peft -> PeftModel.from_pretrained computes
    the same; the adapters ported to NNX compute PEFT's forward (1e-5); merge_lora
    equals merge_and_unload (1e-6)."""
    base = _torch_model()  # skips without torch or peft
    import peft

    tree = bridge.from_torch(base)
    adapted = nonzero(
        bridge.lora(tree, TORCH_TARGETS, rank=2, alpha=4, key=KEY, use_rslora=True)
    )
    assert not hasattr(tree.q, "lora_a")  # the given Tree: unchanged
    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=TORCH_TARGETS, use_rslora=True
    )
    with warnings.catch_warnings():  # PEFT sets it per layer: Linear, Conv1D
        warnings.filterwarnings("ignore", "fan_in_fan_out is set")
        injected = peft.inject_adapter_in_model(config, copy.deepcopy(base))
        bridge.save_peft(tmp_path / "adapter", adapted)
        loaded = peft.PeftModel.from_pretrained(
            copy.deepcopy(base), tmp_path / "adapter"
        )
    state = bridge.to_torch(adapted, tensors=True)
    assert list(state) == list(injected.state_dict())
    injected.load_state_dict(state, strict=True)
    want = _out(injected)
    assert np.abs(want - _out(base)).max() > 1e-2  # the adapters count

    np.testing.assert_allclose(_out(loaded), want, atol=1e-6, rtol=0)

    class JaxModel(eqx.Module):  # the PyTorch model's layers, in Equinox
        emb: eqx.nn.Embedding
        q: eqx.nn.Linear
        c_fc: eqx.nn.Linear
        head: eqx.nn.Linear

        def __init__(self, key):
            k = jax.random.split(key, 4)
            self.emb = eqx.nn.Embedding(VOCAB, WIDTH, key=k[0])
            self.q = eqx.nn.Linear(WIDTH, WIDTH, key=k[1])
            self.c_fc = eqx.nn.Linear(WIDTH, WIDTH, key=k[2])
            self.head = eqx.nn.Linear(WIDTH, OUT, use_bias=False, key=k[3])

        def __call__(self, ids):
            def one(i):
                x = jax.nn.relu(self.q(self.emb(i)))
                return self.head(jnp.tanh(self.c_fc(x)))

            return jax.vmap(jax.vmap(one))(ids)

    jax_model = bridge.port(adapted, JaxModel(jax.random.key(0)))
    np.testing.assert_allclose(np.asarray(jax_model(IDS)), want, atol=1e-5, rtol=0)

    merged = bridge.to_torch(bridge.merge_lora(adapted))
    unloaded = copy.deepcopy(loaded).merge_and_unload().state_dict()
    assert list(merged) == list(base.state_dict()) == list(unloaded)
    for name, array in merged.items():
        np.testing.assert_allclose(
            array, unloaded[name].numpy(), atol=1e-6, rtol=0, err_msg=name
        )


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")
def test_peft_adapter_onto_a_hugging_face_folder_in_torch_layout(tmp_path):
    """A Hugging Face Llama folder read in PyTorch layout (no model class), a PEFT
    adapter on its q_proj and v_proj loaded onto it: merge_lora gives the merged
    checkpoint without PyTorch, equal to merge_and_unload's; and bridge.lora on the
    same Tree written by save_peft runs in PEFT."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "base")
    ids = torch.tensor(IDS)
    lora_config = peft.LoraConfig(
        r=2, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    tuned = peft.get_peft_model(copy.deepcopy(hf), lora_config)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    tuned.save_pretrained(tmp_path / "adapter")

    tree = bridge.load(tmp_path / "base" / "model.safetensors")
    adapted = bridge.load_peft(tmp_path / "adapter", tree)
    assert adapted.model.layers[1].self_attn.v_proj.lora_a.shape == (2, 16)
    merged = bridge.to_torch(bridge.merge_lora(adapted))
    want = tuned.merge_and_unload()
    for name, array in want.state_dict().items():
        np.testing.assert_allclose(
            merged[name], array.numpy(), atol=1e-6, rtol=0, err_msg=name
        )
    plain = copy.deepcopy(hf)
    plain.load_state_dict(bridge.to_torch(bridge.merge_lora(adapted), tensors=True))
    with torch.no_grad():
        np.testing.assert_allclose(
            plain(ids).logits.numpy(), want(ids).logits.numpy(), atol=1e-5, rtol=0
        )

    fresh = nonzero(
        bridge.lora(tree, "q_proj|v_proj", rank=3, alpha=6, key=jax.random.key(9))
    )
    bridge.save_peft(tmp_path / "mine", fresh)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "mine")
    injected = peft.inject_adapter_in_model(
        peft.LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"]),
        copy.deepcopy(hf),
    )
    injected.load_state_dict(bridge.to_torch(fresh, tensors=True), strict=True)
    with torch.no_grad():
        got, ref = loaded(ids).logits.numpy(), injected(ids).logits.numpy()
        base_logits = hf(ids).logits.numpy()
    np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)
    assert np.abs(got - base_logits).max() > 1e-3


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")
def test_gpt2_peft_adapter_merged_in_torch_layout(tmp_path):
    """GPT-2's Conv1D layers (fused c_attn, c_proj, c_fc; tied wte/lm_head): a PEFT
    adapter loaded onto bridge.from_torch(model) and merged: merge_and_unload's
    weights (measured bit-equal) and logits."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=16, n_layer=2, n_head=2, vocab_size=30, n_positions=8,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    hf = transformers.GPT2LMHeadModel(config).eval()
    lora = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["c_attn", "c_proj", "c_fc"],
        fan_in_fan_out=True,
    )  # fmt: skip
    tuned = peft.get_peft_model(copy.deepcopy(hf), lora)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    tuned.save_pretrained(tmp_path)
    adapted = bridge.load_peft(tmp_path, bridge.from_torch(hf))
    attn = adapted.transformer.h[0].attn.c_attn
    assert (attn.lora_a.shape, attn.lora_b.shape) == ((2, 16), (48, 2))
    merged = bridge.to_torch(bridge.merge_lora(adapted), tensors=True)
    want = copy.deepcopy(tuned).merge_and_unload()
    for name, array in want.state_dict().items():
        np.testing.assert_allclose(
            merged[name].numpy(), array.numpy(), atol=1e-6, rtol=0, err_msg=name
        )
    plain = copy.deepcopy(hf)
    plain.load_state_dict(merged)
    ids = torch.tensor(IDS)
    with torch.no_grad():
        got, ref = plain(ids).logits.numpy(), tuned(ids).logits.numpy()
        moved = np.abs(hf(ids).logits.numpy() - ref).max()
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    assert moved > 1e-2
