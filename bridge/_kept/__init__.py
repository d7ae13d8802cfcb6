"""Weights kept quantized, below every layer: `_array.py` the leaf
(`QuantizedArray`: the checkpoint's own tensors and their scheme; `dequantize()`
computes the dense weight), `_matmul.py` the products with it read as stored
(`x @ w.T` contracting the stored `(out, in)` array, its backward recomputing the
dense weight as a temporary), `_fp8_kernel.py` and `_int4_kernel.py` the Pallas
kernels those products use on a TPU (FP8 128x128 block-scaled; 4-bit group-scaled
with zero points). They import JAX and NumPy only; `_quant/` (layer 7) makes the
leaves from checkpoints."""
