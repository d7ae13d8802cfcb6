"""Layout changes that keep a host array on the host.

A weight read from a file or a state dict is a numpy array. `jnp.transpose` of it is
an eager XLA computation: the array copied to the device, transposed there (a second
copy), and the transpose compiled once per distinct shape (about 1 s each on a loaded
2-core machine, and a model has many shapes). `transpose` and `flip` here give numpy
views of such an array (no copy, nothing compiled); the port copies each once into the
model's JAX array (`bridge._buffers.to_jax`: XLA's host transpose for a transposed
view; no copy at all for a view back to the layout read from the file, as PyTorch ->
canonical -> Equinox). JAX arrays and tracers (`jax.eval_shape`, `jax.jit`) go through
`jnp` as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np


def transpose(x: Any, axes: Sequence[int] | None = None) -> Any:
    """`jnp.transpose(x, axes)`; a numpy `x` gives a numpy view (no copy)."""
    if isinstance(x, np.ndarray):
        return np.transpose(x, axes)
    return jnp.transpose(x, axes)


def flip(x: Any, axes: Sequence[int]) -> Any:
    """`jnp.flip(x, axes)`; a numpy `x` gives a numpy view (no copy)."""
    if isinstance(x, np.ndarray):
        return np.flip(x, tuple(axes))
    return jnp.flip(x, tuple(axes))
