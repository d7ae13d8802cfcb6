"""Writing a PyTorch-layout checkpoint quantized: `save(..., layout="torch",
quantize="fp8-block")` stores every linear layer's weight (but the output head) as
`float8_e4m3fn` with its `weight_scale_inv` per 128x128 block, and the
`quantization_config` transformers, vLLM and SGLang read (DeepSeek-V3's form) into the
`config.json` beside the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._io._atomic import atomic_file
from . import _fp8


NAME = "fp8-block"  # `save(..., quantize=NAME)`
BLOCK = (128, 128)
CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
    "modules_to_not_convert": None,
}
_KEEP = ("lm_head",)  # the output head stays dense, as transformers keeps it


def quantized_state(
    state: Mapping[str, np.ndarray], linear: set[str]
) -> dict[str, np.ndarray]:
    """`state` with the weight of each linear layer in `linear` (their dotted names,
    `model.layers.0.mlp.up_proj`) but the output head quantized to FP8 in blocks,
    its `weight_scale_inv` after it; every other tensor as it is.

    ```python
    >>> import numpy as np
    >>> state = {"fc.weight": np.ones((2, 3), np.float32), "fc.bias": np.zeros(2)}
    >>> out = quantized_state(state, {"fc"})
    >>> for name, array in out.items():
    ...     print(name, array.dtype, array.shape)
    fc.weight float8_e4m3fn (2, 3)
    fc.weight_scale_inv float32 (1, 1)
    fc.bias float64 (2,)

    ```
    """
    out: dict[str, np.ndarray] = {}
    for name, array in state.items():
        layer, _, last = name.rpartition(".")
        quantize = (
            last == "weight"
            and layer in linear
            and layer.rpartition(".")[2] not in _KEEP
            and array.ndim == 2
            and jnp.issubdtype(array.dtype, jnp.floating)
        )
        if not quantize:
            out[name] = array
            continue
        if array.dtype == _fp8.E4M3:  # FP8 already: kept bit for bit, scale 1
            out[name] = array
            out[name + "_scale_inv"] = np.ones(
                _fp8.grid(array.shape, BLOCK), np.float32
            )
            continue
        q, scale_inv = _fp8.quantize_blocks(np.asarray(array, np.float32), BLOCK)
        out[name], out[name + "_scale_inv"] = q, scale_inv
    return out


def write_config(folder: Path) -> None:
    """Put the FP8 `quantization_config` into `folder/config.json` (created if
    missing; its other keys kept), atomically."""
    path = folder / "config.json"
    config: dict[str, Any] = {}
    if path.is_file():
        loaded = json.loads(path.read_text())
        if isinstance(loaded, dict):
            config = loaded
    config["quantization_config"] = dict(CONFIG)
    with atomic_file(path) as tmp, open(tmp, "w") as f:
        json.dump(config, f, indent=2)
