"""AWQ checkpoints (AutoAWQ, `quant_method: awq`, `version: gemm`): per linear layer
`qweight` int32 `(in, out / 8)`, `qzeros` int32 `(groups, out / 8)` and `scales`
float16 `(groups, out)`, 4 bits a value. Eight output columns share a word in AWQ's
interleaved order: column `8c + [0, 2, 4, 6, 1, 3, 5, 7][i]` in bits `4i` of word
`c`. A weight is `(q - z) * scales[g]` for input row `i` in group `g = i //
group_size`, computed in the scales' dtype (AutoAWQ's `dequantize_gemm`), transposed
to PyTorch's `(out, in)`.
"""

from __future__ import annotations

import numpy as np


ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Which column of its eight each nibble of a word holds (nibble `i`: column
`ORDER[i]`)."""


def unpack(words: np.ndarray) -> np.ndarray:
    """The 4-bit values of `words` `(rows, cols / 8)` in column order, `(rows,
    cols)` int16.

    ```python
    >>> import numpy as np
    >>> unpack(np.array([[0x75316420]], np.uint32).view(np.int32))
    array([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=int16)

    ```
    """
    w = np.ascontiguousarray(words).view(np.uint32)
    shifts = np.arange(8, dtype=np.uint32) * np.uint32(4)
    nibbles = (w[:, :, None] >> shifts[None, None, :]) & np.uint32(0xF)
    columns = np.empty_like(nibbles)
    columns[:, :, list(ORDER)] = nibbles
    return columns.reshape(w.shape[0], -1).astype(np.int16)


def dequantize(
    qweight: np.ndarray,
    qzeros: np.ndarray,
    scales: np.ndarray,
    group_size: int,
    dtype,
) -> np.ndarray:
    """The PyTorch-layout weight `(out, in)` of an AWQ GEMM layer, as `dtype`.

    **Arguments:**

    - `qweight`: int32 `(in, out / 8)`; `qzeros`: int32 `(groups, out / 8)`;
      `scales`: `(groups, out)`.
    - `group_size`: input rows per group (`-1`: one group).
    """
    q = unpack(qweight)
    z = unpack(qzeros)
    rows = q.shape[0]
    size = rows if group_size == -1 else group_size
    g = np.arange(rows) // size
    values = (q - z[g]).astype(np.float32) * scales[g].astype(np.float32)
    return np.ascontiguousarray(values.astype(scales.dtype).T).astype(dtype)
