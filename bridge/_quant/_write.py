"""Writing a PyTorch-layout checkpoint quantized: `save_quantized(path, model,
quantize="fp8-block")` stores every linear layer's weight (but the output head) as
`float8_e4m3fn` with its `weight_scale_inv` per 128x128 block, and the
`quantization_config` transformers, vLLM and SGLang read (DeepSeek-V3's form) into the
`config.json` beside the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._io._atomic import atomic_file
from .._io._errors import CheckpointError
from .._io._files import open_regular, read_whole, size
from . import _fp8


NAME = "fp8-block"  # `save_quantized(path, model, NAME)`
BLOCK = (128, 128)
CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
    "modules_to_not_convert": None,
}
CONFIG_LIMIT = 100_000_000  # bytes: a config.json is a few KB
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


_DAMAGED = """\
{path}: the config.json beside the file is {reason}; a quantized save puts its \
quantization_config into it and would have to drop the rest. Nothing was written. Fix \
or remove {path} first."""


def quantized_config(folder: Path) -> dict[str, Any]:
    """`folder/config.json` (`{}` if missing) with the FP8 `quantization_config`,
    read before anything is written: a damaged one is refused naming it."""
    path = folder / "config.json"
    config: Any = {}
    if os.path.lexists(path):
        fd = open_regular(path, "config.json")  # a FIFO, a device: refused, named
        try:
            if size(fd) > CONFIG_LIMIT:
                raise CheckpointError(
                    _DAMAGED.format(path=path, reason=f"over {CONFIG_LIMIT} bytes")
                )
            text = read_whole(fd, path, "config.json")
        finally:
            os.close(fd)
        try:
            config = json.loads(text.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise CheckpointError(
                _DAMAGED.format(path=path, reason=f"not JSON ({reason[:200]})")
            ) from None
        if not isinstance(config, dict):
            raise CheckpointError(
                _DAMAGED.format(path=path, reason="not a JSON object")
            )
    config["quantization_config"] = dict(CONFIG)
    return config


def write_config(folder: Path) -> None:
    """Put the FP8 `quantization_config` into `folder/config.json` (created if
    missing; its other keys kept), atomically (inside `_atomic.atomic_files`, as one
    with the weights). The existing config.json is read, and refused if damaged,
    before anything is written."""
    config = quantized_config(folder)
    with atomic_file(folder / "config.json") as tmp, open(tmp, "w") as f:
        json.dump(config, f, indent=2)
