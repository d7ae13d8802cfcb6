"""Hugging Face's GPT-2 family (GPT-2, GPT-J's and CodeGen's kin that keep its names):
the names of its `Conv1D` layers, whose weight is `(in, out)` where `nn.Linear`'s is
`(out, in)`."""

from __future__ import annotations


CONV1D_CLASS = "Conv1D"
"""The class (in `transformers.pytorch_utils`) of GPT-2's `Conv1D` layers: a model's
module of this class (or a subclass) holds its weight `(in, out)`."""

CONV1D_NAMES = frozenset({"c_attn", "c_proj", "c_fc", "q_attn"})
"""The names Hugging Face's GPT-2 family gives its `Conv1D` layers (weight `(in,
out)`): a state dict or a file records no classes, so a square weight under one of
these names is read as `Conv1D`."""
