"""Quantized weights in checkpoints: recognised by their companions, dequantized when
their layer is converted (or kept quantized), and FP8 written out."""
