# Vendored unchanged from https://github.com/jax-ml/bonsai, bonsai/models/qwen3_vl/modeling.py at
# commit 36284254cf738d99c1c5d1e3a292d27656a0a365 (Apache License 2.0, Copyright 2025 The JAX Authors).
# Used by tests/public/bonsai_models.py as public NNX model code with its own names.
# Copyright 2025 The JAX Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     https://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

import math
from dataclasses import dataclass
from typing import Optional, Tuple, TypeAlias
from enum import Enum

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array, P
from jax.sharding import PartitionSpec, get_abstract_mesh, reshard

_K_MASK = jnp.finfo(jnp.bfloat16).min


class ShardMode(Enum):
    FSDP = "fsdp"
    TP = "tp"


# --- Sharding Configuration --- #
@dataclass(slots=True, frozen=True)
class VisionShardingConfig:
    """Sharding configuration for vision encoder components."""

    attn_qkv_kernel: PartitionSpec
    attn_proj_kernel: PartitionSpec
    mlp_fc1_kernel: PartitionSpec
    mlp_fc2_kernel: PartitionSpec
    layer_norm: PartitionSpec
    activation: PartitionSpec
    patch_embed_kernel: PartitionSpec
    pos_embed: PartitionSpec

    @staticmethod
    def no_sharding():
        return VisionShardingConfig(
            attn_qkv_kernel=P(None, None),
            attn_proj_kernel=P(None, None),
            mlp_fc1_kernel=P(None, None),
            mlp_fc2_kernel=P(None, None),
            layer_norm=P(None),
            activation=P(None, None),
            patch_embed_kernel=P(None, None, None, None, None),
            pos_embed=P(None, None),
        )

    @staticmethod
    def default(use_fsdp: bool, use_tp: bool):
        fsdp = ShardMode.FSDP.value if use_fsdp else None
        tp = ShardMode.TP.value if use_tp else None
        return VisionShardingConfig(
            attn_qkv_kernel=P(fsdp, tp),
            attn_proj_kernel=P(tp, fsdp),
            mlp_fc1_kernel=P(fsdp, tp),
            mlp_fc2_kernel=P(tp, fsdp),
            layer_norm=P(tp),
            activation=P(fsdp, tp),
            patch_embed_kernel=P(None, None, None, None, tp),
            pos_embed=P(None, tp),
        )


@dataclass(slots=True, frozen=True)
class TextShardingConfig:
    """Sharding configuration for text decoder components."""

    q_weight: PartitionSpec
    kv_weight: PartitionSpec
    o_weight: PartitionSpec
    mlp_gate_up_kernel: PartitionSpec
    mlp_down_kernel: PartitionSpec
    rms_norm: PartitionSpec
    embed_kernel: PartitionSpec
    cache: PartitionSpec
    act_btd: PartitionSpec
    act_btf: PartitionSpec
    act_btnh: PartitionSpec
    act_bhsd: PartitionSpec  # (batch, heads, seq, dim) - post-transpose attention
    attn_logit_shd: PartitionSpec  # (batch, heads, q_seq, k_seq) - attention logits

    @staticmethod
    def no_sharding():
        return TextShardingConfig(
            q_weight=P(None, None),
            kv_weight=P(None, None),
            o_weight=P(None, None),
            mlp_gate_up_kernel=P(None, None),
            mlp_down_kernel=P(None, None),
            rms_norm=P(None),
            embed_kernel=P(None, None),
            cache=P(None, None, None, None),
            act_btd=P(None, None, None),
            act_btf=P(None, None, None),
            act_btnh=P(None, None, None, None),
            act_bhsd=P(None, None, None, None),
            attn_logit_shd=P(None, None, None, None),
        )

    @staticmethod
    def default(use_fsdp: bool, use_tp: bool):
        fsdp = ShardMode.FSDP.value if use_fsdp else None
        tp = ShardMode.TP.value if use_tp else None
        return TextShardingConfig(
            q_weight=P(fsdp, tp),
            kv_weight=P(fsdp, tp),
            o_weight=P(tp, fsdp),
            mlp_gate_up_kernel=P(fsdp, tp),
            mlp_down_kernel=P(tp, fsdp),
            rms_norm=P(tp),
            embed_kernel=P(tp, fsdp),
            cache=P(fsdp, None, tp, None),
            act_btd=P(fsdp, None, tp),
            act_btf=P(fsdp, None, tp),
            act_btnh=P(fsdp, None, tp, None),
            act_bhsd=P(fsdp, tp, None, None),  # transpose of act_btnh
            attn_logit_shd=P(fsdp, tp, None, None),  # TP on heads for attn logits
        )


def shard(x, spec: PartitionSpec):
    """Reshard tensor according to partition spec if mesh is available."""
    mesh = get_abstract_mesh()
    if not mesh.empty and len(mesh.axis_names) > 0:
        return reshard(x, spec)
    return x


