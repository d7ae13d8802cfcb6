"""A diffusers folder's model, for `_torch_folder.folder_module`: its `config.json`
(written by a model's `save_pretrained`) names the class in `_class_name`
(`"UNet2DModel"`, `"AutoencoderKL"`) and holds its constructor's arguments; the
model is `cls.from_config(config)` (float32, diffusers' default).

The class is looked up among diffusers' own exported model classes only (a
`ModelMixin` subclass `diffusers` exports): never a `_class_name` naming a module
and a class (`["my_module", "MyModel"]`), never diffusers' `AutoModel`, which
imports code an `auto_map` names (refused before, by `_torch_folder`).

The same four functions as `_torch_transformers` (one module per library).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from .._families._diffusers import CLASS
from .._shown import shown
from ._torch_bounds import Bounds


PACKAGE = "diffusers"
_UNKNOWN_CLASS = (
    "diffusers {version} has no model class {what}: the PyTorch side cannot be "
    "built from config.json"
)


def claims(raw: Mapping) -> bool:
    """A diffusers model's config names its class in `_class_name`."""
    return CLASS in raw


def prepare(
    diffusers: Any, raw: Mapping, bounds: Bounds, narrow: bool = False
) -> tuple[str, Callable[[Any], Any]]:
    """The class name and `build(torch)` of the model `raw` names. Raises
    `ValueError` naming a `_class_name` that is not one of diffusers' model
    classes (`AutoModel`, a pipeline, a function are not), or for `narrow` (no
    twin of small widths is made of a diffusers model: its widths are lists of
    block widths, per class)."""
    if narrow:
        raise ValueError("no twin of small widths is made of a diffusers model")
    name = raw.get(CLASS)
    cls = None
    if isinstance(name, str) and name.isidentifier():
        try:
            cls = getattr(diffusers, name, None)
        except Exception:  # diffusers' lazy module failing to import its own
            cls = None
    if not (isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin)):
        version = diffusers.__version__
        raise ValueError(_UNKNOWN_CLASS.format(version=version, what=shown(name)))
    config = {k: v for k, v in raw.items() if not k.startswith("_")}

    def build(torch: Any) -> Any:
        return cls.from_config(config)

    return cls.__name__, build


def context(diffusers: Any) -> Any:
    """Nothing around the build: on the `meta` device (or fake tensors) diffusers'
    initialisation costs nothing."""
    return contextlib.nullcontext()


def renamed(
    module: Any, diffusers: Any, names: list[str], keys: list[str]
) -> dict[str, str]:
    """`{file key: its name in module}`, as diffusers renames keys on load: the
    attention blocks of older checkpoints (`query` -> `to_q`, `proj_attn` ->
    `to_out.0`, by `ModelMixin._fix_state_dict_keys_on_load`), the others as they
    are."""
    fix = getattr(module, "_fix_state_dict_keys_on_load", None)
    if fix is None:
        return {k: k for k in keys}
    state: OrderedDict[str, str] = OrderedDict((k, k) for k in keys)
    fix(state)  # renames in place: each value is the key it came from
    return {key: name for name, key in state.items()}
