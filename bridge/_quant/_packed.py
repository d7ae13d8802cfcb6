"""compressed-tensors' integer formats (`llm-compressor` checkpoints), dequantized as
its own compressors do:

- `pack-quantized`: `weight_packed` int32 `(rows, ceil(cols * bits / 32))`, each
  group of 32 consecutive values packed densely into `bits` words (value `i` of a
  row at bit `i * bits`, offset by `2**(bits-1)`), `weight_shape` `(rows, cols)`,
  `weight_scale` and, when asymmetric, `weight_zero_point` packed along its rows;
- `int-quantized`: `weight` int8 with `weight_scale` (and `weight_zero_point`).

The scale is per tensor `(1,)`, per output row `(rows, 1)` or per group of
`group_size` columns `(rows, cols / group_size)`; with activation ordering
(`actorder: group`, GPTQ's `desc_act`) `weight_g_idx` `(cols,)` names each column's
group. A value is `(q - zero) * scale`, computed in the scale's dtype.
"""

from __future__ import annotations

import numpy as np


def unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The `count` signed `bits`-bit values of each row of `packed` (int32 words), as
    int8, shape `(*packed.shape[:-1], count)`.

    ```python
    >>> import numpy as np
    >>> unpack(np.array([[0x76543210]], np.uint32).view(np.int32), 4, 8)
    array([[-8, -7, -6, -5, -4, -3, -2, -1]], dtype=int8)

    ```
    """
    values = unpack_unsigned(packed, bits, count).astype(np.int16)
    return (values - (1 << (bits - 1))).astype(np.int8)


def unpack_unsigned(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first `count` unsigned `bits`-bit values of each row of `packed` (int32
    words read as one little-endian bit stream: value `i` at bit `i * bits`, across
    word boundaries when 32 is not a multiple of `bits`), as uint8.

    ```python
    >>> import numpy as np
    >>> words = np.array([[(5 << 30) & 0xFFFFFFFF, 5 >> 2]], np.uint32)
    >>> unpack_unsigned(words.view(np.int32), 3, 12)[0, 10:]
    array([5, 0], dtype=uint8)

    ```
    """
    words = np.ascontiguousarray(packed).view(np.uint32)
    if bits == 4:  # two values a byte, the first in the low nibble
        data = words.astype("<u4").view(np.uint8)
        values = np.stack([data & 0x0F, data >> 4], -1).reshape(*data.shape[:-1], -1)
    elif bits == 8:
        values = words.astype("<u4").view(np.uint8)
    else:
        lead = words.shape[:-1]
        wide = np.concatenate([words, np.zeros((*lead, 1), np.uint32)], -1)
        wide = wide.astype(np.uint64)
        start = np.arange(count, dtype=np.int64) * bits
        pair = wide[..., start // 32] | (wide[..., start // 32 + 1] << np.uint64(32))
        shifted = pair >> (start % 32).astype(np.uint64)
        values = (shifted & np.uint64((1 << bits) - 1)).astype(np.uint8)
    return values[..., :count]


def dequantize(
    values: np.ndarray,
    scale: np.ndarray,
    zero: np.ndarray | None,
    dtype,
    g_idx: np.ndarray | None = None,
) -> np.ndarray:
    """`(values - zero) * scale` in `scale`'s dtype, as `dtype`; `scale` and `zero`
    of shape `(1,)`, `(rows, 1)` or `(rows, groups)` (each group `cols / groups`
    consecutive columns, or with `g_idx` `(cols,)` column `j` in group `g_idx[j]`:
    activation ordering)."""
    rows, cols = values.shape[-2:]
    if scale.ndim < 2:
        scale = scale.reshape((1,) * (values.ndim - scale.ndim) + scale.shape)
    groups = scale.shape[-1]

    def spread(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32)
        if g_idx is not None:
            return x[..., np.asarray(g_idx).astype(np.int64)]
        return np.repeat(x, cols // groups, -1)

    q = values.astype(np.float32)
    if zero is not None:
        q -= spread(zero.reshape(scale.shape))
    q *= spread(scale)
    return q.astype(scale.dtype).astype(dtype)