# --- Sharded Layer Components (Gemma3 Pattern) --- #
class ShardedLinear(nnx.Module):
    """Linear layer with explicit sharding on matmul output.

    Unlike standard Linear, sharding is applied only at call time via out_sharding,
    not during initialization. This allows model creation without an active mesh.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        *,
        use_bias: bool = True,
        kernel_sharding: PartitionSpec = None,  # Stored but not used in init
        dtype=None,
        rngs: nnx.Rngs,
    ):
        # Initialize without sharding - sharding happens at call time
        kernel_initializer = jax.nn.initializers.lecun_normal()
        self.kernel = nnx.Param(kernel_initializer(rngs.params(), (in_dim, out_dim), dtype=dtype))
        self.use_bias = use_bias
        if use_bias:
            self.bias = nnx.Param(jnp.zeros((out_dim,), dtype=dtype))
        else:
            self.bias = None

    def __call__(self, x, *, out_sharding: PartitionSpec):
        # Apply sharding on output - handles both mesh and no-mesh contexts
        mesh = get_abstract_mesh()
        if mesh.empty or len(mesh.axis_names) == 0:
            # No mesh - skip sharding
            result = jnp.matmul(x, self.kernel[...])
        else:
            result = jnp.matmul(x, self.kernel[...], out_sharding=out_sharding)
        if self.use_bias and self.bias is not None:
            result = result + self.bias[...]
        return result


class ShardedEmbedding(nnx.Embed):
    """Embedding layer with explicit sharding on gather output."""

    def __call__(self, inputs: Array, *, out_sharding: PartitionSpec) -> Array:
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError("Input type must be an integer or unsigned integer.")
        (embedding,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
        if self.num_embeddings == 1:
            return jnp.broadcast_to(embedding, (*inputs.shape, self.features))
        # Apply sharding on output - handles both mesh and no-mesh contexts
        mesh = get_abstract_mesh()
        if mesh.empty or len(mesh.axis_names) == 0:
            return embedding[inputs]
        return embedding.at[inputs].get(out_sharding=out_sharding)

    def attend(self, query: Array, *, out_sharding: PartitionSpec) -> Array:
        """Compute logits by matrix multiply with embedding weights."""
        query, embedding = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
        mesh = get_abstract_mesh()
        if mesh.empty or len(mesh.axis_names) == 0:
            return jnp.matmul(query, embedding.T)
        return jnp.matmul(query, embedding.T, out_sharding=out_sharding)


@dataclass(frozen=True)
class Qwen3VLVisionConfig:
    """Vision encoder configuration for Qwen3-VL."""

    depth: int = 24
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 2048
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple = (5, 11, 17)
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    shd_cfg: VisionShardingConfig = VisionShardingConfig.no_sharding()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def qwen3vl_2b(cls, use_fsdp: bool = False, use_tp: bool = False):
        shd = (
            VisionShardingConfig.default(use_fsdp, use_tp)
            if (use_fsdp or use_tp)
            else VisionShardingConfig.no_sharding()
        )
        return cls(
            depth=24,
            hidden_size=1024,
            intermediate_size=4096,
            num_heads=16,
            out_hidden_size=2048,
            deepstack_visual_indexes=(5, 11, 17),
            shd_cfg=shd,
        )

    @classmethod
    def qwen3vl_4b(cls, use_fsdp: bool = False, use_tp: bool = False):
        shd = (
            VisionShardingConfig.default(use_fsdp, use_tp)
            if (use_fsdp or use_tp)
            else VisionShardingConfig.no_sharding()
        )
        return cls(
            depth=24,
            hidden_size=1024,
            intermediate_size=4096,
            num_heads=16,
            out_hidden_size=2560,
            deepstack_visual_indexes=(5, 11, 17),
            shd_cfg=shd,
        )

    @classmethod
    def qwen3vl_8b(cls, use_fsdp: bool = False, use_tp: bool = False):
        shd = (
            VisionShardingConfig.default(use_fsdp, use_tp)
            if (use_fsdp or use_tp)
            else VisionShardingConfig.no_sharding()
        )
        return cls(
            depth=27,
            hidden_size=1152,
            intermediate_size=4304,
            num_heads=16,
            out_hidden_size=4096,
            deepstack_visual_indexes=(8, 16, 24),
            shd_cfg=shd,
        )

    @classmethod
    def qwen3vl_32b(cls, use_fsdp: bool = False, use_tp: bool = False):
        shd = (
            VisionShardingConfig.default(use_fsdp, use_tp)
            if (use_fsdp or use_tp)
            else VisionShardingConfig.no_sharding()
        )
        return cls(
            depth=27,
            hidden_size=1152,
            intermediate_size=4304,
            num_heads=16,
            out_hidden_size=5120,
            deepstack_visual_indexes=(8, 16, 24),
            shd_cfg=shd,
        )


@dataclass(frozen=True)
class Qwen3VLTextConfig:
    """Text decoder configuration for Qwen3-VL."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000
    mrope_section: tuple = (24, 20, 20)  # T, H, W partitions of head_dim
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    shd_cfg: TextShardingConfig = TextShardingConfig.no_sharding()

    @classmethod
    def qwen3vl_2b(cls, use_fsdp: bool = False, use_tp: bool = False):
        shd = TextShardingConfig.default(use_fsdp, use_tp) if (use_fsdp or use_tp) else TextShardingConfig.no_sharding()
        return cls(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            tie_word_embeddings=True,
            shd_cfg=shd,
        )

    @classmethod
    def qwen3vl_4b(cls, use_fsdp: bool = False, use_tp: bool = False):
        shd = TextShardingConfig.default(use_fsdp, use_tp) if (use_fsdp or use_tp) else TextShardingConfig.no_sharding()
        return cls(
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=True,
            shd_cfg=shd,
        )

    @classmethod
    def qwen3vl_8b(cls, use_fsdp: bool = False, use_tp: bool = False):
        shd = TextShardingConfig.default(use_fsdp, use_tp) if (use_fsdp or use_tp) else TextShardingConfig.no_sharding()
        return cls(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=False,
            shd_cfg=shd,
        )

    @classmethod
    def qwen3vl_32b(cls, use_fsdp: bool = False, use_tp: bool = False):
        shd = TextShardingConfig.default(use_fsdp, use_tp) if (use_fsdp or use_tp) else TextShardingConfig.no_sharding()
        return cls(
            hidden_size=5120,
            intermediate_size=25600,
            num_hidden_layers=64,
            num_attention_heads=64,
            num_key_value_heads=8,
            tie_word_embeddings=False,
            shd_cfg=shd,
        )


