"""Reading a PyTorch module's computation (`bridge/_adapters/_torch_trace.py`): what
one forward pass does with each weight, decided by the operation that consumes it,
never by its name or a square shape. On hand-written modules (every operation kind)
and on tiny transformers models built from configs; the fake-tensor build of each
config (no memory) must read exactly as the real model does. Skipped without torch
and transformers (`nox -s tests_torch`)."""

import time
import warnings

import numpy as np
import pytest

from bridge._uses import Contraction, Untraced


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bridge._adapters._torch_folder import (  # noqa: E402
    folder_module,
    module_from_folder,
)
from bridge._adapters._torch_trace import trace_module  # noqa: E402


LINEAR = Contraction(inputs=(1,), outputs=(0,), batch=())  # (out, in)
CONV1D = Contraction(inputs=(0,), outputs=(1,), batch=())  # (in, out), GPT-2's


class GPT2Conv1D(torch.nn.Module):
    """transformers' `Conv1D` as it computes: `addmm(bias, x, weight)`, weight
    `(in, out)`."""

    def __init__(self, nf, nx):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(nx, nf))
        self.bias = torch.nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        shape = x.size()[:-1] + (self.weight.size(-1),)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(shape)


class RMSNorm(torch.nn.Module):
    """T5's/Llama's norm (`w * x`), or Gemma's (`x * (1 + w)`), written by hand."""

    def __init__(self, d, plus_one=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.plus_one = plus_one

    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + 1e-6)
        if self.plus_one:
            return x * (1.0 + self.weight.float())
        return self.weight * x.to(torch.float32)


class ChannelsFirstLayerNorm(torch.nn.Module):
    """ConvNeXt's hand-written LayerNorm over axis 1."""

    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.bias = torch.nn.Parameter(torch.zeros(d))

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + 1e-6)
        return self.weight[:, None] * x + self.bias[:, None]


