"""Small models of the shapes public model code has, where porting used to go wrong:

- a ViT (big_vision / google-research `vision_transformer`): a patch `embedding`
  conv, `cls` and `pos_embedding` arrays held next to the encoder blocks, pre-norm
  blocks (`LayerNorm_0`, `MultiHeadDotProductAttention_0`, `LayerNorm_1`,
  `MlpBlock_0`), `encoder_norm`, `head`; in Linen (looped, or `nn.scan`-stacked as
  big_vision's `scan=True`), NNX and Equinox;
- a Gemma-style decoder (Flax's NNX Gemma example): tied embeddings, blocks with
  `pre_attention_norm`, q/k norms over the head dimension, `post_attention_norm`,
  `pre_ffw_norm`, `post_ffw_norm` (many RMSNorms of one shape, told apart by name
  only), a `final_norm`; in NNX and Equinox.

Shapes are tiny. Flax models take batches; Equinox models take one example.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from .helpers import skip_unless


D, HEADS, PATCH, IMAGE, CLASSES = 8, 2, 2, 4, 3
TOKENS = (IMAGE // PATCH) ** 2 + 1
VOCAB, HEAD_DIM = 11, 4


def image(batch=2):
    return jax.random.normal(jax.random.key(11), (batch, IMAGE, IMAGE, 3))


def tokens(batch=2):
    return jax.random.randint(jax.random.key(12), (batch, 5), 0, VOCAB)


# --- ViT -----------------------------------------------------------------------------


class MlpBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(x)))


def _encoder_block(x):
    """The pre-norm encoder block's body, its layers made in the calling module."""
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(h, h)
    return x + MlpBlock()(nn.LayerNorm()(x))


class Encoder1DBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _encoder_block(x)


class ScannedEncoderBlock(nn.Module):
    """The same block in `nn.scan`'s calling convention: `(carry, x) -> (carry, y)`."""

    @nn.compact
    def __call__(self, x, _):
        return _encoder_block(x), None


class LinenViT(nn.Module):
    """big_vision's ViT; `scan=True` stacks the blocks with `nn.scan` (one
    `encoderblock` whose arrays have a leading layer axis), as big_vision's
    `scan=True` does; else `encoderblock_0`, `encoderblock_1`, ..."""

    depth: int = 2
    scan: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(D, (PATCH, PATCH), (PATCH, PATCH), "VALID", name="embedding")(x)
        n = x.shape[0]
        x = jnp.reshape(x, (n, -1, D))
        cls = self.param("cls", nn.initializers.normal(1.0), (1, 1, D))
        x = jnp.concatenate([jnp.tile(cls, (n, 1, 1)), x], axis=1)
        x = x + self.param("pos_embedding", nn.initializers.normal(1.0), (1, TOKENS, D))
        if self.scan:
            blocks = nn.scan(
                ScannedEncoderBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.depth,
            )
            x, _ = blocks(name="encoderblock")(x, None)
        for i in range(0 if self.scan else self.depth):
            x = Encoder1DBlock(name=f"encoderblock_{i}")(x)
        x = nn.LayerNorm(name="encoder_norm")(x)
        return nn.Dense(CLASSES, name="head")(x[:, 0])


def linen_vit(seed=0, scan=False):
    module = LinenViT(scan=scan)
    return module, module.init(jax.random.key(seed), image())


class NNXMlp(nnx.Module):
    def __init__(self, rngs):
        self.Dense_0 = nnx.Linear(D, 2 * D, rngs=rngs)
        self.Dense_1 = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, x):
        return self.Dense_1(nnx.gelu(self.Dense_0(x)))


class NNXEncoderBlock(nnx.Module):
    def __init__(self, rngs):
        self.LayerNorm_0 = nnx.LayerNorm(D, rngs=rngs)
        self.MultiHeadDotProductAttention_0 = nnx.MultiHeadAttention(
            HEADS, D, decode=False, rngs=rngs
        )
        self.LayerNorm_1 = nnx.LayerNorm(D, rngs=rngs)
        self.MlpBlock_0 = NNXMlp(rngs)

    def __call__(self, x):
        h = self.LayerNorm_0(x)
        x = x + self.MultiHeadDotProductAttention_0(h)
        return x + self.MlpBlock_0(self.LayerNorm_1(x))