@dataclass(frozen=True)
class ModelConfig:
    """Combined configuration for Qwen3-VL model."""

    vision_config: Qwen3VLVisionConfig
    text_config: Qwen3VLTextConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    @classmethod
    def qwen3vl_2b(cls, use_fsdp: bool = False, use_tp: bool = False):
        """Qwen3-VL 2B configuration."""
        return cls(
            vision_config=Qwen3VLVisionConfig.qwen3vl_2b(use_fsdp, use_tp),
            text_config=Qwen3VLTextConfig.qwen3vl_2b(use_fsdp, use_tp),
        )

    @classmethod
    def qwen3vl_4b(cls, use_fsdp: bool = False, use_tp: bool = False):
        """Qwen3-VL 4B configuration."""
        return cls(
            vision_config=Qwen3VLVisionConfig.qwen3vl_4b(use_fsdp, use_tp),
            text_config=Qwen3VLTextConfig.qwen3vl_4b(use_fsdp, use_tp),
        )

    @classmethod
    def qwen3vl_8b(cls, use_fsdp: bool = False, use_tp: bool = False):
        """Qwen3-VL 8B configuration."""
        return cls(
            vision_config=Qwen3VLVisionConfig.qwen3vl_8b(use_fsdp, use_tp),
            text_config=Qwen3VLTextConfig.qwen3vl_8b(use_fsdp, use_tp),
        )

    @classmethod
    def qwen3vl_32b(cls, use_fsdp: bool = False, use_tp: bool = False):
        return cls(
            vision_config=Qwen3VLVisionConfig.qwen3vl_32b(use_fsdp, use_tp),
            text_config=Qwen3VLTextConfig.qwen3vl_32b(use_fsdp, use_tp),
        )


class RMSNorm(nnx.Module):
    """Root Mean Square Layer Normalization."""

    def __init__(self, dim: int, eps: float = 1e-6, *, rngs: nnx.Rngs):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype=jnp.float32))

    def __call__(self, x: Array) -> Array:
        x_f32 = x.astype(jnp.float32)
        rms = jax.lax.rsqrt(jnp.mean(x_f32**2, axis=-1, keepdims=True) + self.eps)
        out = (x_f32 * rms) * self.weight[...]
        return out.astype(x.dtype)


class Qwen3VLPatchEmbed(nnx.Module):
    """3D Convolutional patch embedding for vision input using nnx.Conv."""

    def __init__(self, config: Qwen3VLVisionConfig, *, rngs: nnx.Rngs):
        self.config = config
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nnx.Conv(
            in_features=config.in_channels,
            out_features=config.hidden_size,
            kernel_size=kernel,
            strides=kernel,
            padding="VALID",  # No padding - matches PyTorch Conv3d default
            use_bias=True,
            rngs=rngs,
        )

    def __call__(self, hidden_states: Array) -> Array:
        # Input: (num_patches, in_channels * temporal_patch_size * patch_size * patch_size)
        cfg = self.config
        seq_len = hidden_states.shape[0]

        hidden_states = hidden_states.reshape(
            seq_len, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size
        )
        # (seq, C, D, H, W) -> (seq, D, H, W, C)
        hidden_states = hidden_states.transpose(0, 2, 3, 4, 1)

        # Apply conv: input (seq, D, H, W, C) -> output (seq , hidden_size)
        return self.proj(hidden_states).reshape(seq_len, cfg.hidden_size)


class Qwen3VLVisionMLP(nnx.Module):
    """Vision encoder MLP with GELU activation."""

    def __init__(self, config: Qwen3VLVisionConfig, *, rngs: nnx.Rngs):
        self.shd_cfg = config.shd_cfg
        self.linear_fc1 = ShardedLinear(
            config.hidden_size,
            config.intermediate_size,
            use_bias=True,
            kernel_sharding=self.shd_cfg.mlp_fc1_kernel,
            rngs=rngs,
        )
        self.linear_fc2 = ShardedLinear(
            config.intermediate_size,
            config.hidden_size,
            use_bias=True,
            kernel_sharding=self.shd_cfg.mlp_fc2_kernel,
            rngs=rngs,
        )

    def __call__(self, x: Array) -> Array:
        # Vision operates on (seq, hidden) without batch - no sharding benefit
        x = self.linear_fc1(x, out_sharding=self.shd_cfg.mlp_fc1_kernel)
        x = nnx.gelu(x, approximate=True)
        return self.linear_fc2(x, out_sharding=self.shd_cfg.mlp_fc2_kernel)


