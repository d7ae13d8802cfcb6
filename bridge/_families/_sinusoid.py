"""Sinusoidal position tables, recognised by their values: the fixed `(positions,
dim)` tables some PyTorch models store as a weight (transformers' Marian, Pegasus
and RoFormer `embed_positions.weight`; DistilBERT's `position_embeddings` with
`sinusoidal_pos_embds`) where their Flax twins compute the same table on the fly and
hold no array for it. Such a table is no learned weight: a port may leave it out
(`bridge.port(strict=False)`), a learned table never.

The variants real code computes, position `p`, column `j` of `d`:

- `halves` (Marian, Pegasus, RoFormer, XLM; transformers' Flax
  `create_sinusoidal_positions`): angles `p / 10000 ** (2 * (j // 2) / d)`, the
  sines of the even columns' angles first, then the cosines of the odd ones;
- `interleaved` ("Attention is all you need", DistilBERT): the same angles, sine
  on even columns, cosine on odd ones;
- `tensor2tensor` (fairseq, M2M-100, XGLM, Speech2Text, Whisper's `sinusoids`):
  `h = d // 2` frequencies `exp(-k * log(10000) / (h - 1))`, sines then cosines, a
  zero column when `d` is odd.

One row of zeros is allowed where the formula has none (fairseq's `padding_idx`
row).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np


def _angles(n: int, d: int) -> np.ndarray:
    j = np.arange(d)
    return np.arange(n)[:, None] / np.power(10000.0, 2 * (j // 2) / d)[None, :]


def _halves(n: int, d: int) -> np.ndarray | None:
    angles, out = _angles(n, d), np.empty((n, d))
    half = d // 2 + d % 2
    out[:, :half] = np.sin(angles[:, 0::2])
    out[:, half:] = np.cos(angles[:, 1::2])
    return out


def _interleaved(n: int, d: int) -> np.ndarray | None:
    angles, out = _angles(n, d), np.empty((n, d))
    out[:, 0::2] = np.sin(angles[:, 0::2])
    out[:, 1::2] = np.cos(angles[:, 1::2])
    return out


def _tensor2tensor(n: int, d: int) -> np.ndarray | None:
    half = d // 2
    if half < 2:
        return None
    times = np.arange(n)[:, None] * np.exp(
        np.arange(half) * -(math.log(10000) / (half - 1))
    )
    out = np.zeros((n, d))
    out[:, :half], out[:, half : 2 * half] = np.sin(times), np.cos(times)
    return out


VARIANTS: dict[str, Callable[[int, int], np.ndarray | None]] = {
    "halves": _halves,
    "interleaved": _interleaved,
    "tensor2tensor": _tensor2tensor,
}
"""The formulas, by name: `formula(positions, dim)` -> the table in float64 (None
where the formula is undefined for `dim`)."""


def sinusoid(array: Any) -> str | None:
    """The variant (a key of `VARIANTS`) whose table `array` holds, else None.

    **Arguments:**

    - `array`: a concrete array (numpy, JAX; any float dtype) of shape
      `(positions, dim)`, at least 2 x 2. Anything else (an abstract array, another
      rank, integers) gives None.

    **Returns:**

    The variant's name when every value is finite and equals the formula's within
    the rounding of the array's dtype (plus float32 arithmetic on the angles, which
    grows with the position: `2 eps(dtype) + 8 eps(float32) (p + 1)` at row `p`),
    one row of zeros allowed; else None (NaN and inf never equal the formula).

    **Example:**

    ```python
    >>> import numpy as np
    >>> from bridge._families._sinusoid import VARIANTS, sinusoid
    >>> table = VARIANTS["halves"](32, 16).astype(np.float32)
    >>> sinusoid(table), sinusoid(table + 1e-3)
    ('halves', None)

    ```
    """
    shape = getattr(array, "shape", None)
    dtype = getattr(array, "dtype", None)
    if shape is None or len(shape) != 2 or min(shape) < 2 or dtype is None:
        return None
    try:  # the first rows alone first: a learned table fails there, cheaply
        if not jnp.issubdtype(dtype, jnp.floating):
            return None
        eps = float(jnp.finfo(dtype).eps)
        head = np.asarray(array[:HEAD], dtype=np.float64)
    except (TypeError, ValueError, RuntimeError):  # abstract, not addressable
        return None
    n, d = shape
    tolerance = 2 * eps + 8 * float(np.finfo(np.float32).eps) * np.arange(1, n + 1)
    fitting = []
    for name, formula in VARIANTS.items():
        want = formula(min(n, HEAD), d)
        if want is not None and _misses(head, want, tolerance) <= 1:
            fitting.append(name)
    if not fitting:
        return None
    values = np.asarray(array, dtype=np.float64)
    for name in fitting:
        if _misses(values, VARIANTS[name](n, d), tolerance) <= 1:
            return name  # exact, or but one row of zeros (a padding index)
    return None


HEAD = 4
"""The rows compared before the whole table is read (a memory-mapped file's
table is then touched only there)."""


def _misses(values: Any, want: Any, tolerance: Any) -> int:
    """How many rows of `values` the formula's `want` misses where each is a row
    of zeros; more than there are rows where one is not."""
    # `<=` is false for NaN: a NaN misses (`>` would let it match anything)
    off = ~(np.abs(values - want) <= tolerance[: len(want), None]).all(axis=1)
    zero = ~values.any(axis=1)
    return int(off.sum()) if zero[off].all() else len(want) + 1
