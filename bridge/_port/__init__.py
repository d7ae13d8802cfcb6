"""Porting weights between Linen, NNX and Equinox: codecs, pairing, plan, port.

Importing the package registers the built-in codecs, one file per layer family.
"""

from . import (
    _attention as _attention,
    _batch_norm as _batch_norm,
    _conv as _conv,
    _dense as _dense,
    _embed as _embed,
    _norm as _norm,
)
