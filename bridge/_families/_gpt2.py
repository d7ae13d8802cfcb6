"""Hugging Face's GPT-2 family (GPT-2, GPT-J's and CodeGen's kin that keep its names):
the names of its `Conv1D` layers, whose weight is `(in, out)` where `nn.Linear`'s is
`(out, in)`."""

from __future__ import annotations

from collections.abc import Iterable


CONV1D_CLASS = "Conv1D"
"""The class (in `transformers.pytorch_utils`) of GPT-2's `Conv1D` layers: a model's
module of this class (or a subclass) holds its weight `(in, out)`."""

CONV1D_NAMES = frozenset({"c_attn", "c_proj", "c_fc", "q_attn"})
"""The names Hugging Face's GPT-2 family gives its `Conv1D` layers (weight `(in,
out)`): a state dict or a file records no classes; a square weight under one of
these names is read as `Conv1D` only where a folder's `config.json` says the family
(`MODEL_TYPES`), and refused where nothing tells."""

MODEL_TYPES = frozenset({"gpt2", "openai-gpt", "imagegpt", "decision_transformer"})
"""The `model_type`s (a Hugging Face folder's `config.json`) whose layers under
`CONV1D_NAMES` are `Conv1D`s. In a folder of any other model type, those names are
`nn.Linear`s (GPT-Neo keeps GPT-2's `c_fc` and `c_proj`, stored `(out, in)`)."""


class Conv1D:
    """The class a layer of a file stands in for when the file's folder says it is
    GPT-2's `Conv1D` (weight `(in, out)`)."""


class Linear:
    """The class a layer of a file stands in for when the file's folder says its
    GPT-2 name is an `nn.Linear` (weight `(out, in)`)."""


def file_linears(
    model_type: str | None, entries: Iterable[tuple[tuple, int]]
) -> dict[tuple, type]:
    """`{layer path: Conv1D or Linear}` for the layers under `CONV1D_NAMES` holding a
    2-D `weight`, from every entry's `(path, ndim)`, in a folder whose `config.json`
    names its `model_type`; `{}` without one (the names alone do not tell a square
    weight's layout)."""
    if model_type is None:
        return {}
    cls = Conv1D if model_type in MODEL_TYPES else Linear
    return {
        tuple(path[:-1]): cls
        for path, ndim in entries
        if len(path) > 1
        and path[-1] == "weight"
        and ndim == 2
        and str(path[-2]) in CONV1D_NAMES
    }


def named_class(model_type: str | None, name: str) -> type | None:
    """The stand-in class of the layer of dotted `name` in a model of `model_type`
    (see `file_linears`), or None when the name is not GPT-2's or the type unknown."""
    if model_type is None or name.rsplit(".", 1)[-1] not in CONV1D_NAMES:
        return None
    return Conv1D if model_type in MODEL_TYPES else Linear
