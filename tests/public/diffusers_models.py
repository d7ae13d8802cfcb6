"""diffusers' Flax (Linen) models against their PyTorch twins, from the same
package: its Flax classes were deprecated and then removed in 0.40, so the last
release that has them, 0.39, is installed (`diffusers==0.39.0`).

The variational autoencoder (`FlaxAutoencoderKL` / `AutoencoderKL`): GroupNorms,
3x3 convolutions (NHWC kernels against OIHW; both take NCHW images, the Flax
model transposes inside), the mid block's attention (`query`, `key`, `value`,
`proj_attn` against `to_q`, `to_k`, `to_v`, `to_out.0`), the latent's 1x1
`quant_conv`/`post_quant_conv`. Its folder is diffusers' own
(`diffusion_pytorch_model.safetensors` and a `config.json` naming `_class_name`),
opened by `AutoencoderKL.from_pretrained`.

The conditional UNet (`FlaxUNet2DConditionModel` / `UNet2DConditionModel`): the
timestep's sinusoidal embedding computed on both sides, its MLP, cross-attention
transformer blocks (GEGLU feed-forward: one product split in two), GroupNorms of
32 groups (the Flax model's fixed count: 32 and 64 channels)."""

from __future__ import annotations

import numpy as np

from .code_bases import Case, to_numpy


BATCH, SIZE = 2, 8
VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(8, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=SIZE,
)


def _images() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.normal(size=(BATCH, 3, SIZE, SIZE)).astype(np.float32)


def _flax():
    import jax
    from diffusers import FlaxAutoencoderKL

    module = FlaxAutoencoderKL(**VAE)
    return module, {"params": module.init_weights(jax.random.key(0))}


def _flax_call(model) -> np.ndarray:
    import jax.numpy as jnp

    module, variables = model
    return to_numpy(module.apply(variables, jnp.asarray(_images())).sample)


def _torch():
    from diffusers import AutoencoderKL

    return AutoencoderKL(**VAE).eval()


def _torch_call(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return to_numpy(model(torch.from_numpy(_images())).sample)


def _write(model, folder: str) -> str:
    model.save_pretrained(folder)  # diffusion_pytorch_model.safetensors, config.json
    return folder


def _read(folder: str):
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(folder).eval()


def vae() -> Case:
    return Case(
        "diffusers-vae",
        "diffusers",
        "linen",
        _flax,
        _torch,
        _flax_call,
        _torch_call,
        (_images(),),
        {},
        {},
        _write,
        _read,
        save_kwargs={"config": _torch().config},
    )


UNET = dict(
    sample_size=SIZE,
    in_channels=4,
    out_channels=4,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    cross_attention_dim=8,
    attention_head_dim=2,
)


def _unet_inputs():
    rng = np.random.default_rng(0)
    sample = rng.normal(size=(BATCH, 4, SIZE, SIZE)).astype(np.float32)
    timesteps = np.array([3, 7], np.int32)
    context = rng.normal(size=(BATCH, 3, 8)).astype(np.float32)
    return sample, timesteps, context


def _flax_unet():
    import jax
    from diffusers import FlaxUNet2DConditionModel

    module = FlaxUNet2DConditionModel(**UNET)
    return module, {"params": module.init_weights(jax.random.key(0))}


def _flax_unet_call(model) -> np.ndarray:
    import jax.numpy as jnp

    module, variables = model
    inputs = [jnp.asarray(x) for x in _unet_inputs()]
    return to_numpy(module.apply(variables, *inputs).sample)


def _torch_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(**UNET).eval()


def _torch_unet_call(model) -> np.ndarray:
    import torch

    sample, timesteps, context = _unet_inputs()
    with torch.no_grad():
        out = model(
            torch.from_numpy(sample),
            torch.from_numpy(timesteps).long(),
            torch.from_numpy(context),
        )
    return to_numpy(out.sample)


def _read_unet(folder: str):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(folder).eval()


def unet() -> Case:
    return Case(
        "diffusers-unet",
        "diffusers",
        "linen",
        _flax_unet,
        _torch_unet,
        _flax_unet_call,
        _torch_unet_call,
        _unet_inputs(),
        {},
        {},
        _write,
        _read_unet,
        save_kwargs={"config": _torch_unet().config},
        # the twins' float32 arithmetic differs by this much: diffusers' own
        # converter (convert_pytorch_state_dict_to_flax) gives 7.0e-05
        tolerance=5e-4,
    )


# the Flax models are in diffusers < 0.40 only
PACKAGE = "diffusers.models.vae_flax"
CASES = {"diffusers-vae": vae, "diffusers-unet": unet}
