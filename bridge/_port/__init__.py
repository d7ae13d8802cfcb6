"""Porting weights between Linen, NNX and Equinox: codecs, pairing, plan, port.

Importing the package registers the built-in codecs (`codecs/`, one file per layer
family).
"""

from . import codecs as codecs