class Everything(torch.nn.Module):
    """One of each: embedding, Conv1D, Linear, both RMS norms, an einsum kernel,
    square Conv1d and ConvTranspose1d, weight norm, a hand-written LayerNorm,
    BatchNorm, a head tied to the embedding, an unused parameter."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.conv1d = GPT2Conv1D(4, 4)
        self.linear = torch.nn.Linear(4, 4)
        self.rms = RMSNorm(4)
        self.gemma = RMSNorm(4, plus_one=True)
        self.heads = torch.nn.Parameter(torch.randn(4, 2, 2))  # (in, heads, head_dim)
        self.conv = torch.nn.Conv1d(4, 4, 3, padding=1)
        self.transposed = torch.nn.ConvTranspose1d(4, 4, 3, padding=1)
        self.normed = torch.nn.utils.parametrizations.weight_norm(
            torch.nn.Conv1d(4, 4, 3, padding=1), dim=2
        )
        self.ln = ChannelsFirstLayerNorm(4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.mask_token = torch.nn.Parameter(torch.zeros(4))

    def forward(self, ids):
        h = self.gemma(self.rms(self.linear(self.conv1d(self.embed(ids)))))
        h = torch.einsum("btd,dhk->bthk", h, self.heads).reshape(h.shape)
        h = self.transposed(self.conv(h.transpose(1, 2)))
        h = self.bn(self.ln(self.normed(h)))
        return self.head(h.transpose(1, 2))


IDS = np.arange(10, dtype=np.int32).reshape(2, 5)


@pytest.fixture(scope="module")
def everything():
    torch.manual_seed(0)
    model = Everything().eval()
    return model, trace_module(model, (IDS,))


def test_products_read_by_the_operation(everything):
    _, uses = everything
    assert uses.contracted["linear.weight"] == LINEAR
    assert uses.contracted["conv1d.weight"] == CONV1D
    assert uses.contracted["heads"] == Contraction((0,), (1, 2), ())
    assert "linear.bias" not in uses.contracted


def test_square_convolution_and_transposed_convolution(everything):
    _, uses = everything
    assert uses.convolved["conv.weight"] == (0, 1, 2)
    assert uses.convolved["transposed.weight"] == (1, 0, 2)
    v = "normed.parametrizations.weight.original1"
    assert uses.convolved[v] == (0, 1, 2)
    assert uses.weight_norm == {
        "normed.weight": ("normed.parametrizations.weight.original0", v)
    }


def test_norms_by_what_they_compute(everything):
    _, uses = everything
    assert uses.norms == {
        "rms.weight": "rms",
        "gemma.weight": "rms+1",
        "ln.weight": "mean",
        "ln.bias": "mean:bias",
        "bn.weight": "mean",
        "bn.bias": "mean:bias",
    }


def test_ties_unused_and_buffers(everything):
    _, uses = everything
    # a tie's names are traced apart, each through its own module: the head's
    # product comes last, the embedding's lookup first; one tensor, one bit
    assert uses.positions["head.weight"] > uses.positions["bn.weight"]
    assert uses.positions["embed.weight"] < uses.positions["conv1d.weight"]
    assert uses.contracted["head.weight"] == LINEAR
    assert "embed.weight" not in uses.contracted
    assert uses.needs["head.weight"][0] == uses.needs["embed.weight"][0]
    assert uses.needs["head.weight"][1] & uses.needs["bn.weight"][0]
    assert uses.tied == {"head.weight": "embed.weight"}
    assert uses.unused == ("mask_token", "bn.num_batches_tracked")
    bn = [uses.positions[f"bn.{n}"] for n in ("weight", "running_mean", "running_var")]
    assert bn[0] == bn[1] == bn[2]


def test_order_of_first_use(everything):
    _, uses = everything
    order = ["embed.weight", "conv1d.weight", "linear.weight", "rms.weight"]
    order += ["gemma.weight", "heads", "conv.weight", "transposed.weight"]
    order += ["normed.parametrizations.weight.original1", "ln.weight", "ln.bias"]
    order += ["bn.weight", "head.weight"]  # head.weight: tied, its own use
    got = sorted(order, key=lambda n: (uses.positions[n], order.index(n)))
    assert got == order
    assert uses.positions["linear.weight"] == uses.positions["linear.bias"]
    assert uses.positions["ln.weight"] < uses.positions["ln.bias"]


def test_needs_are_the_layers_upstream(everything):
    _, uses = everything
    bit = {n: uses.needs[n][0] for n in uses.needs}
    embed, conv1d_w, conv1d_b = (
        bit["embed.weight"],
        bit["conv1d.weight"],
        bit["conv1d.bias"],
    )
    assert uses.needs["embed.weight"][1] == 0  # token ids depend on no weight
    assert uses.needs["conv1d.weight"][1] == embed  # its bias is added after
    assert uses.needs["conv1d.bias"][1] == embed | conv1d_w
    assert uses.needs["linear.weight"][1] == embed | conv1d_w | conv1d_b
    assert bit["head.weight"] == embed  # one tensor, one bit
    assert len(set(bit.values())) == len(bit) - 1


def test_views_and_arithmetic_are_seen_through():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 4))  # (out, in)
            self.v = torch.nn.Parameter(torch.randn(3, 2))  # (in, out)
            self.cls = torch.nn.Parameter(torch.zeros(1, 1, 4))

        def forward(self, x):
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
            y = x @ self.w.t().to(torch.float32)  # (in, out) view of (out, in)
            return torch.matmul(y, self.v.T.T)

    uses = trace_module(M(), (np.zeros((2, 5, 4), np.float32),))
    assert uses.contracted == {"w": LINEAR, "v": CONV1D}
    assert uses.positions["cls"] < uses.positions["w"] < uses.positions["v"]


def test_square_linear_read_from_the_computation():
    """A square `nn.Linear` named like GPT-2's `Conv1D` is `(out, in)`; a square
    GPT-2 `Conv1D` is `(in, out)`: names and shapes cannot tell, the operation does."""
    model = torch.nn.ModuleDict(
        {"c_fc": torch.nn.Linear(4, 4), "c_proj": GPT2Conv1D(4, 4)}
    )

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = model

        def forward(self, x):
            return self.mlp["c_proj"](self.mlp["c_fc"](x))

    uses = trace_module(M(), (torch.zeros(2, 4),))
    assert uses.contracted == {"mlp.c_fc.weight": LINEAR, "mlp.c_proj.weight": CONV1D}


def test_old_weight_norm_hooks():
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", FutureWarning
        )  # deprecated for parametrizations
        conv = torch.nn.utils.weight_norm(torch.nn.Conv1d(4, 4, 3))
    uses = trace_module(conv, (np.zeros((1, 4, 6), np.float32),))
    assert uses.weight_norm == {"weight": ("weight_g", "weight_v")}
    assert uses.convolved == {"weight_v": (0, 1, 2)}


def test_inputs_from_jax_and_kwargs():
    import jax.numpy as jnp

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)

        def forward(self, x, *, scale):
            return self.a(x) * scale

    uses = trace_module(M(), jnp.ones((2, 4)), {"scale": jnp.ones((2, 4))})
    assert uses.contracted == {"a.weight": LINEAR}


def test_a_meta_pass_opening_autocast_runs_on_meta(monkeypatch):
    """transformers 4.x's rotary embeddings open `torch.autocast(device_type=
    x.device.type, enabled=False)`, which PyTorch refuses for `meta`: the meta pass
    runs through it (once, never again on fake tensors: 5-10x slower), reads as the
    real module does, and leaves `torch.autocast` as it was."""
    import bridge._adapters._torch_trace as torch_trace

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x):
            with torch.autocast(device_type=x.device.type, enabled=False):
                angle = self.a(x).float()
            return self.b(x * angle.cos())

    with pytest.raises(RuntimeError):  # what the meta pass met before
        torch.autocast(device_type="meta", enabled=False)
    opened = torch.autocast.__init__
    real = trace_module(Rotary(), (np.ones((2, 4), np.float32),))
    monkeypatch.setattr(torch_trace, "_fake_copy", None)  # no fake pass is made
    with torch.device("meta"):
        meta = trace_module(Rotary(), (np.ones((2, 4), np.float32),))
    assert meta == real
    assert meta.needs["b.weight"][1] & meta.needs["a.weight"][0]  # b reads a's output
    assert torch.autocast.__init__ is opened
    with pytest.raises(RuntimeError):
        torch.autocast(device_type="meta", enabled=False)


class Counting(torch.nn.Module):
    """A BatchNorm in training mode, and a buffer its forward changes in place."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x):
        self.calls += 1
        return self.bn(self.conv(x))


def test_tracing_a_real_module_changes_nothing():
    """A real module's pass runs on copies of its buffers: a BatchNorm in training
    mode keeps its statistics, a buffer changed in place keeps its value."""
    torch.manual_seed(0)
    model = Counting().train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    uses = trace_module(model, (np.ones((2, 3, 6, 6), np.float32),))
    assert model.training and model.calls.item() == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert uses.convolved == {"conv.weight": (0, 1, 2, 3)}
    assert {"bn.running_mean", "bn.running_var"} <= set(uses.positions)
    assert uses.needs["bn.weight"][1] & uses.needs["conv.weight"][0]


# tiny transformers models, as config.json holds them
CONFIGS = {
    "bert": dict(
        model_type="bert",
        architectures=["BertForMaskedLM"],
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=32,
    ),
    "gpt2": dict(
        model_type="gpt2",
        architectures=["GPT2LMHeadModel"],
        vocab_size=64,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_positions=32,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "gpt_neo": dict(  # intermediate_size == hidden_size: square c_fc and c_proj
        model_type="gpt_neo",
        architectures=["GPTNeoForCausalLM"],
        vocab_size=64,
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        intermediate_size=16,
        attention_types=[[["global", "local"], 1]],
        max_position_embeddings=32,
        window_size=8,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "t5": dict(
        model_type="t5",
        architectures=["T5ForConditionalGeneration"],
        vocab_size=64,
        d_model=16,
        d_kv=8,
        d_ff=24,
        num_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    ),
    "whisper": dict(  # d_model == num_mel_bins * 2: conv2 is Conv1d(16, 16, 3)
        model_type="whisper",
        architectures=["WhisperForConditionalGeneration"],
        vocab_size=64,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        num_mel_bins=8,
        max_source_positions=8,
        max_target_positions=16,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    ),
    "gemma": dict(
        model_type="gemma",
        architectures=["GemmaForCausalLM"],
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=32,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    "vit": dict(
        model_type="vit",
        architectures=["ViTForImageClassification"],
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        image_size=8,
        patch_size=4,
        num_channels=3,
        num_labels=3,
    ),
    "resnet": dict(
        model_type="resnet",
        architectures=["ResNetForImageClassification"],
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        num_labels=3,
    ),
    "wav2vec2": dict(
        model_type="wav2vec2",
        architectures=["Wav2Vec2ForCTC"],
        vocab_size=16,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        conv_dim=(8, 8),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        feat_extract_norm="group",
    ),
}
_VISION = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2)
_PATCHES = dict(image_size=8, patch_size=4)
CONFIGS |= {  # more families, for the fake build's equality alone
    "llama": CONFIGS["gemma"]
    | dict(model_type="llama", architectures=["LlamaForCausalLM"]),
    "beit": dict(
        model_type="beit",
        architectures=["BeitModel"],
        **_VISION,
        **_PATCHES,
        intermediate_size=24,
        use_relative_position_bias=True,
    ),
    "dinov2": dict(
        model_type="dinov2",
        architectures=["Dinov2Model"],
        **_VISION,
        **_PATCHES,
        mlp_ratio=2,
    ),
    "convnext": dict(
        model_type="convnext",
        architectures=["ConvNextModel"],
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_stages=2,
    ),
}
TOKENS = (np.arange(10, dtype=np.int64).reshape(2, 5) + 3,)
INPUTS = {
    "bert": (TOKENS, {}),
    "gpt2": (TOKENS, {}),
    "gpt_neo": (TOKENS, {}),
    "gemma": (TOKENS, {}),
    "t5": (TOKENS, {"decoder_input_ids": TOKENS[0]}),
    "whisper": (
        (np.zeros((1, 8, 16), np.float32),),
        {"decoder_input_ids": TOKENS[0][:1]},
    ),
    "vit": ((np.zeros((1, 3, 8, 8), np.float32),), {}),
    "resnet": ((np.zeros((1, 3, 32, 32), np.float32),), {}),
    "wav2vec2": ((np.zeros((1, 400), np.float32),), {}),
    "llama": (TOKENS, {}),
    "beit": ((np.zeros((1, 3, 8, 8), np.float32),), {}),
    "dinov2": ((np.zeros((1, 3, 8, 8), np.float32),), {}),
    "convnext": ((np.zeros((1, 3, 32, 32), np.float32),), {}),
}


def _real(name):
    """The tiny model with real (random) weights, built as transformers does."""
    config = dict(CONFIGS[name])
    arch = config.pop("architectures")[0]
    model_type = config.pop("model_type")
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    cfg.use_cache = False
    torch.manual_seed(0)
    model = getattr(transformers, arch)._from_config(cfg, attn_implementation="eager")
    return model.eval()


_TRACED: dict = {}


def traced(name):
    if name not in _TRACED:
        args, kwargs = INPUTS[name]
        _TRACED[name] = trace_module(_real(name), args, kwargs)
    return _TRACED[name]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fake_build_reads_as_the_real_model(name):
    """`folder_module` of a config (meta tensors, no memory) gives the same record
    as the real model: every position, layout, norm and dependence (BERT, T5 and
    Whisper read a value on meta tensors: traced again on fake ones)."""
    built = folder_module(CONFIGS[name])
    assert built.reason == "" and built.module is not None
    state = built.module.state_dict(keep_vars=True).values()
    assert all(t.device.type == "meta" or t.numel() <= 16 for t in state)  # Wav2Vec2:
    # `masked_spec_embed` is made by `torch.Tensor(n)`, which ignores the device
    args, kwargs = INPUTS[name]
    fake = trace_module(built.module, args, kwargs)
    real = traced(name)
    assert fake == real
    assert len(real.positions) + len(real.unused) == len(_real(name).state_dict())


def test_gpt2_conv1d_is_in_out():
    uses = traced("gpt2")
    for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        assert uses.contracted[f"transformer.h.0.{layer}.weight"] == CONV1D
    assert uses.contracted["lm_head.weight"] == LINEAR  # tied to wte
    assert uses.positions["lm_head.weight"] > uses.positions["transformer.wte.weight"]
    assert uses.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert uses.norms["transformer.h.0.ln_1.weight"] == "mean"


def test_gpt_neo_square_mlp_is_out_in():
    uses = traced("gpt_neo")
    for layer in ("mlp.c_fc", "mlp.c_proj", "attn.attention.q_proj"):
        assert uses.contracted[f"transformer.h.1.{layer}.weight"] == LINEAR


def test_t5_rms_norms_and_three_tied_names():
    uses = traced("t5")
    norms = {n: k for n, k in uses.norms.items()}
    assert set(norms.values()) == {"rms"}
    assert "encoder.final_layer_norm.weight" in norms
    assert "decoder.block.1.layer.2.layer_norm.weight" in norms
    # one tensor under four names, each traced through its own module: the
    # encoder's lookup, the decoder's, the head's product; `shared` is never called
    tied = ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"]
    tied += ["lm_head.weight"]
    assert sorted(tied, key=uses.positions.__getitem__) == tied
    assert len({uses.needs[n][0] for n in tied}) == 1
    assert "shared.weight" in uses.unused
    assert uses.tied == dict.fromkeys(tied, "shared.weight")
    assert uses.contracted["lm_head.weight"] == LINEAR
    wi = "encoder.block.0.layer.1.DenseReluDense.wi.weight"
    assert uses.contracted[wi] == LINEAR


def test_whisper_square_conv2_is_a_convolution():
    uses = traced("whisper")
    assert uses.convolved == {
        "model.encoder.conv1.weight": (0, 1, 2),
        "model.encoder.conv2.weight": (0, 1, 2),
    }
    assert (
        uses.positions["model.encoder.conv1.weight"]
        < uses.positions["model.encoder.conv2.weight"]
    )


def test_gemma_norms_are_rms_plus_one():
    uses = traced("gemma")
    assert uses.norms["model.layers.0.input_layernorm.weight"] == "rms+1"
    assert uses.norms["model.norm.weight"] == "rms+1"
    assert set(uses.norms.values()) == {"rms+1"}


def test_bert_layer_norms_and_tied_decoder():
    uses = traced("bert")
    assert uses.norms["bert.embeddings.LayerNorm.bias"] == "mean:bias"
    decoder = "cls.predictions.decoder.weight"
    assert uses.contracted[decoder] == LINEAR
    assert (
        uses.positions[decoder]
        > uses.positions["bert.embeddings.word_embeddings.weight"]
    )


def test_vit_patches_cls_token_and_position():
    uses = traced("vit")
    patches = "vit.embeddings.patch_embeddings.projection.weight"
    assert uses.convolved == {patches: (0, 1, 2, 3)}
    cls, pos = "vit.embeddings.cls_token", "vit.embeddings.position_embeddings"
    assert uses.positions[patches] < uses.positions[cls] < uses.positions[pos]
    assert uses.unused == ()


def test_resnet_batch_norm_statistics_are_read():
    uses = traced("resnet")
    bn = "resnet.embedder.embedder.normalization"
    conv = "resnet.embedder.embedder.convolution.weight"
    assert uses.norms[f"{bn}.weight"] == "mean"
    assert uses.norms[f"{bn}.bias"] == "mean:bias"
    assert uses.positions[f"{bn}.running_mean"] == uses.positions[f"{bn}.weight"]
    assert uses.positions[conv] < uses.positions[f"{bn}.running_var"]
    assert uses.convolved[conv] == (0, 1, 2, 3)
    assert all(n.endswith("num_batches_tracked") for n in uses.unused)
    assert len(uses.unused) == 6


def test_wav2vec2_weight_norm_and_training_only_array():
    uses = traced("wav2vec2")
    conv = "wav2vec2.encoder.pos_conv_embed.conv"
    g = f"{conv}.parametrizations.weight.original0"
    v = f"{conv}.parametrizations.weight.original1"
    assert uses.weight_norm == {f"{conv}.weight": (g, v)}
    assert uses.convolved[v] == (0, 1, 2)
    assert uses.positions[g] == uses.positions[v] == uses.positions[f"{conv}.bias"]
    assert uses.unused == ("wav2vec2.masked_spec_embed",)


def test_folder_names_follow_transformers_renames(tmp_path):
    """A saved folder's keys: the same names for GPT-2 (the tied head by the
    embedding's key), ViT's 5.x module names mapped back to the file's."""
    _real("gpt2").save_pretrained(tmp_path / "gpt2")
    built = folder_module(tmp_path / "gpt2")
    assert built.unmatched == ()
    assert built.keys == {"lm_head.weight": "transformer.wte.weight"}
    vit = _real("vit")
    vit.save_pretrained(tmp_path / "vit")
    built = folder_module(tmp_path / "vit")
    assert built.unmatched == ()
    names = set(vit.state_dict())
    assert set(built.keys) <= names
    for name, key in built.keys.items():  # every renamed name reads its file key
        assert key not in names
    if "vit.layers.0.attention.q_proj.weight" in names:  # transformers 5.x
        assert (
            built.keys["vit.layers.0.attention.q_proj.weight"]
            == "vit.encoder.layer.0.attention.attention.query.weight"
        )


def test_folder_module_says_why_it_built_nothing(monkeypatch):
    from bridge._adapters import _torch_folder

    built = folder_module({"model_type": "no-such-model", "architectures": ["X"]})
    assert built.module is None and "config.json" in built.reason
    real = _torch_folder._import
    monkeypatch.setattr(
        _torch_folder, "_import", lambda n: None if n == "transformers" else real(n)
    )
    assert module_from_folder(CONFIGS["bert"]) is None
    assert folder_module(CONFIGS["bert"]).reason.startswith(
        "transformers is not installed"
    )


def test_folder_keys_of_older_checkpoints_and_base_models():
    """Wav2Vec2 checkpoints store `weight_g`/`weight_v` (transformers renames them
    to a parametrization on load); a base model's keys lack the head's prefix; a
    head the file does not hold is unmatched, not guessed."""
    names = list(_real("wav2vec2").state_dict())
    legacy = [
        n.replace("parametrizations.weight.original0", "weight_g").replace(
            "parametrizations.weight.original1", "weight_v"
        )
        for n in names
    ]
    built = folder_module(CONFIGS["wav2vec2"], keys=legacy)
    conv = "wav2vec2.encoder.pos_conv_embed.conv"
    assert built.keys == {
        f"{conv}.parametrizations.weight.original0": f"{conv}.weight_g",
        f"{conv}.parametrizations.weight.original1": f"{conv}.weight_v",
    }
    assert built.unmatched == ()
    base = [n.removeprefix("wav2vec2.") for n in names if n.startswith("wav2vec2.")]
    built = folder_module(CONFIGS["wav2vec2"], keys=base)
    assert built.keys[f"{conv}.bias"] == "encoder.pos_conv_embed.conv.bias"
    assert built.unmatched == ("lm_head.weight", "lm_head.bias")


def _adapter_trace():
    from bridge._adapters._registry import adapter_named

    return adapter_named("torch").trace


def test_adapter_trace_keys_by_tree_path():
    """The torch adapter's `trace`: the module a Tree holds, keyed by leaf path (a
    stripped prefix off; a tie's second name, which the Tree holds once, by its own
    path, its array's in `tied`)."""
    import bridge

    model = _real("gpt2")
    tree = bridge.from_torch(model, prefix="transformer.")
    uses = _adapter_trace()(tree, *INPUTS["gpt2"])
    assert uses.contracted[("h", 0, "attn", "c_attn", "weight")] == CONV1D
    assert uses.contracted[("lm_head", "weight")] == LINEAR  # the tied head's
    assert ("wte", "weight") not in uses.contracted  # a lookup
    assert uses.tied == {("lm_head", "weight"): ("wte", "weight")}
    paths = [("lm_head", "weight")]
    bridge._tree.map_with_path(lambda p, _: paths.append(p), tree)
    assert sorted(uses.positions, key=str) == sorted(paths, key=str)
    assert _adapter_trace()(bridge.from_torch(model.state_dict()), TOKENS, {}) is None


def test_adapter_trace_of_a_folder(tmp_path):
    """A folder's Tree (no module) with its config recorded is traced on the model
    built from config.json, by the file's names: as the real module reads."""
    import bridge
    from bridge._adapters._torch import with_config

    model = _real("wav2vec2")
    model.save_pretrained(tmp_path)
    tree = with_config(bridge.load(tmp_path), tmp_path)
    args, kwargs = INPUTS["wav2vec2"]
    from_folder = _adapter_trace()(tree, args, kwargs)
    assert from_folder == _adapter_trace()(bridge.from_torch(model), args, kwargs)
    conv = ("wav2vec2", "encoder", "pos_conv_embed", "conv")
    g = (*conv, "parametrizations", "weight", "original0")
    v = (*conv, "parametrizations", "weight", "original1")
    assert from_folder.weight_norm == {(*conv, "weight"): (g, v)}
    unknown = with_config(tree, {"model_type": "no-such-model"})
    with pytest.raises(Untraced, match="could not be traced: its config.json"):
        _adapter_trace()(unknown, args, kwargs)


def test_the_docstring_example():
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    uses = trace_module(m, (torch.ones(2, 3),))
    assert uses.contracted["0.weight"] == Contraction(
        inputs=(1,), outputs=(0,), batch=()
    )
    assert uses.norms["1.weight"] == "mean"


def test_dinov2_mask_token_unused_and_beit_query():
    assert traced("dinov2").unused == ("embeddings.mask_token",)
    beit = traced("beit")  # transformers 5.x renamed its modules: either names
    (q,) = [
        n.removesuffix(".weight")
        for n in beit.contracted
        if n.endswith(
            ("0.attention.q_proj.weight", "0.attention.attention.query.weight")
        )
    ]
    assert beit.positions[f"{q}.bias"] == beit.positions[f"{q}.weight"]
    assert beit.contracted[f"{q}.weight"] == LINEAR
    assert beit.unused == ()


def test_multihead_attention_in_and_out_projections():
    """`nn.MultiheadAttention` computes in one function: both projections are
    `(out, in)`, the output one a step later, depending on the input one."""
    mha = torch.nn.MultiheadAttention(4, 2, batch_first=True).eval()
    x = np.ones((1, 3, 4), np.float32)
    uses = trace_module(mha, (x, x, x))
    assert uses.contracted == {"in_proj_weight": LINEAR, "out_proj.weight": LINEAR}
    assert uses.positions["in_proj_weight"] < uses.positions["out_proj.weight"]
    assert uses.needs["in_proj_weight"] == (1, 0)
    assert uses.needs["out_proj.weight"] == (4, 1 | 2)


def test_no_architectures_builds_the_base_model_and_shapes_as_inputs():
    """A config naming no class gives `AutoModel`'s (BERT's base model); inputs
    may be `jax.ShapeDtypeStruct`s (zeros of that shape)."""
    import jax

    config = {k: v for k, v in CONFIGS["bert"].items() if k != "architectures"}
    built = folder_module(config)
    assert type(built.module).__name__ == "BertModel"
    ids = jax.ShapeDtypeStruct((2, 5), np.int32)
    uses = trace_module(built.module, (ids,))
    assert uses.contracted["encoder.layer.1.output.dense.weight"] == LINEAR
    assert uses.unused == ()


def test_a_config_declaring_more_layers_than_the_folder_holds_is_not_built():
    """A `config.json` of 2,000 layers beside 4 tensors (a hostile or a wrong config:
    the trace builds the model from it when a load has example inputs): building it
    took ~10 s and 300 MB, 100,000 layers minutes and gigabytes, and Qwen2's
    `num_hidden_layers: 10**8` never finished (its config lists each layer's type).
    Nothing is built: the reason names the field and the folder's count."""
    keys = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]
    hostile = [
        ({**CONFIGS["gpt2"], "n_layer": 2_000}, "n_layer 2000"),
        (
            {"model_type": "qwen2", "num_hidden_layers": 10**8, "hidden_size": 8},
            "num_hidden_layers 100000000",
        ),
        (
            {"model_type": "t5", "d_model": 8, "text": {"num_layers": 50}},
            "num_layers 50",
        ),
    ]
    for config, declared in hostile:
        start = time.perf_counter()
        built = folder_module(config, keys=keys)
        assert time.perf_counter() - start < 5
        assert built.module is None
        assert built.reason.startswith(
            f"its config.json declares {declared}, but the folder holds 4 tensors"
        ), built.reason
    assert folder_module({**CONFIGS["gpt2"], "n_layer": 4}, keys=keys).module


def test_a_config_whose_model_registers_too_many_parameters_is_not_built(
    monkeypatch,
):
    """The construction stops once the model takes more steps (modules,
    parameters, buffers, operations) than the folder's tensors allow (a count that
    fields such as an expert count multiply)."""
    from bridge._adapters import _torch_bounds

    monkeypatch.setattr(_torch_bounds, "MOST_STEPS", 10)
    keys = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]
    built = folder_module({**CONFIGS["gpt2"], "n_layer": 3}, keys=keys)
    assert built.module is None
    assert built.reason.startswith(
        "its config.json declares a model of more than 74 modules, parameters, "
        "buffers and operations, but the folder holds 4 tensors"
    ), built.reason
    monkeypatch.setattr(_torch_bounds, "MOST_STEPS", 10_000)
    assert folder_module({**CONFIGS["gpt2"], "n_layer": 3}, keys=keys).module
