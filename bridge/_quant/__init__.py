"""Quantized weights in checkpoints: recognised by their companions, dequantized when
their layer is converted (or kept quantized), and FP8 written out; the GGUF format.
Importing the package registers its plug-ins of `bridge._io` (`_plugin`, `_gguf`)."""

from . import _gguf as _gguf, _plugin as _plugin
