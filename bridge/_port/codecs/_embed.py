"""Codec: `Embed` (Linen `nn.Embed`, NNX `nnx.Embed`, Equinox `eqx.nn.Embedding`).

Canonical: `embedding` shape `(num_embeddings, features)`; Equinox calls it `weight`,
same layout; so does PyTorch's `nn.Embedding`.
"""

from __future__ import annotations

import equinox as eqx
import jax
from flax import nnx

from .._codec import Codec, Leaves, of_class, register_codec, same, same_as_like
from ._torch import by_class, register_torch, shape_of


def _linen(cls, leaves: Leaves) -> bool:
    return set(leaves) == {"embedding"} and leaves["embedding"].ndim == 2


def _eqx_build(canonical: Leaves, options) -> eqx.nn.Embedding:
    table = canonical["embedding"]
    return eqx.nn.Embedding(*table.shape, dtype=table.dtype, key=jax.random.key(0))


EMBED_LINEN = register_codec(
    Codec("Embed", "linen", _linen, same, same_as_like, names=("Embed",))
)
EMBED_NNX = register_codec(
    Codec("Embed", "nnx", of_class(nnx.Embed), same, same_as_like)
)
EMBED_EQUINOX = register_codec(
    Codec(
        "Embed",
        "equinox",
        of_class(eqx.nn.Embedding),
        lambda leaves, hyper: {"embedding": leaves["weight"]},
        lambda canonical, like, hyper: {"weight": canonical["embedding"]},
        layout="weight",
        build=_eqx_build,
    )
)

# --- PyTorch: nn.Embedding -----------------------------------------------------------


@by_class("Embedding")
def _torch_embed(leaves: Leaves) -> bool:
    w = shape_of(leaves, "weight")
    return set(leaves) == {"weight"} and w is not None and len(w) == 2


EMBED_TORCH = register_torch(
    "Embed",
    _torch_embed,
    lambda leaves, hyper: {"embedding": leaves["weight"]},
    lambda canonical, like, hyper: {"weight": canonical["embedding"]},
    lambda layer: {},
    "torch weight",
    {},
)
