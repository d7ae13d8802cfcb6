"""diffusers' Hugging Face folders, as data: a model's `save_pretrained` writes its
weights as `diffusion_pytorch_model.safetensors` (sharded:
`diffusion_pytorch_model-00001-of-00002.safetensors` ... and
`diffusion_pytorch_model.safetensors.index.json`) beside a `config.json` that names
its class in `_class_name`; transformers writes `model.safetensors` (`model-...`,
`model.safetensors.index.json`). The weights files' stem is the folder's library's.

    >>> weights_stem({"_class_name": "UNet2DModel", "in_channels": 3})
    'diffusion_pytorch_model'
    >>> weights_stem({"model_type": "llama"})
    'model'
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


CLASS = "_class_name"
"""The field of a diffusers model's config naming its class."""
STEM = "diffusion_pytorch_model"
STEMS = ("model", STEM)
"""The stems of the weights files of the folders bridge writes: transformers',
diffusers'."""


def weights_stem(config: Any) -> str:
    """The stem of the weights files of a folder with this `config.json` (a dict;
    anything else: transformers')."""
    return STEM if isinstance(config, Mapping) and CLASS in config else STEMS[0]


def completed(config: Any, like: Any) -> Any:
    """`config` as diffusers writes it: a diffusers model's `config` (a dict, which
    diffusers completes with `_class_name` only as it writes it) given with that
    model, or its twin, as `like` is the model's own `to_json_string()`; anything
    else is returned as it is.

        >>> completed({"model_type": "llama"}, None)
        {'model_type': 'llama'}
    """
    if not isinstance(config, Mapping) or CLASS in config:
        return config
    own, write = getattr(like, "config", None), getattr(like, "to_json_string", None)
    if not isinstance(own, Mapping) or not callable(write) or dict(own) != dict(config):
        return config
    try:
        written = json.loads(write())
    except (TypeError, ValueError):  # another library's to_json_string
        return config
    return written if isinstance(written, dict) and CLASS in written else config
