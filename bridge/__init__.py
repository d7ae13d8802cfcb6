"""Flax (Linen and NNX) and Equinox models, and PyTorch-layout state dicts,
interoperable."""

from ._adapters._equinox import from_equinox as from_equinox, to_equinox as to_equinox
from ._adapters._linen import from_linen as from_linen, to_linen as to_linen
from ._adapters._native import to_native as to_native, to_neutral as to_neutral
from ._adapters._nnx import from_nnx as from_nnx, to_nnx as to_nnx
from ._adapters._torch import from_torch as from_torch, to_torch as to_torch
from ._embed._as_equinox import as_equinox as as_equinox
from ._embed._as_linen import as_linen as as_linen
from ._embed._as_nnx import as_nnx as as_nnx
from ._io._checkpoint import load as load, save as save
from ._io._errors import CheckpointError as CheckpointError
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
from ._port._compare import compare as compare
from ._port._errors import PortError as PortError, PortWarning as PortWarning
from ._port._plan import Plan as Plan, port_plan as port_plan
from ._port._port import port as port
from ._qarray import QuantizedArray as QuantizedArray
from ._qmatmul import quantized_matmuls as quantized_matmuls
from ._quant._keep import dequantize as dequantize
from ._train._opt_state import port_opt_state as port_opt_state
from ._train._step import TrainStep as TrainStep, make_step as make_step
from ._train._trainable import trainable as trainable
from ._tree import Tree as Tree, roles as roles
from ._version import VERSION as _VERSION


__version__ = _VERSION