class NNXViT(nnx.Module):
    """The ViT in NNX: `cls` and `pos_embedding` Params next to an `nnx.List` of
    blocks."""

    def __init__(self, rngs, depth=2):
        self.embedding = nnx.Conv(
            3, D, (PATCH, PATCH), strides=(PATCH, PATCH), padding="VALID", rngs=rngs
        )
        normal = jax.nn.initializers.normal(1.0)
        self.cls = nnx.Param(normal(rngs.params(), (1, 1, D)))
        self.pos_embedding = nnx.Param(normal(rngs.params(), (1, TOKENS, D)))
        self.blocks = nnx.List([NNXEncoderBlock(rngs) for _ in range(depth)])
        self.encoder_norm = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = self.embedding(x)
        n = x.shape[0]
        x = jnp.reshape(x, (n, -1, D))
        x = jnp.concatenate([jnp.tile(self.cls[...], (n, 1, 1)), x], axis=1)
        x = x + self.pos_embedding[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.encoder_norm(x)[:, 0])


class EqxMlp(eqx.Module):
    Dense_0: eqx.nn.Linear
    Dense_1: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.Dense_0 = eqx.nn.Linear(D, 2 * D, key=k1)
        self.Dense_1 = eqx.nn.Linear(2 * D, D, key=k2)

    def __call__(self, x):
        return self.Dense_1(jax.nn.gelu(self.Dense_0(x)))


class EqxEncoderBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: EqxMlp

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(D, eps=1e-6)
        self.attn = eqx.nn.MultiheadAttention(
            HEADS,
            D,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            key=k1,
        )
        self.norm2 = eqx.nn.LayerNorm(D, eps=1e-6)
        self.mlp = EqxMlp(k2)

    def __call__(self, x):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class EqxViT(eqx.Module):
    """The ViT in Equinox, `cls` and `pos_embedding` as plain array fields."""

    embedding: eqx.nn.Conv2d
    cls: jax.Array
    pos_embedding: jax.Array
    blocks: list
    encoder_norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key, depth=2):
        keys = jax.random.split(key, depth + 4)
        self.embedding = eqx.nn.Conv2d(3, D, PATCH, PATCH, key=keys[0])
        self.cls = jax.random.normal(keys[1], (1, 1, D))
        self.pos_embedding = jax.random.normal(keys[2], (1, TOKENS, D))
        self.blocks = [EqxEncoderBlock(k) for k in keys[4:]]
        self.encoder_norm = eqx.nn.LayerNorm(D, eps=1e-6)
        self.head = eqx.nn.Linear(D, CLASSES, key=keys[3])

    def __call__(self, x):
        """`x`: one image, channel-last `(H, W, C)` like the Flax model."""
        x = self.embedding(jnp.transpose(x, (2, 0, 1)))  # (D, h, w)
        x = jnp.reshape(jnp.transpose(x, (1, 2, 0)), (-1, D))
        x = jnp.concatenate([self.cls[0], x], axis=0) + self.pos_embedding[0]
        for block in self.blocks:
            x = block(x)
        return self.head(jax.vmap(self.encoder_norm)(x)[0])


# --- Gemma-style decoder ------------------------------------------------------------


def _rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class NNXAttention(nnx.Module):
    def __init__(self, rngs):
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
        self.q_proj = linear(D, HEADS * HEAD_DIM)
        self.k_proj = linear(D, HEADS * HEAD_DIM)
        self.v_proj = linear(D, HEADS * HEAD_DIM)
        self.o_proj = linear(HEADS * HEAD_DIM, D)
        self.q_norm = nnx.RMSNorm(HEAD_DIM, rngs=rngs)
        self.k_norm = nnx.RMSNorm(HEAD_DIM, rngs=rngs)

    def __call__(self, x):
        split = lambda y: jnp.reshape(y, y.shape[:-1] + (HEADS, HEAD_DIM))  # noqa: E731
        q = self.q_norm(split(self.q_proj(x)))
        k = self.k_norm(split(self.k_proj(x)))
        v = split(self.v_proj(x))
        weights = jax.nn.softmax(jnp.einsum("...qhd,...khd->...hqk", q, k), axis=-1)
        out = jnp.einsum("...hqk,...khd->...qhd", weights, v)
        return self.o_proj(jnp.reshape(out, out.shape[:-2] + (-1,)))


class NNXDecoderBlock(nnx.Module):
    def __init__(self, rngs):
        norm = lambda: nnx.RMSNorm(D, rngs=rngs)  # noqa: E731
        self.pre_attention_norm = norm()
        self.attn = NNXAttention(rngs)
        self.post_attention_norm = norm()
        self.pre_ffw_norm = norm()
        self.gate = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, use_bias=False, rngs=rngs)
        self.post_ffw_norm = norm()

    def __call__(self, x):
        x = x + self.post_attention_norm(self.attn(self.pre_attention_norm(x)))
        h = self.pre_ffw_norm(x)
        h = self.down(jax.nn.gelu(self.gate(h)) * self.up(h))
        return x + self.post_ffw_norm(h)


