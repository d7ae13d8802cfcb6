"""The PyTorch layout's codec kit (framework `"torch"`): what every layer family's
PyTorch-layout codec shares. The codecs themselves sit beside their family's Linen,
NNX and Equinox codecs (`_dense.py`: `nn.Linear` and Hugging Face's `Conv1D`;
`_conv.py`, `_embed.py`, `_norm.py`, `_batch_norm.py`, `_attention.py`).

torch is never imported: a layer is recognised by its class's name when the Tree came
from a `torch.nn.Module` (`nn.Linear`, `nn.Conv2d`, Hugging Face's `Conv1D`,
subclasses too), else (a state dict, a file) by its entries' names and shapes,
possibly as several candidate kinds that pairing narrows (`kinds_by_name` chooses
among them when nothing else does). `hyperparameters` receive the adapter's
`TorchNode` (`.module` or None, `.cls`, `.name`). PyTorch's entries of a submodule
are `/`-joined (`out_proj/weight`).
"""

from __future__ import annotations

import re
from typing import Any

# GPT-2's Conv1D names, model-family data; read from here by bridge/_lora/_peft.py
from ..._families._gpt2 import CONV1D_NAMES as CONV1D_NAMES
from .._codec import Codec, Leaves, register_codec


SCALE_OF = {"weight": "scale", "bias": "bias"}
"""A PyTorch norm's affine entries -> Flax's names."""
WEIGHT_OF = {"scale": "weight", "bias": "bias"}
"""Flax's norm entries -> PyTorch's."""


def class_names(cls: Any) -> set[str]:
    """The names of the PyTorch (or Hugging Face) classes `cls` derives from (or
    stands in for: a layer of a file whose folder tells its class, `_families`)."""
    return {
        c.__name__
        for c in getattr(cls, "__mro__", ())
        if c.__module__.startswith(("torch.nn", "transformers", "bridge._families"))
    }


def by_class(*names: str, needs: tuple[str, ...] = ()):
    """`recognise`: the class is (derives from) one of `names` and the layer holds
    the entries `needs` (a weight-normed `Conv1d` holds `g` and `v`, no `weight`:
    `_weight_norm.py`); without a class, `fallback` decides by the entries."""

    def wrap(fallback):
        def recognise(cls: Any, leaves: Leaves) -> bool:
            if cls is not None:
                return bool(class_names(cls) & set(names)) and set(needs) <= set(leaves)
            return fallback(leaves)

        return recognise

    return wrap


def shape_of(leaves: Leaves, name: str) -> tuple[int, ...] | None:
    x = leaves.get(name)
    return None if x is None else tuple(x.shape)


def has_entries(leaves: Leaves, required: set[str], optional: set[str]) -> bool:
    return required <= set(leaves) <= required | optional


def module_of(layer: Any) -> Any:
    return getattr(layer, "module", None)


def read_attributes(**names: str):
    """`hyperparameters` reading module attributes (those present and not None)."""

    def read(layer: Any) -> dict[str, Any]:
        module = module_of(layer)
        out = {}
        for key, attr in names.items():
            value = getattr(module, attr, None)
            if value is not None:
                out[key] = value
        return out

    return read


def bias_flag(layer: Any, out: dict[str, Any]) -> dict[str, Any]:
    module = module_of(layer)
    if module is not None and hasattr(module, "bias"):
        out["use_bias"] = module.bias is not None
    return out


def register_torch(kind, recognise, decode, encode, hyper, layout, defaults) -> Codec:
    """Register the PyTorch-layout codec of `kind` (no Linen auto-names)."""
    return register_codec(
        Codec(kind, "torch", recognise, decode, encode, hyper, layout, (), defaults)
    )


_EMBEDDING_NAME = re.compile(r"emb|^wte$|^wpe$|^shared$", re.IGNORECASE)
_TRANSPOSE_NAME = re.compile(r"transpose|deconv", re.IGNORECASE)


def kinds_by_name(name: str, kinds: tuple[str, ...]) -> tuple[str, ...]:
    """The kinds a class-less PyTorch-layout layer is read as, when several fit its
    arrays and no target decides (`bridge convert --to-layout`): a 2-D `weight`
    alone is an `Embed` when the layer's last name says so (`emb...`, `wte`, `wpe`,
    `shared`), else a `Dense`; a convolution is a `ConvTranspose` when its name
    says `transpose`/`deconv`, else a `Conv`."""
    last = name.rsplit(".", 1)[-1]
    out = list(kinds)
    if "Embed" in out and "Dense" in out:
        out.remove("Dense" if _EMBEDDING_NAME.search(last) else "Embed")
    if "Conv" in out and "ConvTranspose" in out:
        out.remove("Conv" if _TRANSPOSE_NAME.search(last) else "ConvTranspose")
    return tuple(out)
