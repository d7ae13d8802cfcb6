"""Flax (Linen and NNX) and Equinox models, interoperable."""

from ._checkpoint import load as load, save as save
from ._equinox import from_equinox as from_equinox, to_equinox as to_equinox
from ._freeze import trainable as trainable
from ._linen import from_linen as from_linen, to_linen as to_linen
from ._native import to_native as to_native, to_neutral as to_neutral
from ._nnx import from_nnx as from_nnx, to_nnx as to_nnx
from ._port._codec import Codec as Codec, register_codec as register_codec
from ._port._compare import compare as compare
from ._port._errors import PortError as PortError, PortWarning as PortWarning
from ._port._plan import Plan as Plan, port_plan as port_plan
from ._port._port import port as port
from ._step import make_step as make_step
from ._tree import Tree as Tree, roles as roles


__version__ = "0.1.0"