class Qwen3VLVisionAttention(nnx.Module):
    """Vision encoder multi-head attention with RoPE."""

    def __init__(self, config: Qwen3VLVisionConfig, *, rngs: nnx.Rngs):
        self.shd_cfg = config.shd_cfg
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        hidden_size = config.hidden_size
        self.qkv = ShardedLinear(
            hidden_size, 3 * hidden_size, use_bias=True, kernel_sharding=self.shd_cfg.attn_qkv_kernel, rngs=rngs
        )
        self.proj = ShardedLinear(
            hidden_size, hidden_size, use_bias=True, kernel_sharding=self.shd_cfg.attn_proj_kernel, rngs=rngs
        )
        self.scale = self.head_dim**-0.5

    def apply_rope(self, cos: Array, sin: Array, q: Array, k: Array):
        """Apply RoPE using shared function."""
        # cos/sin: (seq, head_dim) -> (seq, 1, head_dim) for broadcasting with (seq, heads, head_dim)
        cos = cos[:, None, :]
        sin = sin[:, None, :]
        q = apply_rotary_pos_emb(q, cos, sin)
        k = apply_rotary_pos_emb(k, cos, sin)
        return q, k

    def __call__(self, hidden_states: Array, position_embeddings: Tuple[Array, Array]) -> Array:
        seq_len = hidden_states.shape[0]
        cos, sin = position_embeddings  # (seq_len, head_dim)
        # Use no sharding for QKV since we reshape immediately after
        qkv_out = self.qkv(hidden_states, out_sharding=P(None, None))
        qkv = qkv_out.reshape(seq_len, 3, self.num_heads, self.head_dim)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # (seq, heads, head_dim)

        q, k = self.apply_rope(cos, sin, q, k)

        q, k, v = q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2)
        attn_weights = jnp.matmul(q, k.transpose(0, 2, 1)) * self.scale
        attn_weights = jax.nn.softmax(attn_weights.astype(jnp.float32), axis=-1).astype(q.dtype)
        out = jnp.matmul(attn_weights, v).transpose(1, 0, 2).reshape(seq_len, -1)
        return self.proj(out, out_sharding=P(None, None))


