"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum): per linear layer `qweight` int32
`(in * bits / 32, out)` (the values of consecutive input rows packed into one word,
the first in the low bits; 3 bits: 32 rows in 3 words, one bit stream), `qzeros`
int32 `(groups, out * bits / 32)` (packed along columns), `scales` float16 `(groups,
out)` and `g_idx` int32 `(in,)` (the group of each input row; not in order with
`desc_act`). A weight is `scales[g] * (q - z)`, computed in the scales' dtype, with
`z` the stored zero plus one in the original `gptq` checkpoint format (`gptq_v2`
stores it as it is); transposed to PyTorch's `(out, in)`.
"""

from __future__ import annotations

import numpy as np

from . import _packed


def _unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """The `bits`-bit values packed in `words` along `axis` (32 / bits a word, the
    first in the low bits; 3 bits: 32 values in 3 words, one bit stream), unsigned."""
    if 32 % bits:
        w = np.ascontiguousarray(words).view(np.uint32)
        w = w.T if axis == 0 else w
        values = _packed.unpack_unsigned(w, bits, w.shape[-1] * 32 // bits)
        return (values.T if axis == 0 else values).astype(np.int16)
    per = 32 // bits
    w = np.ascontiguousarray(words).view(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    mask = np.uint32((1 << bits) - 1)
    if axis == 0:  # (n, c) -> (n * per, c)
        values = (w[:, None, :] >> shifts[None, :, None]) & mask
        return values.reshape(-1, w.shape[1]).astype(np.int16)
    values = (w[:, :, None] >> shifts[None, None, :]) & mask
    return values.reshape(w.shape[0], -1).astype(np.int16)


def dequantize(
    qweight: np.ndarray,
    qzeros: np.ndarray,
    scales: np.ndarray,
    g_idx: np.ndarray | None,
    bits: int,
    group_size: int,
    zero_plus_one: bool,
    dtype,
) -> np.ndarray:
    """The PyTorch-layout weight `(out, in)` of a GPTQ layer, as `dtype`.

    **Arguments:**

    - `qweight`, `qzeros`, `scales`, `g_idx`: the layer's tensors (`g_idx` None:
      row `i` is in group `i // group_size`).
    - `bits`: 2, 3, 4 or 8; `group_size`: rows per group (the config's, `-1` for one
      group).
    - `zero_plus_one`: the `gptq` checkpoint format's stored zeros (one less than the
      zero point); False for `gptq_v2`.
    """
    q = _unpack(qweight, bits, 0)
    rows = q.shape[0]
    z = _unpack(qzeros, bits, 1)[:, : scales.shape[1]]
    if zero_plus_one:
        z = z + 1
    if g_idx is None:
        size = rows if group_size == -1 else group_size
        g_idx = np.arange(rows) // size
    g = np.asarray(g_idx).astype(np.int64)
    values = (q - z[g]).astype(np.float32) * scales[g].astype(np.float32)
    return np.ascontiguousarray(values.astype(scales.dtype).T).astype(dtype)
