"""A tiny Llama written in NNX the way Hugging Face's `modeling_llama.py` computes it
(RMSNorm, rotary embeddings, grouped-query attention, SwiGLU), with the Hugging Face
names, and the matching `transformers.LlamaConfig`."""

import jax
import jax.numpy as jnp
from flax import nnx


VOCAB, DIM, HEADS, KV_HEADS, HIDDEN, LAYERS = 32, 16, 4, 2, 24, 2
EPS, THETA = 1e-6, 10000.0


def llama_config():
    """The `transformers.LlamaConfig` of the same sizes (imports transformers)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=DIM,
        intermediate_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        rms_norm_eps=EPS,
        rope_theta=THETA,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def tokens(batch: int = 2, length: int = 5) -> jax.Array:
    return jax.random.randint(jax.random.key(3), (batch, length), 0, VOCAB)


def rotary(length: int, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """`(cos, sin)`, each `(length, head_dim)`, as Hugging Face's rotary embedding."""
    inv = 1.0 / THETA ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    freqs = jnp.arange(length, dtype=jnp.float32)[:, None] * inv[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """`x`: `(..., T, heads, head_dim)`."""
    half = x.shape[-1] // 2
    turned = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[None, :, None, :] + turned * sin[None, :, None, :]


def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal grouped-query attention; `q (B, T, H, hd)`, `k, v (B, T, KV, hd)`."""
    groups = q.shape[-2] // k.shape[-2]
    k, v = jnp.repeat(k, groups, axis=-2), jnp.repeat(v, groups, axis=-2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(q.shape[-1])
    length = q.shape[1]
    mask = jnp.tril(jnp.ones((length, length), bool))
    scores = jnp.where(mask[None, None], scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)


class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        hd = DIM // HEADS
        self.q_proj = nnx.Linear(DIM, HEADS * hd, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(DIM, KV_HEADS * hd, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(DIM, KV_HEADS * hd, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(HEADS * hd, DIM, use_bias=False, rngs=rngs)

    def __call__(self, x, cos, sin):
        b, t, _ = x.shape
        hd = DIM // HEADS
        q = rotate(self.q_proj(x).reshape(b, t, HEADS, hd), cos, sin)
        k = rotate(self.k_proj(x).reshape(b, t, KV_HEADS, hd), cos, sin)
        v = self.v_proj(x).reshape(b, t, KV_HEADS, hd)
        return self.o_proj(attend(q, k, v).reshape(b, t, DIM))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.gate_proj = nnx.Linear(DIM, HIDDEN, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(DIM, HIDDEN, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(HIDDEN, DIM, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.self_attn = Attention(rngs)
        self.mlp = MLP(rngs)
        self.input_layernorm = nnx.RMSNorm(DIM, epsilon=EPS, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(DIM, epsilon=EPS, rngs=rngs)

    def __call__(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(DIM, epsilon=EPS, rngs=rngs)

    def __call__(self, ids):
        cos, sin = rotary(ids.shape[1], DIM // HEADS)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nnx.Module):
    """`model.layers[i].self_attn.q_proj`, ... `lm_head`: Hugging Face's names."""

    def __init__(self, rngs: nnx.Rngs):
        self.model = LlamaModel(rngs)
        self.lm_head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        return self.lm_head(self.model(ids))
