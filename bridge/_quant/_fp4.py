"""4-bit floating-point weights (FP4 E2M1: a sign, 2 exponent bits, 1 mantissa bit,
the values 0, 0.5, 1, 1.5, 2, 3, 4, 6), two a byte, the first in the low nibble:

- NVFP4 (compressed-tensors' `nvfp4-pack-quantized`): `weight_packed` uint8 `(rows,
  cols / 2)`, `weight_scale` float8_e4m3fn `(rows, cols / 16)`, `weight_global_scale`
  float32 `(1,)`. A value is `fp4 * (scale / global_scale)`, in float32 (the scale
  first made bfloat16, the global scale's dtype promoting), rounded to bfloat16:
  `NVFP4PackedCompressor.decompress`.
- MXFP4 (compressed-tensors' `mxfp4-pack-quantized`): the same packing, `weight_scale`
  uint8 `(rows, cols / 32)` E8M0 exponents (`2 ** (e - 127)`, bfloat16). A value is
  `fp4 * scale` in bfloat16: `MXFP4PackedCompressor.decompress`.
- MXFP4 as gpt-oss stores its experts (`quant_method: mxfp4`): `<name>_blocks` uint8
  `(experts, out, in / 32, 16)` and `<name>_scales` uint8 `(experts, out, in / 32)`;
  the dense `<name>` is `(experts, in, out)`, each value `fp4 * 2 ** (e - 127)`
  rounded once to the model's dtype: transformers' `convert_moe_packed_tensors`.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np


E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] + [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
    np.float32,
)
"""The value of each 4-bit code (the sign in bit 3)."""

BF16 = np.dtype(ml_dtypes.bfloat16)


def unpack(packed: np.ndarray) -> np.ndarray:
    """The FP4 values of `packed` uint8 `(..., n)`, two a byte (the first in the low
    nibble), float32 `(..., 2n)`.

    ```python
    >>> import numpy as np
    >>> unpack(np.array([[0x72, 0x9F]], np.uint8))
    array([[ 1. ,  6. , -6. , -0.5]], dtype=float32)

    ```
    """
    data = np.asarray(packed).view(np.uint8)
    codes = np.stack([data & 0x0F, data >> 4], -1).reshape(*data.shape[:-1], -1)
    return E2M1[codes]


def exponents(scale: np.ndarray) -> np.ndarray:
    """E8M0 exponents (uint8, bias 127) as float32 powers of two."""
    e = np.asarray(scale).view(np.uint8).astype(np.float32) - np.float32(127)
    return np.exp2(e).astype(np.float32)


def _spread(scale: np.ndarray, cols: int) -> np.ndarray:
    return np.repeat(scale, cols // scale.shape[-1], -1)


def dequantize_nvfp4(
    packed: np.ndarray, scale: np.ndarray, global_scale: np.ndarray, dtype
) -> np.ndarray:
    """The `(rows, cols)` weight of an NVFP4 layer, as `dtype` (see the module's
    note)."""
    values = unpack(packed)
    compute = np.result_type(BF16, global_scale.dtype)
    local = scale.astype(np.float32).astype(BF16).astype(compute)
    local = (local / global_scale.reshape(()).astype(compute)).astype(compute)
    out = values.astype(compute) * _spread(local, values.shape[-1])
    return out.astype(compute).astype(BF16).astype(dtype)


def dequantize_mxfp4(packed: np.ndarray, scale: np.ndarray, dtype) -> np.ndarray:
    """The `(rows, cols)` weight of a compressed-tensors MXFP4 layer, as `dtype`."""
    values = unpack(packed).astype(BF16)
    local = exponents(scale).astype(BF16)
    out = (values * _spread(local, values.shape[-1])).astype(BF16)
    return out.astype(dtype)


def dequantize_blocks(blocks: np.ndarray, scales: np.ndarray, dtype) -> np.ndarray:
    """gpt-oss's MXFP4 experts: `blocks` `(experts, out, groups, 16)` and `scales`
    `(experts, out, groups)` to the dense `(experts, groups * 32, out)`, as
    `dtype`."""
    experts, out, groups, _ = blocks.shape
    values = unpack(blocks).astype(dtype).astype(np.float32)  # the table in `dtype`
    values *= exponents(scales)[..., None]
    dense = values.astype(dtype).reshape(experts, out, groups * 32)
    return np.ascontiguousarray(dense.transpose(0, 2, 1))
