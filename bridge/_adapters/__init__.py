"""The adapters: each framework's models <-> `bridge.Tree`, one file per framework."""

# every adapter registers itself on import: registered before anything (a codec, a
# port) asks the registry, whichever module of bridge is imported first
from . import (  # noqa: E402, F401
    _equinox as _equinox,
    _haiku as _haiku,
    _keras as _keras,
    _linen as _linen,
    _nnx as _nnx,
    _torch as _torch,
)
