"""FP8 weights: block-scaled (DeepSeek-V3, Qwen3-FP8: `weight_scale_inv` per block,
128x128 by default) and per-tensor or per-channel scaled (compressed-tensors'
`float-quantized`: `weight_scale`).

Dequantization is done as transformers' `Fp8Dequantize` does it: the FP8 values and
their scales in float32, one product each, rounded once to the output dtype.
Quantization is `Fp8Quantize`'s: per block, `scale = (1 / max|w|) * 448` (1 for an
all-zero block), `q = clip(w * scale)` rounded to `float8_e4m3fn`,
`weight_scale_inv = 1 / scale`.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np


E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


def grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of the scales of a weight of `shape` in blocks of `block`: the
    leading axes kept, `(ceil(rows / block[0]), ceil(cols / block[1]))` last."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize_blocks(
    weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], dtype
) -> np.ndarray:
    """`weight * scale_inv`, each scale applied to its block, as `dtype`.

    Computed one row of blocks at a time, so that memory holds the FP8 weight, the
    result and one row of blocks in float32.

    **Arguments:**

    - `weight`: FP8, shape `(..., rows, cols)`.
    - `scale_inv`: float32 (or bfloat16, or E8M0), shape `grid(weight.shape, block)`.
    - `block`: `(block_rows, block_cols)`, e.g. `(128, 128)`.
    - `dtype`: the output dtype.

    ```python
    >>> import numpy as np
    >>> w = np.ones((2, 3), E4M3)
    >>> dequantize_blocks(w, np.array([[2.0, 3.0]], np.float32), (2, 2), np.float32)
    array([[2., 2., 3.],
           [2., 2., 3.]], dtype=float32)

    ```
    """
    *lead, rows, cols = weight.shape
    out = np.empty(weight.shape, dtype)
    flat_out = out.reshape(-1, rows, cols)
    flat_weight = weight.reshape(-1, rows, cols)
    scales = scale_inv.astype(np.float32).reshape(-1, *scale_inv.shape[-2:])
    b0, b1 = block
    for i in range(flat_weight.shape[0]):
        for r in range(scales.shape[1]):
            band = slice(r * b0, (r + 1) * b0)
            values = flat_weight[i, band].astype(np.float32)
            values *= np.repeat(scales[i, r], b1)[:cols]
            flat_out[i, band] = values.astype(dtype)
    return out


def dequantize_scaled(weight: np.ndarray, scale: np.ndarray, dtype) -> np.ndarray:
    """`weight * scale`, rounded to the scale's dtype (as compressed-tensors'
    `dequantize` computes it), as `dtype`: one scale for the tensor (`()` or `(1,)`)
    or one per output row (`(rows, 1)`)."""
    values = weight.astype(np.float32)
    values *= scale.astype(np.float32).reshape(scale.shape if scale.ndim == 2 else ())
    return values.astype(scale.dtype).astype(dtype)


def quantize_blocks(
    weight: np.ndarray, block: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """`(float8_e4m3fn weight, float32 weight_scale_inv)` of `weight` in blocks of
    `block` (a partial block at the edges is its own block).

    A block that is exactly FP8 values times one float32 scale (a weight dequantized
    from an FP8 checkpoint) gets that scale back, so its FP8 values and scale are
    written bit for bit as they were read; any other block is quantized as
    transformers' `Fp8Quantize` does.

    ```python
    >>> import numpy as np
    >>> q, s = quantize_blocks(np.array([[1.0, -2.0]], np.float32), (128, 128))
    >>> q.astype(np.float32), s
    (array([[ 224., -448.]], dtype=float32), array([[0.00446429]], dtype=float32))

    ```
    """
    *lead, rows, cols = weight.shape
    b0, b1 = block
    tiles = grid(weight.shape, block)
    padded = np.zeros((*lead, tiles[-2] * b0, tiles[-1] * b1), np.float32)
    padded[..., :rows, :cols] = weight
    tiled = padded.reshape(*lead, tiles[-2], b0, tiles[-1], b1)
    max_abs = np.abs(tiled).max(axis=(-3, -1))
    safe = np.where(max_abs > 0, max_abs, np.float32(1))
    # `448 / m` as torch computes a number over a tensor: `(1 / m) * 448`
    scales = (np.float32(1) / safe).astype(np.float32) * np.float32(E4M3_MAX)
    scales = np.where(max_abs > 0, scales, np.float32(1)).astype(np.float32)
    inverse = (np.float32(1) / scales).astype(np.float32)
    quantized = _cast(tiled * scales[..., :, None, :, None])
    _recover(tiled, max_abs, quantized, inverse)
    quantized = quantized.reshape(padded.shape)[..., :rows, :cols]
    return np.ascontiguousarray(quantized), inverse


def _cast(values: np.ndarray) -> np.ndarray:
    return np.clip(values, -E4M3_MAX, E4M3_MAX).astype(E4M3)


def _recover(tiled, max_abs, quantized, inverse) -> None:
    """Where a nonzero block is exactly FP8 values times a float32 scale near
    `max_abs / 448`, put those values and that scale into `quantized` and
    `inverse` (in place)."""
    found = max_abs == 0
    near = (np.where(found, 1, max_abs) / np.float32(E4M3_MAX)).astype(np.float32)
    for step in (0, 1, -1):
        candidate = near
        for _ in range(abs(step)):
            candidate = np.nextafter(candidate, np.float32(step * np.inf))
        candidate = candidate.astype(np.float32)
        spread = candidate[..., :, None, :, None]
        values = _cast(tiled / spread)
        exact = (values.astype(np.float32) * spread == tiled).all(axis=(-3, -1))
        exact &= ~found
        if exact.any():
            mask = exact[..., :, None, :, None]
            np.copyto(quantized, values, where=np.broadcast_to(mask, values.shape))
            inverse[exact] = candidate[exact]
            found |= exact
