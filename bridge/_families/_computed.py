"""Arrays a model computes from its config that some implementations store: told by
their values, never by their names.

- a sinusoidal position table (`_sinusoid`: Marian's `embed_positions`);
- rotary inverse frequencies `1 / base ** (arange(0, d, 2) / d)` (a `inv_freq`
  buffer, persistent in some models: ESM's);
- position ids `0, 1, ..., n - 1` (`(n,)` or `(1, n)`, integers);
- a causal mask (lower-triangular ones, boolean or 0/1, `(n, n)` with leading axes
  of length 1: GPT-2's `bias` buffer).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._sinusoid import sinusoid


def computed(array: Any) -> str | None:
    """What `array` (concrete: numpy, JAX) holds of the above, in words, else None.

    ```python
    >>> import numpy as np
    >>> computed(1.0 / 10000 ** (np.arange(0, 8, 2) / 8))
    'rotary inverse frequencies (base 10000)'
    >>> computed(np.arange(5)[None]), computed(np.tril(np.ones((4, 4), bool)))
    ('position ids (5)', 'causal mask (4 x 4)')
    >>> computed(np.ones(4)) is None
    True

    ```
    """
    shape = tuple(getattr(array, "shape", ()) or ())
    dtype = getattr(array, "dtype", None)
    if dtype is None or not shape:
        return None
    table = sinusoid(array)
    if table is not None:
        return f"sinusoidal position table ({table})"
    core = shape[next((i for i, n in enumerate(shape) if n != 1), len(shape)) :]
    try:
        values = np.asarray(array).reshape(core)
    except (TypeError, ValueError, RuntimeError):  # abstract, not addressable
        return None
    kind = np.dtype(values.dtype).kind
    if len(core) == 1 and kind in "iu" and core[0] > 1:
        return f"position ids ({core[0]})" if _arange(values) else None
    if len(core) == 1 and kind == "f" and core[0] > 1:
        base = _inverse_frequencies(values)
        return None if base is None else f"rotary inverse frequencies (base {base:g})"
    if len(core) == 2 and core[0] == core[1] > 1 and kind in "biuf":
        return f"causal mask ({core[0]} x {core[1]})" if _causal(values) else None
    return None


def _arange(values: np.ndarray) -> bool:
    return bool(np.array_equal(values, np.arange(len(values))))


def _inverse_frequencies(values: np.ndarray) -> float | None:
    """The `base` of `1 / base ** (arange(0, d, 2) / d)`, `d = 2 * len(values)`,
    that `values` equal within float32 rounding, else None."""
    values = values.astype(np.float64)
    if not np.all(np.isfinite(values)) or not np.all(values > 0):
        return None
    n = len(values)
    if abs(values[0] - 1) > 1e-6 or values[1] >= 1:
        return None
    base = float(values[1] ** (-n))  # values[1] = base ** (-2 / d) = base ** (-1/n)
    want = 1.0 / base ** (np.arange(0, 2 * n, 2) / (2 * n))
    if not np.allclose(values, want, rtol=1e-5, atol=0):
        return None
    rounded = round(base)
    return float(rounded) if abs(rounded - base) <= 1e-3 * base else base


def _causal(values: np.ndarray) -> bool:
    ones = np.tril(np.ones(values.shape, bool))
    return bool(np.array_equal(values.astype(bool), ones)) and bool(
        np.all((values == 0) | (values == 1))
    )
