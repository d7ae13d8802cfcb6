"""Flax (Linen and NNX) and Equinox models, and PyTorch-layout state dicts,
interoperable.

The public names are imported on first use (PEP 562), so that `import bridge` and the
`bridge` command's `--help` do not wait for JAX; the first name used imports them all.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _clash
from ._version import VERSION


__version__ = VERSION

if TYPE_CHECKING:  # what static tools (pyright, the API docs) read
    from ._adapters._equinox import (
        from_equinox as from_equinox,
        to_equinox as to_equinox,
    )
    from ._adapters._haiku import from_haiku as from_haiku, to_haiku as to_haiku
    from ._adapters._keras import from_keras as from_keras, to_keras as to_keras
    from ._adapters._linen import from_linen as from_linen, to_linen as to_linen
    from ._adapters._native import to_native as to_native, to_neutral as to_neutral
    from ._adapters._nnx import from_nnx as from_nnx, to_nnx as to_nnx
    from ._adapters._torch import from_torch as from_torch, to_torch as to_torch
    from ._embed._as_equinox import as_equinox as as_equinox
    from ._embed._as_linen import as_linen as as_linen
    from ._embed._as_nnx import as_nnx as as_nnx
    from ._io._checkpoint import (
        load as load,
        save as save,
        save_pretrained as save_pretrained,
        save_quantized as save_quantized,
        save_state_dict as save_state_dict,
        save_training as save_training,
    )
    from ._io._errors import (
        BridgeDeprecationWarning as BridgeDeprecationWarning,
        CheckpointError as CheckpointError,
    )
    from ._kept._array import QuantizedArray as QuantizedArray
    from ._kept._matmul import quantized_matmuls as quantized_matmuls
    from ._lora._inject import lora as lora
    from ._lora._merge import merge_lora as merge_lora
    from ._lora._nnx import from_nnx_lora as from_nnx_lora, to_nnx_lora as to_nnx_lora
    from ._lora._peft import load_peft as load_peft, save_peft as save_peft
    from ._lora._qwix import from_qwix_lora as from_qwix_lora
    from ._port._codec import (
        Codec as Codec,
        register_codec as register_codec,
        unregister_codec as unregister_codec,
    )
    from ._port._compare import Comparison as Comparison, compare as compare
    from ._port._errors import PortError as PortError, PortWarning as PortWarning
    from ._port._plan import Plan as Plan
    from ._port._planning import port_plan as port_plan
    from ._port._port import port as port
    from ._port._report import Report as Report
    from ._quant._keep import dequantize as dequantize
    from ._train._opt_state import port_opt_state as port_opt_state
    from ._train._step import TrainStep as TrainStep, make_step as make_step
    from ._train._trainable import trainable as trainable
    from ._tree import Tree as Tree, roles as roles


# {public name: the private module defining it}; keep in step with the block above
# (tests/test_imports.py checks that they agree)
_PUBLIC = {
    "from_equinox": "._adapters._equinox",
    "to_equinox": "._adapters._equinox",
    "from_haiku": "._adapters._haiku",
    "to_haiku": "._adapters._haiku",
    "from_keras": "._adapters._keras",
    "to_keras": "._adapters._keras",
    "from_linen": "._adapters._linen",
    "to_linen": "._adapters._linen",
    "to_native": "._adapters._native",
    "to_neutral": "._adapters._native",
    "from_nnx": "._adapters._nnx",
    "to_nnx": "._adapters._nnx",
    "from_torch": "._adapters._torch",
    "to_torch": "._adapters._torch",
    "as_equinox": "._embed._as_equinox",
    "as_linen": "._embed._as_linen",
    "as_nnx": "._embed._as_nnx",
    "load": "._io._checkpoint",
    "save": "._io._checkpoint",
    "save_pretrained": "._io._checkpoint",
    "save_quantized": "._io._checkpoint",
    "save_state_dict": "._io._checkpoint",
    "save_training": "._io._checkpoint",
    "BridgeDeprecationWarning": "._io._errors",
    "CheckpointError": "._io._errors",
    "lora": "._lora._inject",
    "merge_lora": "._lora._merge",
    "from_nnx_lora": "._lora._nnx",
    "to_nnx_lora": "._lora._nnx",
    "load_peft": "._lora._peft",
    "save_peft": "._lora._peft",
    "from_qwix_lora": "._lora._qwix",
    "Codec": "._port._codec",
    "register_codec": "._port._codec",
    "unregister_codec": "._port._codec",
    "compare": "._port._compare",
    "Comparison": "._port._compare",
    "PortError": "._port._errors",
    "PortWarning": "._port._errors",
    "Plan": "._port._plan",
    "port_plan": "._port._planning",
    "port": "._port._port",
    "Report": "._port._report",
    "QuantizedArray": "._kept._array",
    "quantized_matmuls": "._kept._matmul",
    "dequantize": "._quant._keep",
    "port_opt_state": "._train._opt_state",
    "TrainStep": "._train._step",
    "make_step": "._train._step",
    "trainable": "._train._trainable",
    "Tree": "._tree",
    "roles": "._tree",
}

__all__ = sorted(_PUBLIC)


def _load() -> None:
    """Import every public name into this module, as an eager `__init__` would."""
    for name, module in _PUBLIC.items():
        globals()[name] = getattr(importlib.import_module(module, __name__), name)
    _clash.watch()


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        _load()
        return globals()[name]
    raise AttributeError(_clash.missing(name))


def __dir__() -> list[str]:
    """The public names and the module's own (`__version__`, `_private`), not the
    helpers this file imports (`Any`, `importlib`)."""
    own = [n for n in globals() if n.startswith("_") or n == "VERSION"]
    return sorted(set(own) | set(_PUBLIC))


_clash.watch()