class NNXGemma(nnx.Module):
    def __init__(self, rngs, depth=2):
        skip_unless("NNX")
        self.embedder = nnx.Embed(VOCAB, D, rngs=rngs)
        self.layers = nnx.List([NNXDecoderBlock(rngs) for _ in range(depth)])
        self.final_norm = nnx.RMSNorm(D, rngs=rngs)

    def __call__(self, ids):
        x = self.embedder(ids)
        for layer in self.layers:
            x = layer(x)
        return self.embedder.attend(self.final_norm(x))  # tied embeddings


class EqxAttention(eqx.Module):
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    q_norm: eqx.nn.RMSNorm
    k_norm: eqx.nn.RMSNorm

    def __init__(self, key):
        k = jax.random.split(key, 4)
        linear = lambda i, o, k: eqx.nn.Linear(i, o, use_bias=False, key=k)  # noqa: E731
        self.q_proj = linear(D, HEADS * HEAD_DIM, k[0])
        self.k_proj = linear(D, HEADS * HEAD_DIM, k[1])
        self.v_proj = linear(D, HEADS * HEAD_DIM, k[2])
        self.o_proj = linear(HEADS * HEAD_DIM, D, k[3])
        self.q_norm = eqx.nn.RMSNorm(HEAD_DIM, eps=1e-6, use_bias=False)
        self.k_norm = eqx.nn.RMSNorm(HEAD_DIM, eps=1e-6, use_bias=False)

    def __call__(self, x):
        """`x`: one sequence `(T, D)`."""
        split = lambda y: jnp.reshape(y, (-1, HEADS, HEAD_DIM))  # noqa: E731
        each = lambda f, y: jax.vmap(jax.vmap(f))(y)  # noqa: E731
        q = each(self.q_norm, split(jax.vmap(self.q_proj)(x)))
        k = each(self.k_norm, split(jax.vmap(self.k_proj)(x)))
        v = split(jax.vmap(self.v_proj)(x))
        weights = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q, k), axis=-1)
        out = jnp.einsum("hqk,khd->qhd", weights, v)
        return jax.vmap(self.o_proj)(jnp.reshape(out, (out.shape[0], -1)))


class EqxDecoderBlock(eqx.Module):
    pre_attention_norm: eqx.nn.RMSNorm
    attn: EqxAttention
    post_attention_norm: eqx.nn.RMSNorm
    pre_ffw_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    post_ffw_norm: eqx.nn.RMSNorm

    def __init__(self, key):
        k = jax.random.split(key, 4)
        norm = lambda: eqx.nn.RMSNorm(D, eps=1e-6, use_bias=False)  # noqa: E731
        self.pre_attention_norm = norm()
        self.attn = EqxAttention(k[0])
        self.post_attention_norm = norm()
        self.pre_ffw_norm = norm()
        self.gate = eqx.nn.Linear(D, 2 * D, use_bias=False, key=k[1])
        self.up = eqx.nn.Linear(D, 2 * D, use_bias=False, key=k[2])
        self.down = eqx.nn.Linear(2 * D, D, use_bias=False, key=k[3])
        self.post_ffw_norm = norm()

    def __call__(self, x):
        x = x + jax.vmap(self.post_attention_norm)(
            self.attn(jax.vmap(self.pre_attention_norm)(x))
        )
        h = jax.vmap(self.pre_ffw_norm)(x)
        h = jax.vmap(lambda y: self.down(jax.nn.gelu(self.gate(y)) * self.up(y)))(h)
        return x + jax.vmap(self.post_ffw_norm)(h)


class EqxGemma(eqx.Module):
    embedder: eqx.nn.Embedding
    layers: list
    final_norm: eqx.nn.RMSNorm

    def __init__(self, key, depth=2):
        keys = jax.random.split(key, depth + 1)
        self.embedder = eqx.nn.Embedding(VOCAB, D, key=keys[0])
        self.layers = [EqxDecoderBlock(k) for k in keys[1:]]
        self.final_norm = eqx.nn.RMSNorm(D, eps=1e-6, use_bias=False)

    def __call__(self, ids):
        x = jax.vmap(self.embedder)(ids)
        for layer in self.layers:
            x = layer(x)
        return jax.vmap(self.final_norm)(x) @ self.embedder.weight.T
