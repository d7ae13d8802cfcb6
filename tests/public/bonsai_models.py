"""Harness B: the JAX team's curated NNX models (jax-ml/bonsai, vendored unchanged in
`tests/public/bonsai/`), which name their layers their own way, filled by bridge
from the matching transformers PyTorch model with no rules.

Each model is built tiny from its own config class, and so is its transformers
twin; every parameter (and BatchNorm statistic) of the source is perturbed so that
ones and zeros cannot hide a misplaced array. Routes:

- `torch->nnx`: `bridge.port(hf_model, bonsai_model, example=...)`;
- `folder->nnx`: `hf_model.save_pretrained(folder)`, then
  `bridge.load(folder, like=bonsai_model, example=...)`;
- `nnx->torch`: `bridge.port(bonsai_model, hf_model, example=...)`, then
  `load_state_dict(..., strict=True)`.

Outputs are compared with the source framework's, with the tolerance the two
implementations allow (bonsai's ViT and Whisper use the tanh GELU where
transformers uses the exact one; Qwen3 embeds in bfloat16; bonsai's DINOv3 runs
with its bfloat16 RoPE and tanh GELU computed as transformers does,
`dinov3_as_transformers`). Outcomes as in
`tests/public/hf_flax.py`. `python -m tests.public.bonsai_models` prints the table.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .hf_flax import (
    T5,
    WHISPER,
    Outcome,
    _quiet,
    _refusal,
    command_line,
    first_line,
    perturb_torch,
    perturbed,
    problems,
)


ROUTES = ("torch->nnx", "folder->nnx", "nnx->torch")
BATCH = 2


@dataclasses.dataclass
class Case:
    """One bonsai model and its transformers twin, built tiny.

    `make_nnx()` builds the bonsai model; `make_torch()` the transformers one;
    `nnx_call(model)` and `torch_call(model)` run each on the same inputs and return
    the output to compare (numpy); `example`/`nnx_kwargs`/`torch_kwargs` are what
    bridge is given to trace."""

    name: str
    make_nnx: Callable[[], Any]
    make_torch: Callable[[], Any]
    nnx_call: Callable[[Any], np.ndarray]
    torch_call: Callable[[Any], np.ndarray]
    example: tuple | None
    nnx_kwargs: dict
    torch_kwargs: dict
    tolerance: float = 1e-4
    config: Any = None  # the bonsai model's config (for its own loader, params.py)
    # the folder route gives `(torch_kwargs, nnx_kwargs)`, not `nnx_kwargs` alone:
    # for inputs each side takes in its own layout (V-JEPA 2's video)
    folder_pair: bool = False


def _torch_inputs(**arrays):
    import torch

    return {
        k: torch.from_numpy(np.asarray(v)).long()
        if np.asarray(v).dtype.kind == "i"
        else torch.from_numpy(np.asarray(v))
        for k, v in arrays.items()
    }


def _torch_out(model, field, **inputs):
    import torch

    with torch.no_grad():
        out = model(**_torch_inputs(**inputs))
    value = out[field] if isinstance(field, str) else field(out)
    return value.detach().float().numpy()


# transformers' config fields of the tiny decoders (Qwen3, Gemma3, Qwen3-VL's text)
TINY_DECODER = dict(
    vocab_size=99,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
)


def _images(size: int, rng=None):
    rng = rng or np.random.default_rng(0)
    return rng.normal(size=(BATCH, 3, size, size)).astype(np.float32)


def _image_classifier(
    name: str,
    make_nnx: Callable[[], Any],
    make_torch: Callable[[], Any],
    size: int,
    config: Any,
    nnx_kwargs: dict | None = None,
    tolerance: float = 1e-4,
) -> Case:
    """A bonsai image classifier (channels last, `nnx_kwargs` beside the images)
    against its transformers twin (`pixel_values` channels first), on the same
    random `size` x `size` images, the logits compared."""
    nchw = _images(size)
    nhwc = jnp.asarray(nchw.transpose(0, 2, 3, 1))
    kwargs = nnx_kwargs or {}
    return Case(
        name,
        make_nnx,
        make_torch,
        lambda m: np.asarray(m(nhwc, **kwargs)),
        lambda m: _torch_out(m, "logits", pixel_values=nchw),
        (nhwc,),
        kwargs,
        _torch_inputs(pixel_values=nchw),
        tolerance=tolerance,
        config=config,
    )


def vit() -> Case:
    import transformers
    from flax import nnx

    from .bonsai import vit

    cfg = vit.ModelConfig(
        image_size=(8, 8),
        patch_size=(4, 4),
        num_channels=3,
        hidden_dim=16,
        attn_dropout_prob=0.0,
        dropout_prob=0.0,
        num_heads=2,
        mlp_dim=32,
        eps=1e-12,
        num_layers=2,
        num_labels=3,
    )
    hf = transformers.ViTConfig(
        image_size=8,
        patch_size=4,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
        layer_norm_eps=1e-12,
    )
    return _image_classifier(
        "vit",
        lambda: vit.ViTClassificationModel(cfg, rngs=nnx.Rngs(0)),
        lambda: transformers.ViTForImageClassification(hf),
        8,
        cfg,
        {"rngs": None},
        tolerance=1e-3,  # tanh GELU (transformers: exact); bonsai's own loader: 4e-5
    )


def resnet() -> Case:
    import transformers
    from flax import nnx

    from .bonsai import resnet

    cfg = resnet.ModelConfig([1, 1, 1, 1], num_classes=3)
    hf = transformers.ResNetConfig(
        embedding_size=64,
        hidden_sizes=[256, 512, 1024, 2048],
        depths=[1, 1, 1, 1],
        layer_type="bottleneck",
        num_labels=3,
    )
    return _image_classifier(
        "resnet",
        lambda: resnet.ResNet(cfg, rngs=nnx.Rngs(0)),
        lambda: transformers.ResNetForImageClassification(hf),
        32,
        cfg,
    )


def convnext() -> Case:
    import transformers
    from flax import nnx

    from .bonsai import convnext

    cfg = convnext.ModelConfig(
        stage_depths=(1, 1), stage_dims=(8, 16), drop_path_rate=0.0, num_classes=3
    )
    hf = transformers.ConvNextConfig(
        num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3
    )
    return _image_classifier(
        "convnext",
        lambda: convnext.ConvNeXt(cfg, rngs=nnx.Rngs(0)),
        lambda: transformers.ConvNextForImageClassification(hf),
        16,
        cfg,
        {"rngs": None},
    )


def dinov3() -> Case:
    import transformers
    from flax import nnx

    from .bonsai import dinov3

    cfg = dinov3.ModelConfig(
        patch_size=(4, 4),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=8,
        num_register_tokens=2,
    )
    hf = transformers.DINOv3ViTConfig(
        patch_size=4,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=8,
        num_register_tokens=2,
    )
    nchw = _images(8)
    return Case(
        "dinov3",
        lambda: dinov3.Dinov3ViTModel(cfg, rngs=nnx.Rngs(0)),
        lambda: transformers.DINOv3ViTModel(hf),
        lambda m: dinov3_as_transformers(m, jnp.asarray(nchw)),
        lambda m: _torch_out(m, "last_hidden_state", pixel_values=nchw),
        (jnp.asarray(nchw),),
        {},
        {},
        config=cfg,
    )


def dinov3_as_transformers(model, pixels) -> np.ndarray:
    """bonsai's DINOv3 `last_hidden_state` (shape `(batch, 1 + registers + patches,
    hidden)`) with the two pieces it computes unlike transformers computed as
    transformers does, its code left unchanged (bridge traces it as it is):

    - RoPE: bonsai rounds q, k, cos and sin to bfloat16 (`apply_rotary_pos_emb`,
      `tests/public/bonsai/dinov3.py` lines 174-178); transformers rotates in
      float32 (`apply_rotary_pos_emb`, `modeling_dinov3_vit.py` lines 245-274);
    - GELU: bonsai's `nnx.gelu` (dinov3.py line 255) is `jax.nn.gelu`, tanh
      approximation by default; transformers' `ACT2FN["gelu"]` (line 361) is erf.

    On this case's model perturbed with seeds 0-39, filled by a hand mapping (no
    bridge): as bonsai computes, outputs differ from transformers' by 1.2e-3 to
    8.3e-3 from the first layer on (the embeddings agree bit for bit); with its RoPE
    in float32, 1.2e-4 to 3.4e-4; with both pieces as here, 4.1e-7 to 2.9e-5."""
    from .bonsai import dinov3

    rope, acts = dinov3.apply_rotary_pos_emb, [x.mlp.act_fn for x in model.layer]
    dinov3.apply_rotary_pos_emb = _float32_rope
    for layer in model.layer:
        if layer.mlp.act_fn is jax.nn.gelu:
            layer.mlp.act_fn = _erf_gelu
    try:
        return np.asarray(model(pixels)["last_hidden_state"])
    finally:
        dinov3.apply_rotary_pos_emb = rope
        for layer, act in zip(model.layer, acts):
            layer.mlp.act_fn = act


def _erf_gelu(x):
    return jax.nn.gelu(x, approximate=False)


def _float32_rope(q, k, cos, sin):
    """transformers' DINOv3 `apply_rotary_pos_emb`: the patches' q and k (shape
    `(batch, heads, tokens, head_dim)`, after the prefix tokens) rotated in float32."""
    from .bonsai.dinov3 import rotate_half

    prefix = q.shape[-2] - cos.shape[-2]

    def rotate(x):
        patches = x[..., prefix:, :]
        rotated = patches * cos + rotate_half(patches) * sin
        return jnp.concatenate([x[..., :prefix, :], rotated], axis=-2)

    return rotate(q), rotate(k)


def qwen3() -> Case:
    import transformers
    from flax import nnx

    from .bonsai import qwen3

    cfg = qwen3.ModelConfig(
        num_layers=2,
        vocab_size=99,
        emb_dim=16,
        mlp_dim=32,
        num_heads=2,
        head_dim=8,
        num_kv_heads=1,
        rope_theta=1_000_000,  # what bonsai's attention uses, whatever this says
        rope_scaling_factor=1,
        local_rope_theta=1e4,
        norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    hf = transformers.Qwen3Config(
        **TINY_DECODER,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1_000_000,  # bonsai's `_generate_pos_embeddings` default
    )
    ids = np.random.default_rng(0).integers(3, 99, (BATCH, 7)).astype(np.int32)
    segments = jnp.ones(ids.shape, jnp.int32)

    def kwargs():
        cache = qwen3.init_cache(cfg, BATCH, ids.shape[1], 0, dtype=jnp.float32)
        return {"cache": cache, "segment_ids": segments}

    return Case(
        "qwen3",
        lambda: qwen3.Qwen3(cfg, rngs=nnx.Rngs(0)),
        lambda: transformers.Qwen3ForCausalLM(hf),
        lambda m: np.asarray(m(jnp.asarray(ids), **kwargs()), np.float32),
        lambda m: _torch_out(m, "logits", input_ids=ids),
        (jnp.asarray(ids),),
        kwargs(),
        {},
        tolerance=5e-2,  # bonsai embeds in bfloat16
        config=cfg,
    )


def whisper() -> Case:
    """bonsai's `Whisper.__call__` is not implemented (its encoder and decoder are):
    no forward pass to trace, so no `example=`. Compared: the encoder's output and
    the decoder's, side by side."""
    import transformers
    from flax import nnx

    from .bonsai import whisper

    hf = transformers.WhisperConfig(**WHISPER)
    values = hf.to_dict() | {
        "max_length": 32,
        "num_hidden_layers": 2,
        "dtype": "float32",
        "forced_decoder_ids": None,
        "architectures": None,
        "median_filter_width": 7,
    }
    fields = [f.name for f in dataclasses.fields(whisper.ModelConfig)]
    cfg = whisper.ModelConfig(**{f: values.get(f) for f in fields})
    rng = np.random.default_rng(0)
    features = rng.normal(size=(BATCH, 8, 16)).astype(np.float32)  # (B, mel, T)
    ids = rng.integers(3, 99, (BATCH, 5)).astype(np.int32)

    def nnx_call(m):
        encoded = m.encoder(jnp.asarray(features.transpose(0, 2, 1)))
        mask = nnx.make_causal_mask(jnp.asarray(ids))
        decoded = m.decoder(jnp.asarray(ids), mask, encoded, None, False)
        return np.concatenate([np.ravel(encoded), np.ravel(decoded)])

    def torch_call(m):
        def both(out):
            import torch

            return torch.cat(
                [out.encoder_last_hidden_state.ravel(), out.last_hidden_state.ravel()]
            )

        return _torch_out(m, both, input_features=features, decoder_input_ids=ids)

    return Case(
        "whisper",
        lambda: whisper.Whisper(cfg, rngs=nnx.Rngs(0)),
        lambda: transformers.WhisperModel(hf),
        nnx_call,
        torch_call,
        None,
        {},
        {},
        tolerance=1e-2,  # bonsai's tanh GELU, transformers' exact one
        config=cfg,
    )


def umt5() -> Case:
    import transformers
    from flax import nnx

    from .bonsai import umt5

    sizes = {k: v for k, v in T5.items() if k != "decoder_start_token_id"}
    sizes |= dict(dropout_rate=0.0, tie_word_embeddings=False)
    cfg = umt5.ModelConfig(**sizes)
    hf = transformers.UMT5Config(**sizes)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 99, (BATCH, 7)).astype(np.int32)
    dec = rng.integers(3, 99, (BATCH, 5)).astype(np.int32)
    mask, dec_mask = np.ones_like(ids), np.ones_like(dec)
    kwargs = {
        "attention_mask": jnp.asarray(mask),
        "decoder_input_ids": jnp.asarray(dec),
        "decoder_attention_mask": jnp.asarray(dec_mask),
    }

    def torch_call(m):
        import torch

        inputs = _torch_inputs(
            input_ids=ids,
            attention_mask=mask,
            decoder_input_ids=dec,
            decoder_attention_mask=dec_mask,
        )
        with torch.no_grad():
            out = m(**inputs, output_hidden_states=True)
        return out.decoder_hidden_states[-1].numpy()

    return Case(
        "umt5",
        lambda: umt5.UMT5Model(cfg, rngs=nnx.Rngs(0)),
        lambda: transformers.UMT5ForConditionalGeneration(hf),
        lambda m: np.asarray(m(jnp.asarray(ids), **kwargs)),
        torch_call,
        (jnp.asarray(ids),),
        kwargs,
        _torch_inputs(
            attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask
        ),
        config=cfg,
    )


def mamba2() -> Case:
    import transformers
    from flax import nnx

    from .bonsai import mamba2

    sizes = dict(
        vocab_size=99,
        hidden_size=16,
        state_size=8,
        head_dim=8,
        chunk_size=4,
        expand=2,
        conv_kernel=4,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    )
    cfg = mamba2.ModelConfig(**sizes)
    hf = transformers.Mamba2Config(num_heads=4, n_groups=1, **sizes)
    ids = np.random.default_rng(0).integers(3, 99, (BATCH, 8)).astype(np.int32)
    return Case(
        "mamba2",
        lambda: mamba2.Mamba2ForCausalLM(cfg, rngs=nnx.Rngs(0)),
        lambda: transformers.Mamba2ForCausalLM(hf),
        lambda m: np.asarray(m(jnp.asarray(ids))["logits"]),
        lambda m: _torch_out(m, "logits", input_ids=ids),
        (jnp.asarray(ids),),
        {},
        {},
        tolerance=1e-3,
        config=cfg,
    )


def gemma3() -> Case:
    """bonsai's `Gemma3Model` is Gemma 3 4B's multimodal model; with no image
    (`pixel_values=None`) it runs only its text decoder and tied head, the function
    of transformers' text-only `Gemma3ForCausalLM` (Gemma 3 1B's class). Its vision
    tower and projector are dropped after building (their tiny config only makes
    them buildable): no PyTorch counterpart holds them. Sizes exercise what the text
    model computes: a sliding layer (window 3 < 7 tokens) and a full one, with
    their RoPE bases (1e4; 1e6 with linear scaling 8), q/k RMS norms, `1 + w` norms,
    `sqrt(hidden)` embedding scale (4: exact in bfloat16, as bonsai rounds it), the
    tied head and the final logit softcapping; bonsai's KV cache is a kwarg."""
    import transformers
    from flax import nnx

    from .bonsai import gemma3

    text = gemma3.TextConfig(
        attention_bias=False,
        attention_dropout=0.0,
        head_dim=8,
        hidden_size=16,
        intermediate_size=32,
        layer_types=gemma3._set_attention_modes(2, 2),  # sliding, full
        max_position_embeddings=64,
        num_attention_heads=2,
        num_hidden_layers=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        rope_full_factor=8.0,
        rope_full_theta=1e6,
        rope_slide_factor=1.0,
        rope_slide_theta=1e4,
        sliding_window=3,
        vocab_size=99,
        norm_dtype=jnp.float32,
    )
    vision = gemma3.VisionConfig(
        attention_dropout=0.0,
        hidden_size=8,
        image_size=8,
        intermediate_size=16,
        layer_norm_eps=1e-6,
        num_attention_heads=2,
        num_channels=3,
        num_hidden_layers=1,
        patch_size=4,
        vision_use_head=False,
    )
    cfg = gemma3.ModelConfig(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=4,
        dtype="float32",
        final_logit_softcapping=30.0,
    )
    hf = transformers.Gemma3TextConfig(
        **TINY_DECODER,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=8,  # bonsai scales by head_dim ** -0.5
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    ids = np.random.default_rng(0).integers(3, 99, (BATCH, 7)).astype(np.int32)

    def kwargs():
        cache = gemma3.init_cache(cfg, BATCH, ids.shape[1], 0, dtype=jnp.float32)
        return {
            "cache": cache,
            "segment_ids": jnp.ones(ids.shape, jnp.int32),
            "token_type_ids": jnp.zeros(ids.shape, jnp.int32),
        }

    def make_nnx():
        model = gemma3.Gemma3Model(cfg, rngs=nnx.Rngs(0))
        model.vision_tower = None  # text only: Gemma3ForCausalLM has none
        model.multi_modal_projector = None
        return model

    return Case(
        "gemma3",
        make_nnx,
        lambda: transformers.Gemma3ForCausalLM(hf),
        lambda m: np.asarray(m(jnp.asarray(ids), None, **kwargs())),
        lambda m: _torch_out(m, "logits", input_ids=ids),
        (jnp.asarray(ids), None),  # PyTorch's second argument: attention_mask
        kwargs(),
        {},
        config=cfg,
    )


def efficientnet() -> Case:
    """bonsai's `EfficientNet` with TensorFlow's "SAME" padding (its B5-B7 blocks,
    here at every size) is the function of transformers' `EfficientNet` (Keras's,
    whose stride-2 convolutions pad (0, 1) by hand): three stages, the second of
    two blocks (its second one with a residual), squeeze-excitation in each, at
    width 0.5 (8 to 24 channels, a 640-wide head). transformers adds a residual to
    no stage's first block: bonsai's does where in == out and stride 1, which no
    first block here has. All BatchNorms at epsilon 1e-5 (bonsai's head uses
    flax's default whatever the config says)."""
    import transformers
    from flax import nnx

    from .bonsai import efficientnet

    stages = [(32, 16, 3, 1, 1, 1), (16, 24, 3, 2, 6, 2), (24, 40, 5, 1, 6, 2)]
    blocks = efficientnet.BlockConfigs(
        [efficientnet.BlockConfig(*s, 0.25, "SAME") for s in stages]
    )
    cfg = efficientnet.ModelConfig(
        0.5, 1.0, 16, 0.0, "SAME", 0.99, 1e-5, blocks, num_classes=3
    )
    hf = transformers.EfficientNetConfig(
        width_coefficient=0.5,
        depth_coefficient=1.0,
        image_size=16,
        in_channels=[s[0] for s in stages],
        out_channels=[s[1] for s in stages],
        kernel_sizes=[s[2] for s in stages],
        num_block_repeats=[s[3] for s in stages],
        expand_ratios=[s[4] for s in stages],
        strides=[s[5] for s in stages],
        depthwise_padding=[],
        squeeze_expansion_ratio=0.25,
        hidden_dim=640,
        batch_norm_eps=1e-5,
        num_labels=3,
    )
    return _image_classifier(
        "efficientnet",
        lambda: efficientnet.EfficientNet(cfg, rngs=nnx.Rngs(0)),
        lambda: transformers.EfficientNetForImageClassification(hf),
        16,
        cfg,
    )


def _vjepa2_configs():
    import transformers

    from .bonsai import vjepa2

    sizes = dict(
        patch_size=4,
        tubelet_size=2,
        crop_size=8,
        frames_per_clip=4,
        hidden_size=24,  # head_dim 12: RoPE over frames, rows, columns, 4 each
        num_attention_heads=2,
        num_hidden_layers=2,
        mlp_ratio=4.0,  # transformers' pooler MLPs are 4x whatever the config says
        pred_hidden_size=16,
        pred_num_attention_heads=2,
        pred_num_hidden_layers=2,
        pred_num_mask_tokens=3,
        pred_mlp_ratio=2.0,
        num_pooler_layers=1,
    )
    cfg = vjepa2.ModelConfig(**sizes, num_labels=3)
    hf = transformers.VJEPA2Config(
        **sizes, in_chans=3, num_labels=3, pred_zero_init_mask_tokens=True
    )
    rng = np.random.default_rng(0)
    video = rng.normal(size=(BATCH, 4, 3, 8, 8)).astype(np.float32)  # (B, T, C, H, W)
    return cfg, hf, video


def vjepa2() -> Case:
    """bonsai's `VJEPA2Model` / transformers' `VJEPA2Model`: the encoder (3D patch
    conv, RoPE over frames, rows and columns) and the predictor with the default
    masks (every token both context and target); compared: the encoder's output
    and the predictor's, side by side."""
    import transformers
    from flax import nnx

    from .bonsai import vjepa2 as module

    cfg, hf, video = _vjepa2_configs()
    thwc = jnp.asarray(video.transpose(0, 1, 3, 4, 2))

    def nnx_call(m):
        out = m(thwc)
        return np.concatenate(
            [
                np.ravel(out["last_hidden_state"]),
                np.ravel(out["predictor_last_hidden_state"]),
            ]
        )

    def both(out):
        import torch

        return torch.cat(
            [
                out.last_hidden_state.ravel(),
                out.predictor_output.last_hidden_state.ravel(),
            ]
        )

    return Case(
        "vjepa2",
        lambda: module.VJEPA2Model(cfg, rngs=nnx.Rngs(0)),
        lambda: transformers.VJEPA2Model(hf),
        nnx_call,
        lambda m: _torch_out(m, both, pixel_values_videos=video),
        (),  # the video by keyword: (B, T, C, H, W) for PyTorch, (B, T, H, W, C) here
        {"pixel_values_videos": thwc},
        _torch_inputs(pixel_values_videos=video),
        config=cfg,
        folder_pair=True,
    )


def vjepa2_classifier() -> Case:
    """bonsai's `VJEPA2ForVideoClassification` / transformers' twin: the encoder,
    the attentive pooler (self- then cross-attention) and the linear head. Its
    forward skips the predictor, whose layers both models still hold: no pass
    traces them (they pair by name, their layouts by layer kind). Compared: the
    logits, and the inner `VJEPA2Model`'s predictor output (run eagerly), so that
    the untraced layers are judged too."""
    import transformers
    from flax import nnx

    from .bonsai import vjepa2 as module

    cfg, hf, video = _vjepa2_configs()
    thwc = jnp.asarray(video.transpose(0, 1, 3, 4, 2))
    videos = {"pixel_values_videos": video}

    def nnx_predictor(m):  # run eagerly: bonsai's predictor cannot be traced
        return np.ravel(m.vjepa2(thwc)["predictor_last_hidden_state"])

    def torch_predictor(m):
        def predicted(out):
            return out.predictor_output.last_hidden_state

        return _torch_out(m.vjepa2, predicted, **videos).ravel()

    return Case(
        "vjepa2-cls",
        lambda: module.VJEPA2ForVideoClassification(cfg, rngs=nnx.Rngs(0)),
        lambda: transformers.VJEPA2ForVideoClassification(hf),
        lambda m: np.concatenate([np.ravel(m(thwc)["logits"]), nnx_predictor(m)]),
        lambda m: np.concatenate(
            [_torch_out(m, "logits", **videos).ravel(), torch_predictor(m)]
        ),
        (),
        {"pixel_values_videos": thwc},
        _torch_inputs(pixel_values_videos=video),
        config=cfg,
        folder_pair=True,
    )


def qwen3_vl(vision_tower: bool = True) -> Case:
    """bonsai's `Qwen3VLForConditionalGeneration` / transformers' twin, text only
    (no image: the vision tower, a depth-1 tiny one, is held by both and run by
    neither, so no pass traces it; with `vision_tower=False` both models drop
    it after building). bonsai's text RoPE is one-dimensional, the function of
    transformers' multimodal RoPE when the three position axes are equal, as they
    are for text. bonsai's KV cache is a kwarg."""
    import transformers
    from flax import nnx

    from .bonsai import qwen3_vl

    tower = dict(  # the same sizes on both sides
        depth=1,
        hidden_size=8,
        intermediate_size=16,
        num_heads=2,
        patch_size=2,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=16,
        num_position_embeddings=16,
    )
    cfg = qwen3_vl.ModelConfig(
        vision_config=qwen3_vl.Qwen3VLVisionConfig(
            **tower, deepstack_visual_indexes=(0,)
        ),
        text_config=qwen3_vl.Qwen3VLTextConfig(
            **TINY_DECODER,
            rope_theta=5_000_000,
            mrope_section=(2, 1, 1),
            tie_word_embeddings=False,
        ),
    )
    hf = transformers.Qwen3VLConfig(
        vision_config=dict(**tower, deepstack_visual_indexes=[0]),
        text_config=dict(
            **TINY_DECODER,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5_000_000,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        ),
        tie_word_embeddings=False,
    )
    ids = np.random.default_rng(0).integers(3, 99, (BATCH, 7)).astype(np.int32)

    def kwargs():
        return {"cache": qwen3_vl.init_cache(cfg, BATCH, 7, 0, dtype=jnp.float32)}

    def make_nnx():
        model = qwen3_vl.Qwen3VLForConditionalGeneration(cfg, rngs=nnx.Rngs(0))
        if not vision_tower:
            model.model.visual = None
        return model

    def make_torch():
        model = transformers.Qwen3VLForConditionalGeneration(hf)
        if not vision_tower:
            model.model.visual = None  # a text-only pass never calls it
        return model

    return Case(
        "qwen3_vl" if vision_tower else "qwen3_vl-text",
        make_nnx,
        make_torch,
        lambda m: np.asarray(m(jnp.asarray(ids), **kwargs()), np.float32),
        lambda m: _torch_out(m, "logits", input_ids=ids),
        (jnp.asarray(ids),),
        kwargs(),
        {},
        config=cfg,
    )


CASES: dict[str, Callable[[], Case]] = {
    "vit": vit,
    "resnet": resnet,
    "convnext": convnext,
    "dinov3": dinov3,
    "qwen3": qwen3,
    "whisper": whisper,
    "umt5": umt5,
    "mamba2": mamba2,
    "gemma3": gemma3,
    "efficientnet": efficientnet,
    "vjepa2": vjepa2,
    "vjepa2-cls": vjepa2_classifier,
    "qwen3_vl": qwen3_vl,
    "qwen3_vl-text": lambda: qwen3_vl(vision_tower=False),
}


# --- routes ---------------------------------------------------------------------


def perturb_nnx(model, seed: int):
    """`model` (fresh) with every Param and BatchStat perturbed (variances up), in
    place: `nnx.clone` would leave its attributes sorted, its creation order lost."""
    from flax import nnx

    state = nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))
    nnx.update(model, perturbed(state, seed))
    return model


def _torch_to_nnx(case: Case):
    import bridge

    source = perturb_torch(case.make_torch(), 1)
    want = case.torch_call(source)
    ported = bridge.port(
        source,
        case.make_nnx(),
        example=case.example,
        example_kwargs=(case.torch_kwargs, case.nnx_kwargs),
    )
    return case.nnx_call(ported), want


def _folder_to_nnx(case: Case):
    import bridge

    source = perturb_torch(case.make_torch(), 2)
    want = case.torch_call(source)
    with tempfile.TemporaryDirectory() as folder:
        source.save_pretrained(folder)
        ported = bridge.load(
            folder,
            like=case.make_nnx(),
            example=case.example,
            example_kwargs=(case.torch_kwargs, case.nnx_kwargs)
            if case.folder_pair
            else case.nnx_kwargs,
        )
    return case.nnx_call(ported), want


def _nnx_to_torch(case: Case):
    import bridge

    source = perturb_nnx(case.make_nnx(), 3)
    want = case.nnx_call(source)
    target = case.make_torch().eval()
    state = bridge.port(
        source,
        target,
        example=case.example,
        example_kwargs=(case.nnx_kwargs, case.torch_kwargs),
    )
    target.load_state_dict(state, strict=True)
    return case.torch_call(target), want


RUNNERS = {
    "torch->nnx": _torch_to_nnx,
    "folder->nnx": _folder_to_nnx,
    "nnx->torch": _nnx_to_torch,
}


def run_route(case: Case, route: str) -> Outcome:
    try:
        with _quiet():
            got, want = RUNNERS[route](case)
    except Exception as error:  # noqa: BLE001 - a crash is an outcome here
        if _refusal(error):
            return Outcome("refused", first_line(error), problems(error))
        return Outcome("crash", first_line(error))
    if got.shape != want.shape:
        return Outcome("wrong", f"shape {got.shape} vs {want.shape}")
    scale = max(1.0, float(np.max(np.abs(want))))
    worst = float(np.max(np.abs(got.astype(np.float64) - want))) / scale
    if worst <= case.tolerance:
        return Outcome("exact", f"{worst:.1e}")
    return Outcome("wrong", f"max difference {worst:.3g}")


def main(names=None) -> dict:
    results = {}
    for name, make in CASES.items():
        if names and name not in names:
            continue
        try:
            with _quiet():
                case = make()
        except Exception as error:  # noqa: BLE001
            results[name] = {
                r: Outcome("crash", "build: " + first_line(error)) for r in ROUTES
            }
            print(name, results[name], flush=True)
            continue
        results[name] = {route: run_route(case, route) for route in ROUTES}
        print(name, flush=True)
        for route, outcome in results[name].items():
            print(f"    {route:12s} {outcome}", flush=True)
    return results


if __name__ == "__main__":
    command_line(main)
