"""The built-in layer codecs, one file per layer family; importing registers them."""

from . import (
    _attention as _attention,
    _batch_norm as _batch_norm,
    _conv as _conv,
    _dense as _dense,
    _embed as _embed,
    _haiku as _haiku,  # Haiku's layers, one per family (haiku is not imported)
    _keras as _keras,  # Keras's and KerasHub's (keras is not imported)
    _norm as _norm,
    _torch as _torch,
    _weight_norm as _weight_norm,  # after _conv, _dense: tried before them
)
