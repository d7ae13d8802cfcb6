"""The adapter's contribution to a layer's output, `scaling * (x A) B`, computed
along the low-rank path: never `A B`, never a second copy of the layer's weight.

Each function takes the layer's input as the layer receives it and returns what to
add to its output. The adapter computes in its own dtype (PEFT casts the input to
`lora_A`'s dtype) and the result is cast to the layer output's dtype by the caller.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp


def dropout(x: jax.Array, rate: float, key: Any) -> jax.Array:
    """Inverted dropout of `x` at `rate` (none without a key), as `torch.nn.Dropout`."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def dense_flax(
    x: jax.Array, a: jax.Array, b: jax.Array, scaling: float, n_in: int
) -> jax.Array:
    """A dense or per-head layer in the `"flax"` layout.

    `x`: `(..., *in_features)`, the last `n_in` axes contracted; `a`: `(prod(in),
    rank)`; `b`: `(rank, prod(out))`. Returns `(..., prod(out))`: the caller reshapes
    it to the layer's output features.
    """
    lead = x.shape[: x.ndim - n_in]
    flat = x.reshape(lead + (math.prod(x.shape[x.ndim - n_in :]),)).astype(a.dtype)
    return ((flat @ a) @ b) * jnp.asarray(scaling, a.dtype)


def embed_flax(ids: jax.Array, a: jax.Array, b: jax.Array, scaling: float) -> jax.Array:
    """An embedding in the `"flax"` layout: `a (num, rank)`, `b (rank, dim)`."""
    return (jnp.take(a, ids, axis=0) @ b) * jnp.asarray(scaling, a.dtype)
