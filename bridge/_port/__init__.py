"""Porting weights between Linen, NNX and Equinox: codecs, pairing, plan, port."""

from . import _batch_norm as _batch_norm, _conv as _conv, _dense as _dense