class Qwen3VLVisionBlock(nnx.Module):
    """Single transformer block for vision encoder."""

    def __init__(self, config: Qwen3VLVisionConfig, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps, rngs=rngs)
        self.norm2 = nnx.LayerNorm(config.hidden_size, epsilon=config.layer_norm_eps, rngs=rngs)
        self.attn = Qwen3VLVisionAttention(config, rngs=rngs)
        self.mlp = Qwen3VLVisionMLP(config, rngs=rngs)

    def __call__(self, hidden_states: Array, position_embeddings: Tuple[Array, Array]) -> Array:
        residual = hidden_states
        hidden_states = self.norm1(hidden_states)
        hidden_states = self.attn(hidden_states, position_embeddings)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.norm2(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class Qwen3VLPatchMerger(nnx.Module):
    """Merge spatial patches after vision encoding."""

    def __init__(self, config: Qwen3VLVisionConfig, use_postshuffle_norm: bool = False, *, rngs: nnx.Rngs):
        self.config = config
        self.shd_cfg = config.shd_cfg
        merge_factor = config.spatial_merge_size**2
        hidden_merged = config.hidden_size * merge_factor
        norm_dim = hidden_merged if use_postshuffle_norm else config.hidden_size
        self.norm = nnx.LayerNorm(norm_dim, epsilon=config.layer_norm_eps, rngs=rngs)
        self.use_postshuffle_norm = use_postshuffle_norm
        self.linear_fc1 = ShardedLinear(
            hidden_merged, hidden_merged, use_bias=True, kernel_sharding=self.shd_cfg.mlp_fc1_kernel, rngs=rngs
        )
        self.linear_fc2 = ShardedLinear(
            hidden_merged, config.out_hidden_size, use_bias=True, kernel_sharding=self.shd_cfg.mlp_fc2_kernel, rngs=rngs
        )

    def __call__(self, x: Array) -> Array:
        if not self.use_postshuffle_norm:
            x = self.norm(x)
        merge_factor = self.config.spatial_merge_size**2
        n_patches = x.shape[0] // merge_factor
        # Remove sharding before reshape (vision ops don't benefit from sharding on seq dim)
        x = shard(x, P(None, None))
        x = x.reshape(n_patches, -1)
        if self.use_postshuffle_norm:
            x = self.norm(x)
        x = self.linear_fc1(x, out_sharding=P(None, None))
        x = nnx.gelu(x)
        return self.linear_fc2(x, out_sharding=P(None, None))


class Qwen3VLVisionModel(nnx.Module):
    """Complete vision encoder with deepstack feature extraction."""

    def __init__(self, config: Qwen3VLVisionConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.shd_cfg = config.shd_cfg
        self.patch_embed = Qwen3VLPatchEmbed(config, rngs=rngs)
        self.pos_embed = nnx.Embed(
            num_embeddings=config.num_position_embeddings, features=config.hidden_size, rngs=rngs
        )
        self.num_grid_per_side = int(config.num_position_embeddings**0.5)
        self.blocks = nnx.List([Qwen3VLVisionBlock(config, rngs=rngs) for _ in range(config.depth)])
        self.merger = Qwen3VLPatchMerger(config, use_postshuffle_norm=False, rngs=rngs)
        self.deepstack_visual_indexes = config.deepstack_visual_indexes
        self.deepstack_merger_list = nnx.List(
            [
                Qwen3VLPatchMerger(config, use_postshuffle_norm=True, rngs=rngs)
                for _ in range(len(config.deepstack_visual_indexes))
            ]
        )

    def _fast_pos_embed_interpolate(self, grid_thw: Array) -> Array:
        """Bilinear interpolation for position embeddings, matching PyTorch."""
        grid_h, grid_w = int(grid_thw[0, 1]), int(grid_thw[0, 2])

        # Create interpolation indices
        h_idxs = jnp.linspace(0, self.num_grid_per_side - 1, grid_h)
        w_idxs = jnp.linspace(0, self.num_grid_per_side - 1, grid_w)

        h_floor = jnp.floor(h_idxs).astype(jnp.int32)
        w_floor = jnp.floor(w_idxs).astype(jnp.int32)
        h_ceil = jnp.clip(h_floor + 1, 0, self.num_grid_per_side - 1)
        w_ceil = jnp.clip(w_floor + 1, 0, self.num_grid_per_side - 1)

        dh = h_idxs - h_floor
        dw = w_idxs - w_floor

        # 2D grid indices for 4 corners
        base_h = h_floor * self.num_grid_per_side
        base_h_ceil = h_ceil * self.num_grid_per_side

        idx00 = (base_h[:, None] + w_floor[None, :]).flatten()
        idx01 = (base_h[:, None] + w_ceil[None, :]).flatten()
        idx10 = (base_h_ceil[:, None] + w_floor[None, :]).flatten()
        idx11 = (base_h_ceil[:, None] + w_ceil[None, :]).flatten()

        # Weights for bilinear interpolation
        w00 = ((1 - dh)[:, None] * (1 - dw)[None, :]).flatten()
        w01 = ((1 - dh)[:, None] * dw[None, :]).flatten()
        w10 = (dh[:, None] * (1 - dw)[None, :]).flatten()
        w11 = (dh[:, None] * dw[None, :]).flatten()

        # Lookup and interpolate
        pos_embeds = (
            self.pos_embed(idx00) * w00[:, None]
            + self.pos_embed(idx01) * w01[:, None]
            + self.pos_embed(idx10) * w10[:, None]
            + self.pos_embed(idx11) * w11[:, None]
        )

        # Apply spatial merge permutation
        merge_size = self.config.spatial_merge_size
        grid_t = int(grid_thw[0, 0])

        # Reshape: (H*W, D) -> (H, W, D)
        pos_embeds = pos_embeds.reshape(grid_h, grid_w, -1)

        # Repeat for temporal dimension
        if grid_t > 1:
            pos_embeds = jnp.tile(pos_embeds[None], (grid_t, 1, 1, 1))  # (T, H, W, D)
        else:
            pos_embeds = pos_embeds[None]  # (1, H, W, D)

        # Permute for spatial merge: (T, H, W, D) -> (T, H//m, m, W//m, m, D) -> (T, H//m, W//m, m, m, D)
        merged_h, merged_w = grid_h // merge_size, grid_w // merge_size
        pos_embeds = pos_embeds.reshape(grid_t, merged_h, merge_size, merged_w, merge_size, -1)
        pos_embeds = pos_embeds.transpose(0, 1, 3, 2, 4, 5)  # (T, merged_h, merged_w, m, m, D)
        pos_embeds = pos_embeds.reshape(-1, pos_embeds.shape[-1])  # Flatten to (seq, D)

        return pos_embeds

    def _rot_pos_emb(self, grid_thw: Array) -> Tuple[Array, Array]:
        """Compute rotary position embeddings matching PyTorch rot_pos_emb."""
        merge_size = self.config.spatial_merge_size
        grid_h, grid_w = int(grid_thw[0, 1]), int(grid_thw[0, 2])
        grid_t = int(grid_thw[0, 0])

        # Compute merged dimensions
        merged_h, merged_w = grid_h // merge_size, grid_w // merge_size

        # Compute position indices for each patch
        block_rows = jnp.arange(merged_h)
        block_cols = jnp.arange(merged_w)
        intra_row = jnp.arange(merge_size)
        intra_col = jnp.arange(merge_size)

        # Full resolution positions
        row_idx = block_rows[:, None, None, None] * merge_size + intra_row[None, None, :, None]
        col_idx = block_cols[None, :, None, None] * merge_size + intra_col[None, None, None, :]

        # Expand and reshape to match spatial merge order: (merged_h, merged_w, m, m) -> (merged_h, merged_w, m, m)
        row_idx = jnp.broadcast_to(row_idx, (merged_h, merged_w, merge_size, merge_size)).reshape(-1)
        col_idx = jnp.broadcast_to(col_idx, (merged_h, merged_w, merge_size, merge_size)).reshape(-1)

        # Repeat for temporal dimension
        if grid_t > 1:
            row_idx = jnp.tile(row_idx, grid_t)
            col_idx = jnp.tile(col_idx, grid_t)

        # Create frequency table - PyTorch uses rotary_dim = head_dim // 2
        # And inv_freq has length rotary_dim // 2 = head_dim // 4
        max_hw = max(grid_h, grid_w)
        head_dim = self.config.head_dim
        rotary_dim = head_dim // 2  # = 32 for head_dim=64
        inv_freq_dim = rotary_dim // 2  # = 16
        inv_freq = 1.0 / (self.config.rope_theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
        seq_positions = jnp.arange(max_hw, dtype=jnp.float32)
        freq_table = jnp.outer(seq_positions, inv_freq)  # (max_hw, rotary_dim//2) = (max_hw, 16)

        # Lookup embeddings for row and col: (seq, rotary_dim//2) each
        row_emb = freq_table[row_idx]  # (seq, 16)
        col_emb = freq_table[col_idx]  # (seq, 16)

        # Concatenate row and col: (seq, 32)
        emb = jnp.concatenate([row_emb, col_emb], axis=-1)

        # Double the embedding (matching PyTorch cat): (seq, 64)
        emb = jnp.concatenate([emb, emb], axis=-1)

        # Apply cos/sin
        cos = jnp.cos(emb)
        sin = jnp.sin(emb)
        return cos, sin

    def __call__(self, hidden_states: Array, grid_thw: Array) -> Tuple[Array, list[Array]]:
        hidden_states = self.patch_embed(hidden_states)
        seq_len = hidden_states.shape[0]

        # Position embeddings with bilinear interpolation
        pos_embeds = self._fast_pos_embed_interpolate(grid_thw)
        hidden_states = hidden_states + pos_embeds[:seq_len]

        # RoPE embeddings
        cos, sin = self._rot_pos_emb(grid_thw)
        position_embeddings = (cos[:seq_len], sin[:seq_len])

        deepstack_features = []
        for layer_idx, block in enumerate(self.blocks):
            hidden_states = block(hidden_states, position_embeddings)
            if layer_idx in self.deepstack_visual_indexes:
                ds_idx = list(self.deepstack_visual_indexes).index(layer_idx)
                deepstack_features.append(self.deepstack_merger_list[ds_idx](hidden_states))

        hidden_states = self.merger(hidden_states)
        return hidden_states, deepstack_features


class LayerCache(nnx.Module):
    """KV-cache for a single decoder layer."""

    def __init__(self, config: Qwen3VLTextConfig, batch_size: int, cache_size: int, dtype: jnp.dtype = jnp.bfloat16):
        cache_shape = (batch_size, cache_size, config.num_key_value_heads, config.head_dim)
        shd = config.shd_cfg
        self.k_cache = nnx.Cache(shard(jnp.zeros(cache_shape, dtype=dtype), shd.cache))
        self.v_cache = nnx.Cache(shard(jnp.zeros(cache_shape, dtype=dtype), shd.cache))
        self.size = cache_size
        self.cur_ind = nnx.Variable(jnp.zeros((), dtype=jnp.int32))


Cache: TypeAlias = list[LayerCache]


def init_cache(
    config: ModelConfig, batch_size: int, token_len: int, generate_steps: int, dtype: jnp.dtype = jnp.bfloat16
) -> Cache:
    """Initialize KV-cache for all layers."""
    cache_size = 2 ** math.ceil(math.log2(max(token_len + generate_steps, 1)))
    return [
        LayerCache(config.text_config, batch_size, cache_size, dtype)
        for _ in range(config.text_config.num_hidden_layers)
    ]


class Qwen3VLMLP(nnx.Module):
    """SiLU-gated MLP for text decoder."""

    def __init__(self, config: Qwen3VLTextConfig, *, rngs: nnx.Rngs):
        self.shd_cfg = config.shd_cfg
        self.gate_proj = ShardedLinear(
            config.hidden_size,
            config.intermediate_size,
            use_bias=False,
            kernel_sharding=self.shd_cfg.mlp_gate_up_kernel,
            rngs=rngs,
        )
        self.up_proj = ShardedLinear(
            config.hidden_size,
            config.intermediate_size,
            use_bias=False,
            kernel_sharding=self.shd_cfg.mlp_gate_up_kernel,
            rngs=rngs,
        )
        self.down_proj = ShardedLinear(
            config.intermediate_size,
            config.hidden_size,
            use_bias=False,
            kernel_sharding=self.shd_cfg.mlp_down_kernel,
            rngs=rngs,
        )

    def __call__(self, x: Array) -> Array:
        gate = self.gate_proj(x, out_sharding=self.shd_cfg.act_btf)
        up = self.up_proj(x, out_sharding=self.shd_cfg.act_btf)
        activations = nnx.silu(gate) * up
        return self.down_proj(activations, out_sharding=self.shd_cfg.act_btd)


def _generate_rope(positions: Array, head_dim: int, rope_theta: float) -> Tuple[Array, Array]:
    """Generate RoPE cos/sin embeddings."""
    fraction = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    timescale = rope_theta**fraction
    sinusoid_inp = jnp.einsum(
        "bt,k->btk", positions.astype(jnp.float32), 1.0 / timescale, precision=jax.lax.Precision.HIGHEST
    )
    return jnp.sin(sinusoid_inp), jnp.cos(sinusoid_inp)


def rotate_half(x: Array) -> Array:
    """Rotate half the hidden dims of the input: (-x2, x1)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rotary_pos_emb(x: Array, cos: Array, sin: Array) -> Array:
    """Apply rotary position embeddings using rotate_half pattern.

    This is the standard RoPE formula: (x * cos) + (rotate_half(x) * sin)
    Works for both vision (seq, heads, dim) and text (batch, seq, heads, dim).
    """
    return (x * cos) + (rotate_half(x) * sin)


def _apply_rope(x: Array, sin: Array, cos: Array) -> Array:
    """Apply rotary position embeddings for text model.

    Note: sin/cos have shape (batch, seq, head_dim//2) and need broadcasting.
    """
    # Expand sin/cos for heads dimension: (batch, seq, 1, head_dim//2)
    sin, cos = sin[:, :, None, :], cos[:, :, None, :]
    # Duplicate to full head_dim for rotate_half pattern
    cos_full = jnp.concatenate([cos, cos], axis=-1)
    sin_full = jnp.concatenate([sin, sin], axis=-1)
    return apply_rotary_pos_emb(x, cos_full, sin_full)


def repeat_kv(hidden_states: Array, n_rep: int) -> Array:
    """Repeat KV heads for GQA using reshape+tile for sharding compatibility."""
    if n_rep == 1:
        return hidden_states
    b, t, kv_heads, head_dim = hidden_states.shape
    # Reshape to add a dimension, tile, then reshape back
    # This avoids jnp.repeat which requires out_sharding under mesh context
    hidden_states = hidden_states[:, :, :, None, :]  # (b, t, kv_heads, 1, head_dim)
    hidden_states = jnp.tile(hidden_states, (1, 1, 1, n_rep, 1))  # (b, t, kv_heads, n_rep, head_dim)
    return hidden_states.reshape(b, t, kv_heads * n_rep, head_dim)


class Qwen3VLAttention(nnx.Module):
    """Text decoder attention with GQA and Q/K normalization."""

    def __init__(self, config: Qwen3VLTextConfig, layer_idx: int, *, rngs: nnx.Rngs):
        self.config = config
        self.shd_cfg = config.shd_cfg
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.n_rep = self.num_heads // self.num_kv_heads
        self.scale = self.head_dim**-0.5

        self.q_proj = ShardedLinear(
            config.hidden_size,
            self.num_heads * self.head_dim,
            use_bias=config.attention_bias,
            kernel_sharding=self.shd_cfg.q_weight,
            rngs=rngs,
        )
        self.k_proj = ShardedLinear(
            config.hidden_size,
            self.num_kv_heads * self.head_dim,
            use_bias=config.attention_bias,
            kernel_sharding=self.shd_cfg.kv_weight,
            rngs=rngs,
        )
        self.v_proj = ShardedLinear(
            config.hidden_size,
            self.num_kv_heads * self.head_dim,
            use_bias=config.attention_bias,
            kernel_sharding=self.shd_cfg.kv_weight,
            rngs=rngs,
        )
        self.o_proj = ShardedLinear(
            self.num_heads * self.head_dim,
            config.hidden_size,
            use_bias=config.attention_bias,
            kernel_sharding=self.shd_cfg.o_weight,
            rngs=rngs,
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, rngs=rngs)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, rngs=rngs)

    def __call__(self, x: Array, cache: LayerCache, sin: Array, cos: Array, mask: Array | None) -> Array:
        batch, seq_len, _ = x.shape
        shd = self.shd_cfg

        q_out = self.q_proj(x, out_sharding=shd.act_btd)
        k_out = self.k_proj(x, out_sharding=shd.act_btd)
        v_out = self.v_proj(x, out_sharding=shd.act_btd)

        q = shard(self.q_norm(q_out.reshape(batch, seq_len, self.num_heads, self.head_dim)), shd.act_btnh)
        k = shard(self.k_norm(k_out.reshape(batch, seq_len, self.num_kv_heads, self.head_dim)), shd.act_btnh)
        v = shard(v_out.reshape(batch, seq_len, self.num_kv_heads, self.head_dim), shd.act_btnh)

        q = _apply_rope(q, sin, cos)
        k = _apply_rope(k, sin, cos)

        # Update cache - cast to cache dtype
        cache_dtype = cache.k_cache[...].dtype
        k_cached = k.astype(cache_dtype)
        v_cached = v.astype(cache_dtype)
        slice_indices = (0, cache.cur_ind[...], 0, 0)
        cache.k_cache[...] = jax.lax.dynamic_update_slice(cache.k_cache[...], k_cached, slice_indices)
        cache.v_cache[...] = jax.lax.dynamic_update_slice(cache.v_cache[...], v_cached, slice_indices)

        k = shard(repeat_kv(cache.k_cache[...], self.n_rep), shd.act_btnh)
        v = shard(repeat_kv(cache.v_cache[...], self.n_rep), shd.act_btnh)

        # Transpose to (B, heads, T, dim) and re-shard for attention
        q = shard(q.transpose(0, 2, 1, 3), shd.act_bhsd)
        k = shard(k.transpose(0, 2, 1, 3), shd.act_bhsd)
        v = shard(v.transpose(0, 2, 1, 3), shd.act_bhsd)

        # Attention: TP shards heads (axis 1), safe for any seq_len
        attn_weights = shard(
            jnp.matmul(q, k.transpose(0, 1, 3, 2)) * self.scale,
            shd.attn_logit_shd,
        )

        if mask is not None:
            attn_weights = jnp.where(mask, attn_weights, _K_MASK)
        attn_weights = jax.nn.softmax(attn_weights.astype(jnp.float32), axis=-1).astype(q.dtype)
        attn_out = shard(jnp.matmul(attn_weights, v), shd.act_bhsd)
        attn_out = attn_out.transpose(0, 2, 1, 3).reshape(batch, seq_len, -1)

        cache.cur_ind[...] = cache.cur_ind[...] + seq_len
        return self.o_proj(attn_out, out_sharding=shd.act_btd)


class Qwen3VLDecoderLayer(nnx.Module):
    """Single decoder layer for text model."""

    def __init__(self, config: Qwen3VLTextConfig, layer_idx: int, *, rngs: nnx.Rngs):
        self.self_attn = Qwen3VLAttention(config, layer_idx, rngs=rngs)
        self.mlp = Qwen3VLMLP(config, rngs=rngs)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, rngs=rngs)

    def __call__(self, x: Array, cache: LayerCache, sin: Array, cos: Array, mask: Array | None) -> Array:
        x = x + self.self_attn(self.input_layernorm(x), cache, sin, cos, mask)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class Qwen3VLTextModel(nnx.Module):
    """Text decoder model."""

    def __init__(self, config: Qwen3VLTextConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.shd_cfg = config.shd_cfg
        self.embed_tokens = ShardedEmbedding(num_embeddings=config.vocab_size, features=config.hidden_size, rngs=rngs)
        self.layers = nnx.List([Qwen3VLDecoderLayer(config, i, rngs=rngs) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, rngs=rngs)

    def __call__(self, inputs_embeds: Array, cache: Cache, sin: Array, cos: Array, mask: Array | None) -> Array:
        hidden_states = inputs_embeds  # Already sharded when passed in
        for i, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states, cache[i], sin, cos, mask)
        return self.norm(hidden_states)


def merge_modalities(img_emb: Array, text_emb: Array, token_mask: Array) -> Array:
    """Merge image embeddings into text sequence at masked positions."""
    img_indices = jnp.cumsum(token_mask) - 1
    safe_indices = jnp.clip(img_indices, 0, img_emb.shape[0] - 1)
    aligned_images = img_emb[safe_indices]
    return jnp.where(token_mask[:, None], aligned_images, text_emb)


def batched_merge_modalities(img_emb: Array, text_emb: Array, token_mask: Array) -> Array:
    """Batched version of merge_modalities."""
    return jax.vmap(merge_modalities)(img_emb, text_emb, token_mask)


def make_causal_mask(cache: LayerCache, seq_len: int) -> Array:
    """Create causal attention mask."""
    cache_size = cache.size
    cur_pos = cache.cur_ind[...]
    seq_arange = jnp.arange(seq_len)
    cache_arange = jnp.arange(cache_size)
    mask = (seq_arange[:, None] + cur_pos) >= cache_arange[None, :]
    return mask[None, None, :, :]


class Qwen3VLForConditionalGeneration(nnx.Module):
    """Qwen3-VL model with language modeling head."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = Qwen3VLModel(config, rngs=rngs)
        if config.text_config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ShardedLinear(
                config.text_config.hidden_size,
                config.text_config.vocab_size,
                use_bias=False,
                kernel_sharding=config.text_config.shd_cfg.embed_kernel,
                rngs=rngs,
            )

    def __call__(
        self,
        input_ids: Array,
        pixel_values: Optional[Array] = None,
        image_grid_thw: Optional[Array] = None,
        *,
        cache: Cache,
        token_type_ids: Optional[Array] = None,
    ) -> Array:
        """Forward pass with KV-cache."""
        batch, seq_len = input_ids.shape
        shd = self.config.text_config.shd_cfg

        # Generate position embeddings
        positions = jnp.arange(seq_len)[None, :] + cache[0].cur_ind[...]
        positions = jnp.broadcast_to(positions, (batch, seq_len))
        sin, cos = _generate_rope(positions, self.config.text_config.head_dim, self.config.text_config.rope_theta)

        # Create causal mask
        mask = make_causal_mask(cache[0], seq_len)

        # Get text embeddings using ShardedEmbedding with explicit out_sharding
        inputs_embeds = self.model.language_model.embed_tokens(input_ids, out_sharding=shd.act_btd)

        # Merge vision if provided
        if pixel_values is not None and image_grid_thw is not None and token_type_ids is not None:
            vision_embeds, _ = self.model.visual(pixel_values, image_grid_thw)
            # Broadcast vision_embeds for batch
            vision_embeds_batched = jnp.broadcast_to(
                vision_embeds[None], (batch, vision_embeds.shape[0], vision_embeds.shape[1])
            )
            # Unshard inputs before vmap (vmap requires uniform sharding on mapped axis)
            inputs_embeds_unsharded = shard(inputs_embeds, P(None, None, None))
            token_type_ids_unsharded = shard(token_type_ids, P(None, None))
            merged = batched_merge_modalities(vision_embeds_batched, inputs_embeds_unsharded, token_type_ids_unsharded)
            # Reshard output
            inputs_embeds = shard(merged, shd.act_btd)

        hidden_states = self.model.language_model(inputs_embeds, cache, sin, cos, mask)

        # Compute logits
        logits_sharding = P(shd.act_btd[0], None, None)  # (batch, seq, vocab)
        if self.lm_head is not None:
            logits = self.lm_head(hidden_states, out_sharding=logits_sharding)
        else:
            # Use attend() method for tied embeddings
            logits = self.model.language_model.embed_tokens.attend(hidden_states, out_sharding=logits_sharding)

        return logits

    @classmethod
    def from_pretrained(cls, model_name: str, config: ModelConfig | None = None):
        """model_name the *model id* of a pretrained model hosted inside
        a model repo on huggingface.co. For example, "google/gemma3-4b-it".
        Note that access to the model is restricted and you need to be authorized to access it.
        """
        from huggingface_hub import snapshot_download
        from bonsai.models.qwen3_vl import params

        if config is None:
            config_map = {
                "Qwen/Qwen3-VL-2B-Instruct": ModelConfig.qwen3vl_2b,
                "Qwen/Qwen3-VL-4B-Instruct": ModelConfig.qwen3vl_4b,
                "Qwen/Qwen3-VL-8B-Instruct": ModelConfig.qwen3vl_8b,
                "Qwen/Qwen3-VL-32B-Instruct": ModelConfig.qwen3vl_32b,
            }
            if model_name not in config_map:
                raise ValueError(f"Model name '{model_name}' is unknown, please provide config argument")
            config = config_map[model_name]()

        model_ckpt_path = snapshot_download(repo_id=model_name, allow_patterns="*.safetensors")
        return params.create_model_from_safe_tensors(model_ckpt_path, config)


class Qwen3VLModel(nnx.Module):
    """Qwen3-VL backbone model."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.visual = Qwen3VLVisionModel(config.vision_config, rngs=rngs)
        self.language_model = Qwen3VLTextModel(config.text_config, rngs=rngs)


@jax.jit
def forward(model: Qwen3VLForConditionalGeneration, cache: Cache, input_ids: Array) -> Tuple[Array, Cache]:
    """JIT-compiled forward pass for text-only generation."""
    logits = model(input_ids, cache=cache)
    return logits[:, -1, :], cache


# TODO: Add jit compilation support by fixing image size
def forward_vision(
    model: Qwen3VLForConditionalGeneration,
    cache: Cache,
    input_ids: Array,
    pixel_values: Array,
    image_grid_thw: Array,
    token_type_ids: Array,
) -> Tuple[Array, Cache]:
    """Forward pass with vision inputs (not JIT - vision has data-dependent shapes)."""
    logits = model(input_ids, pixel_values, image_grid_thw, cache=cache, token_type_ids=token_type_ids)
    return logits[:, -1, :], cache
