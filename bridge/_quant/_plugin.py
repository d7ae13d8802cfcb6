"""What quantized checkpoints add to `save` and `load`, as a plug-in of `bridge._io`
(`bridge._io._plugins`), which never imports this package: registered when
`bridge._quant` is imported (by `bridge`'s `__init__`).

- `load` without `keep_quantized`: each quantized weight's stored tensors read as one
  array that dequantizes them when its layer is converted (`_read.dense`);
- `load(..., keep_quantized=True)`: the weights kept as `QuantizedArray`s
  (`_keep.load_kept`, its arguments checked by `_keep.check`);
- `save`: a model holding kept weights refused (`_keep.refuse_saving_kept`);
  `save_quantized(path, model, "fp8-block")` (`_write`).

GGUF registers its own format, which names the file's layers as Hugging Face does
where `like` asks for those names (`_gguf`).
"""

from __future__ import annotations

from .._io._plugins import Plugin, Quantizer, register_plugin
from . import _keep, _read, _write


PLUGIN = register_plugin(
    Plugin(
        "quantized",
        option="keep_quantized",  # its check and fill: with keep_quantized=True
        check=_keep.check,
        dense=_read.dense,
        fill=_keep.load_kept,
        check_save=_keep.refuse_saving_kept,
        quantizers=(
            Quantizer(_write.NAME, _write.quantized_state, _write.write_config),
        ),
    )
)
