"""Writing a checkpoint: the checks before anything is written (the format stores
the dtypes, holds a training state, is one file, the arrays are addressable here),
and the plain PyTorch-layout file (`save_state_dict`, `save_pretrained`)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._shown import shown, some
from .._tree import Tree
from . import _hf_folder
from ._atomic import atomic_files
from ._config import model_type
from ._contents import Contents, Stored, is_key
from ._format import format_named, format_of, formats
from ._model import check_metadata
from ._plugins import quantizer
from ._ported import computed_target, ported_state
from ._reference import NO_FORWARD_PASS, check, reference_of
from ._save_checks import check_names, check_place, check_plain_names
from ._torch_layout import _own, torch_state


_DTYPES_NOT_STORED = """\
The {format} format cannot store {problems}. Convert these arrays (e.g. with
jax.tree.map and .astype), or save to a format that stores them: {others}."""

_DTYPES_NOT_IN_LAYOUT = """\
{path}: a PyTorch-layout checkpoint is safetensors, which cannot store {problems}.
It stores {supported}. Convert these arrays first (e.g. `jax.tree.map(lambda x:
x.astype(jnp.float32), tree)`), or save them in bridge's own layout (without
`layout=`) to a format that stores them: {others}."""

_TRAINING_NO_METADATA = """\
{path}: a {format} checkpoint holds arrays only, with no metadata to record the
optimizer state's structure. Save a training checkpoint as *.safetensors or as an
orbax directory."""
_ORDER_NO_METADATA = """\
{path}: a {format} checkpoint holds arrays only, with no metadata to record the order
in which the model uses them (what example= is for: a file that loads into a model
with other names). Save it as *.safetensors or as an orbax directory, or leave
example= out."""
_NOT_ADDRESSABLE = """\
{path}: a {format} checkpoint is one file, written by one process, but arrays of this
model are sharded over the devices of {processes} processes (this process cannot read
their other shards): {names}. Save to an orbax checkpoint directory (a path without a
file suffix), which every process writes its own shards to, e.g.
`bridge.save("ckpt/step_100", model)` called in every process."""


_NOT_A_FORMAT = """\
{path}: bridge writes no {suffix} files ({what}).
It writes {writable}, and an orbax directory for a name without a suffix{folder}."""
_READ_ONLY = """\
{path}: bridge reads {name} files ({suffix}) but writes none.
It writes {writable}, and an orbax directory for a name without a suffix{folder}."""
_PICKLE = "a PyTorch pickle: bridge neither writes nor unpickles pickles"
_WHAT = {
    **dict.fromkeys((".bin", ".pt", ".pth"), _PICKLE),
    **dict.fromkeys(
        (".ckpt", ".pkl", ".pickle"),
        "a pickle: bridge neither writes nor unpickles pickles",
    ),
    ".json": "JSON holds no arrays; a sharded checkpoint's index is "
    "*.safetensors.index.json",
    ".npz": "numpy's archive, which keeps no roles or layout",
    ".npy": "one numpy array",
    ".h5": "HDF5, Keras 2's format",
    ".keras": "Keras 3's own format",
}


def check_destination(path: Path, folder: str) -> None:
    """Refuse, before anything is read or written, a `path` whose suffix names a
    kind of file bridge does not write (a pickle's `.pt`, `.npz`, a typo of a
    format's suffix such as `.safetensor`), which would otherwise be written as an
    orbax directory of that name; `folder`: what a name without a suffix is besides
    (`" (a Hugging Face folder: bridge.save_pretrained)"`). A suffix of digits
    (`runs/lr0.001`) names no kind of file; an existing directory is a checkpoint
    directory whatever its name."""
    fmt = format_of(path)
    writable = [x for f in formats() if f.dtypes != frozenset() for x in f.suffixes]
    listed = ", ".join(writable[:-1]) + " or " + writable[-1] + " files"
    if fmt.suffixes and fmt.dtypes == frozenset():  # stores no dtype: read only
        suffix = " or ".join(fmt.suffixes)
        raise ValueError(
            _READ_ONLY.format(
                path=path, name=fmt.name, suffix=suffix, writable=listed, folder=folder
            )
        )
    suffix = path.suffix
    if fmt.suffixes or not suffix[1:2].isalpha() or path.is_dir():
        return
    what = _WHAT.get(suffix.lower())
    if what is None:
        close = difflib.get_close_matches(suffix.lower(), writable, n=1, cutoff=0.8)
        what = (
            f"did you mean {path.stem}{close[0]}?"
            if close
            else "not a checkpoint format bridge knows"
        )
    raise ValueError(
        _NOT_A_FORMAT.format(
            path=path, suffix=suffix, what=what, writable=listed, folder=folder
        )
    )


def write(path: Path, contents: Contents, arrays: Mapping[str, Any]) -> None:
    """Write `arrays` (by dotted name; typed PRNG keys as their key data) with
    `contents`' metadata, atomically, in the format `path` names."""
    fmt = format_of(path)
    if contents.training and not fmt.training:
        raise ValueError(_TRAINING_NO_METADATA.format(path=path, format=fmt.name))
    if contents.order and not fmt.order:
        raise ValueError(_ORDER_NO_METADATA.format(path=path, format=fmt.name))
    check_names(path, contents)
    check_place(path, f"{fmt.name} checkpoint" if fmt.suffixes else None)
    if fmt.dtypes is not None:
        bad = [
            f"{s.key} ({s.dtype})"
            for s in contents.tensors
            if s.dtype not in fmt.dtypes
        ]
        if bad:
            dtypes = {s.dtype for s in contents.tensors}
            others = [
                f.name for f in formats() if f.dtypes is None or dtypes <= f.dtypes
            ]
            raise ValueError(
                _DTYPES_NOT_STORED.format(
                    format=fmt.name,
                    problems=", ".join(bad),
                    others=", ".join(others) or "none",
                )
            )
    spread = [
        k
        for k, v in arrays.items()
        if isinstance(v, jax.Array) and not v.is_fully_addressable
    ]
    if fmt.suffixes and spread:
        raise ValueError(
            _NOT_ADDRESSABLE.format(
                path=path,
                format=fmt.name,
                processes=jax.process_count(),
                names=", ".join(spread[:5]) + (", ..." if len(spread) > 5 else ""),
            )
        )
    arrays = {k: jax.random.key_data(v) if is_key(v) else v for k, v in arrays.items()}
    fmt.save(path, contents, arrays)


_QUANTIZE_FOLDER = """\
{path}: `quantize` writes one *.safetensors file (and the quantization_config into the
config.json beside it); a Hugging Face folder is not written quantized yet."""


def _check_layout_dtypes(path: Path, tree: Tree) -> None:
    """`ValueError` naming every array of `tree` whose dtype a PyTorch-layout
    (safetensors) checkpoint cannot store, before anything is written."""
    stores = format_named("safetensors").dtypes
    assert stores is not None
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    bad = [
        (jax.tree_util.keystr(k), str(np.dtype(x.dtype)))
        for k, x in flat
        if str(np.dtype(x.dtype)) not in stores and not is_key(x)
    ]
    if bad:
        found = {d for _, d in bad}
        others = [f.name for f in formats() if f.dtypes is None or found <= f.dtypes]
        raise ValueError(
            _DTYPES_NOT_IN_LAYOUT.format(
                path=path,
                problems=some(bad, show=lambda kd: f"{shown(kd[0])} ({kd[1]})"),
                supported=", ".join(sorted(stores)),
                others=", ".join(others) or "none",
            )
        )


def save_layout(
    path: Path,
    tree: Tree,
    metadata: Mapping[str, str] | None,
    rules: Mapping[str, str | None] | None,
    prefix: str,
    folder: Mapping[str, Any],
    quantize: str | None = None,
    like: Any = None,
    strict: bool = True,
    example: Any = None,
) -> None:
    """Write `tree` as a plain PyTorch-layout checkpoint (`save_pretrained`,
    `save_state_dict`, `save_quantized`): one file in a format that writes plain
    files (`Format.save_plain`), or a Hugging Face folder for a path no suffix
    claims (`folder`: its options); with `like`, only if its names and shapes are
    the reference's (`_reference`); `example` (a `_port._trace.Example`): the
    model's inputs, whose forward pass decides the layouts its arrays leave open."""
    reference = None if like is None else reference_of(like, strict)
    scheme = quantizer(quantize)  # a plug-in's (bridge._quant), or a ValueError
    user = check_metadata(metadata)
    fmt = format_of(path)
    _check_layout_dtypes(path, tree)
    check_place(path, "PyTorch-layout safetensors file" if fmt.suffixes else None)
    if not fmt.suffixes:  # a folder: save_pretrained's layout
        if scheme is not None:
            raise ValueError(_QUANTIZE_FOLDER.format(path=path))
    elif fmt.save_plain is None:
        raise ValueError(
            f"{path}: a PyTorch-layout checkpoint is a safetensors file (name it "
            "*.safetensors) or a Hugging Face folder (a path without a suffix)."
        )
    # with example inputs and a reference that runs, both forward passes pair the
    # layers and the reference names them (`_ported`); else the model's own names
    ported = None
    if example is not None and reference is not None and not _own(tree):
        target = computed_target(like)
        if target is not None:
            ported = ported_state(tree, target, example, rules, prefix, strict)
        else:
            reference.pairing = NO_FORWARD_PASS
    if not fmt.suffixes:
        _hf_folder.save_folder(
            path,
            tree,
            rules=rules,
            prefix=prefix,
            metadata=user,
            reference=reference,
            example=example,
            ported=None if ported is None else ported.state,
            strict=strict,
            **folder,
        )
        return
    assert fmt.save_plain is not None  # checked above
    kinds: dict[str, str] = {}
    known = None if reference is None else reference.shapes.keys()
    if ported is not None:
        state = dict(ported.state)
        kinds = {f"{name}.weight": "Dense" for name in ported.linear}
    else:
        state = torch_state(
            tree,
            rules,
            prefix,
            kinds=kinds,
            family=model_type(path),
            known=known,
            example=example,
        )
    if reference is not None:
        checked = check(((k, tuple(np.shape(v))) for k, v in state.items()), reference)
        state = {k: v for k, v in state.items() if k not in checked.left_out}
        state.update(checked.tables)
    if scheme is not None:
        linear = {n.rpartition(".")[0] for n, k in kinds.items() if k == "Dense"}
        state = scheme.state(state, linear)
    check_plain_names(path, state)
    tensors = tuple(
        Stored(k, (k,), "params", tuple(np.shape(v)), str(v.dtype))
        for k, v in state.items()
    )
    contents = Contents(path, fmt.name, None, "", None, (), user, tensors)
    if scheme is None:
        fmt.save_plain(path, contents, state, {**user, "format": "pt"})
        return
    # the weights and the config.json that describes them, replaced as one: the
    # config first (a damaged config.json is refused before any byte is written)
    with atomic_files([path, path.parent / "config.json"]):
        scheme.config(path.parent)
        fmt.save_plain(path, contents, state, {**user, "format": "pt"})
