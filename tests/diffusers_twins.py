"""JAX (Flax NNX) rewrites of diffusers models, written from diffusers 0.42's code
with names of their own (`proj_in`, `blocks`, `q`, ...), channels last: the
targets of `tests/test_diffusers_folder.py`, which loads a diffusers folder into
them by example inputs alone (no rule, no name in common) and compares their
outputs with diffusers' own forward pass.

- `UNet`: `diffusers.UNet2DModel` with `down_block_types=("DownBlock2D",
  "AttnDownBlock2D")`, `up_block_types=("AttnUpBlock2D", "UpBlock2D")`,
  `layers_per_block=1`, the positional time embedding (`Timesteps`,
  `flip_sin_to_cos=True`, `freq_shift=0`), the mid block with attention.
- `Autoencoder`: `diffusers.AutoencoderKL` with one `DownEncoderBlock2D` /
  `UpDecoderBlock2D` per entry of `channels`, `layers_per_block=1`, the mid blocks
  with attention; `__call__` is its `forward(sample)` with `sample_posterior=False`
  (the decoder of the posterior's mean).
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx


UNET_EPS = 1e-5  # UNet2DModel's norm_eps; AutoencoderKL's norms take 1e-6


def timestep_embedding(t, dim):
    """`diffusers.models.embeddings.get_timestep_embedding` with
    `flip_sin_to_cos=True`, `downscale_freq_shift=0`: `(B,)` -> `(B, dim)`."""
    half = dim // 2
    freqs = jnp.exp(-math.log(10000) * jnp.arange(half, dtype=jnp.float32) / half)
    angles = t.astype(jnp.float32)[:, None] * freqs[None, :]
    return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


def conv(cin, cout, rngs, k=3, stride=1):
    pad = k // 2
    return nnx.Conv(cin, cout, (k, k), strides=stride, padding=pad, rngs=rngs)


def norm(c, groups, rngs, eps):
    return nnx.GroupNorm(c, num_groups=groups, epsilon=eps, rngs=rngs)


class Residual(nnx.Module):
    """`ResnetBlock2D`: norm, silu, conv, (+ time projection), norm, silu, conv,
    plus the input (through a 1x1 convolution where the channels change)."""

    def __init__(self, cin, cout, groups, rngs, temb=None, eps=UNET_EPS):
        self.first_norm = norm(cin, groups, rngs, eps)
        self.first = conv(cin, cout, rngs)
        self.time = None if temb is None else nnx.Linear(temb, cout, rngs=rngs)
        self.second_norm = norm(cout, groups, rngs, eps)
        self.second = conv(cout, cout, rngs)
        self.skip = conv(cin, cout, rngs, k=1) if cin != cout else None

    def __call__(self, x, temb=None):
        h = self.first(jax.nn.silu(self.first_norm(x)))
        if self.time is not None:
            h = h + self.time(jax.nn.silu(temb))[:, None, None, :]
        h = self.second(jax.nn.silu(self.second_norm(h)))
        return (x if self.skip is None else self.skip(x)) + h


class SelfAttention(nnx.Module):
    """diffusers' `Attention` of a UNet block: group norm, heads over the pixels,
    output projection, plus the input."""

    def __init__(self, c, head_dim, groups, rngs, eps=UNET_EPS):
        self.heads = c // head_dim
        self.norm = norm(c, groups, rngs, eps)
        self.q, self.k, self.v, self.proj = (
            nnx.Linear(c, c, rngs=rngs) for _ in range(4)
        )

    def __call__(self, x):
        b, h, w, c = x.shape
        t = self.norm(x).reshape(b, h * w, c)

        def heads(y):
            return y.reshape(b, h * w, self.heads, c // self.heads)

        q, k, v = heads(self.q(t)), heads(self.k(t)), heads(self.v(t))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(c // self.heads)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        return self.proj(out.reshape(b, h * w, c)).reshape(b, h, w, c) + x


def upsample(x):
    return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


class UNet(nnx.Module):
    def __init__(self, channels=(8, 16), head_dim=4, groups=4, cin=3, rngs=None):
        c0, c1 = channels
        temb = 4 * c0
        self.c0 = c0
        self.time_in = nnx.Linear(c0, temb, rngs=rngs)
        self.time_out = nnx.Linear(temb, temb, rngs=rngs)
        self.proj_in = conv(cin, c0, rngs)
        self.down0 = Residual(c0, c0, groups, rngs, temb)
        self.shrink = conv(c0, c0, rngs, stride=2)
        self.down1 = Residual(c0, c1, groups, rngs, temb)
        self.down1_attn = SelfAttention(c1, head_dim, groups, rngs)
        self.middle = nnx.List(
            [
                Residual(c1, c1, groups, rngs, temb),
                SelfAttention(c1, head_dim, groups, rngs),
                Residual(c1, c1, groups, rngs, temb),
            ]
        )
        self.up0 = nnx.List(
            [
                Residual(2 * c1, c1, groups, rngs, temb),
                Residual(c1 + c0, c1, groups, rngs, temb),
            ]
        )
        self.up0_attn = nnx.List(
            [SelfAttention(c1, head_dim, groups, rngs) for _ in range(2)]
        )
        self.grow = conv(c1, c1, rngs)
        self.up1 = nnx.List(
            [
                Residual(c1 + c0, c0, groups, rngs, temb),
                Residual(2 * c0, c0, groups, rngs, temb),
            ]
        )
        self.out_norm = norm(c0, groups, rngs, UNET_EPS)
        self.proj_out = conv(c0, cin, rngs)

    def __call__(self, x, t):
        t = jnp.broadcast_to(t, (x.shape[0],))
        emb = self.time_out(jax.nn.silu(self.time_in(timestep_embedding(t, self.c0))))
        h = self.proj_in(x)
        skips = [h]
        h = self.down0(h, emb)
        skips.append(h)
        h = self.shrink(h)
        skips.append(h)
        h = self.down1_attn(self.down1(h, emb))
        skips.append(h)
        first, attention, second = self.middle
        h = second(attention(first(h, emb)), emb)
        for block, attn in zip(self.up0, self.up0_attn):
            h = attn(block(jnp.concatenate([h, skips.pop()], -1), emb))
        h = self.grow(upsample(h))
        for block in self.up1:
            h = block(jnp.concatenate([h, skips.pop()], -1), emb)
        return self.proj_out(jax.nn.silu(self.out_norm(h)))


VAE_EPS = 1e-6


class Autoencoder(nnx.Module):
    """`AutoencoderKL`'s norms take `eps=1e-6` (its `resnet_eps`), not its config's."""

    def __init__(self, channels=(8, 16), latent=4, groups=4, cin=3, rngs=None):
        c0, c1 = channels
        self.latent = latent
        # the encoder
        self.enc_in = conv(cin, c0, rngs)
        self.enc0 = Residual(c0, c0, groups, rngs, eps=VAE_EPS)
        self.enc_shrink = nnx.Conv(
            c0, c0, (3, 3), strides=2, padding=((0, 1), (0, 1)), rngs=rngs
        )
        self.enc1 = Residual(c0, c1, groups, rngs, eps=VAE_EPS)
        self.enc_mid = nnx.List(
            [
                Residual(c1, c1, groups, rngs, eps=VAE_EPS),
                SelfAttention(c1, c1, groups, rngs, VAE_EPS),
                Residual(c1, c1, groups, rngs, eps=VAE_EPS),
            ]
        )
        self.enc_norm = norm(c1, groups, rngs, VAE_EPS)
        self.enc_out = conv(c1, 2 * latent, rngs)
        self.moments = conv(2 * latent, 2 * latent, rngs, k=1)
        # the decoder
        self.from_latent = conv(latent, latent, rngs, k=1)
        self.dec_in = conv(latent, c1, rngs)
        self.dec_mid = nnx.List(
            [
                Residual(c1, c1, groups, rngs, eps=VAE_EPS),
                SelfAttention(c1, c1, groups, rngs, VAE_EPS),
                Residual(c1, c1, groups, rngs, eps=VAE_EPS),
            ]
        )
        self.dec0 = nnx.List(
            [Residual(c1, c1, groups, rngs, eps=VAE_EPS) for _ in range(2)]
        )
        self.dec_grow = conv(c1, c1, rngs)
        self.dec1 = nnx.List(
            [
                Residual(c1, c0, groups, rngs, eps=VAE_EPS),
                Residual(c0, c0, groups, rngs, eps=VAE_EPS),
            ]
        )
        self.dec_norm = norm(c0, groups, rngs, VAE_EPS)
        self.dec_out = conv(c0, cin, rngs)

    def __call__(self, x):
        h = self.enc_shrink(self.enc0(self.enc_in(x)))
        h = self.enc1(h)
        for layer in self.enc_mid:
            h = layer(h)
        h = self.enc_out(jax.nn.silu(self.enc_norm(h)))
        z = self.moments(h)[..., : self.latent]  # the posterior's mode: its mean
        h = self.dec_in(self.from_latent(z))
        for layer in self.dec_mid:
            h = layer(h)
        for block in self.dec0:
            h = block(h)
        h = self.dec_grow(upsample(h))
        for block in self.dec1:
            h = block(h)
        return self.dec_out(jax.nn.silu(self.dec_norm(h)))
