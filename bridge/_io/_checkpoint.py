"""The public calls that write and read checkpoints, one per job: `save` (a bridge
checkpoint), `save_training` (with the optimizer state), `save_pretrained` (a
Hugging Face folder), `save_state_dict` (one PyTorch-layout file), `save_quantized`
(FP8 weights), and `load`, each a few named steps.

A checkpoint is in one of the registered formats (`bridge._io._format`): a
safetensors file (`*.safetensors`), a sharded safetensors folder, a flax msgpack file
(`*.msgpack`), a GGUF file (read only) or an orbax checkpoint directory (any other
path). Arrays are stored under their dotted neutral path (`layers.0.kernel`); the
metadata records, for each array, its path, role, shape and dtype (and for a typed PRNG
key its impl), plus the source framework, its layout, the native class of each module
(and for Equinox its plain settings, so a file can be ported without the model) and
the bridge version.

This module is the public calls only; the work is done by one module per
concept: `_model.py` (a Tree as a checkpoint's contents and back), `_write.py` (the
checks before writing, the PyTorch-layout file), `_read.py` (opening, reading,
reading into `like`), `_training.py` (the optimizer state); each format answers for
its file kind through its `Format` record (`_format.py`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax

from .._adapters._native import (
    check_model,
    like as like_form,
    placeholders,
    to_native,
    to_neutral,
)
from .._arguments import (
    check_bool,
    check_dtype,
    check_extra,
    check_inputs,
    check_pair_or_mapping,
    check_rules,
    check_step,
    check_str,
)
from .._families._diffusers import completed
from .._gc import paused
from .._lazy import LazyArray, read_early
from .._port._errors import PortError
from .._port._jaxpr import first_uses
from .._port._port import port_and_plan
from .._port._report import Report, name, report as made_report, warn
from .._port._trace import Example
from .._progress import shown
from .._sizes import human
from .._tree import Tree, framework
from . import (  # noqa: F401  (they register formats)
    _msgpack,
    _orbax,
    _safetensors,
    _sharded,
    _training,
)
from ._contents import Contents
from ._errors import BridgeDeprecationWarning, CheckpointError
from ._format import format_named, format_of
from ._model import check_metadata, describe, file_tree
from ._plugins import Filled, Request, asked, plugins
from ._read import (
    fill,
    lazy,
    misfits,
    open_checkpoint,
    prefix_hint,
    read,
    read_all,
    without_prefix,
)
from ._write import check_destination, save_layout, write


_PORTING = """\
(while porting {path} into `like`: the file came from another framework, so its
arrays were paired with `like`'s layers by bridge.port)"""

_MISMATCH = """\
{path} does not fit the model given as `like`:
{problems}
A file of `like`'s own framework fills it as it is only with exactly its arrays (the
same paths, shapes and dtypes). To fine-tune a changed model (a new head, layers added
or removed), pass strict=False: the layers that fit are filled, the others keep
`like`'s values and are reported; for other dtypes, pass dtype=. For a rewrite whose
layers have names of its own, pass example= inputs: the computation pairs them. To see
what the file holds, run `bridge inspect` on it, or load it without `like`."""


def save(
    path: str | os.PathLike,
    obj: Any,
    *,
    metadata: Mapping[str, str] | None = None,
    example: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    progress: bool = False,
    **other_jobs: Any,
) -> None:
    """Save a model of any framework as a bridge checkpoint, atomically.

    The format follows the path: `*.safetensors` writes one safetensors file, keyed
    by the dotted neutral paths (`layers.0.kernel`), with the role, shape and dtype
    of every array, the source framework and its layout (`"flax"` or `"equinox"`),
    and the bridge version in the file's metadata, so that any framework can read
    it. `*.msgpack` writes a flax msgpack file of Linen-style variables
    (`{role: {module: {name: array}}}`). Any other path is an orbax checkpoint
    directory (items `state`: the arrays as a nested dict with their shardings, and
    `bridge`: the metadata). A suffix of a file bridge does not write (`.pt`,
    `.npz`, `.safetensor`) is refused.

    Typed PRNG keys (NNX's `RngKey`) are stored as their key data, with the impl name
    in the metadata (safetensors, orbax), and come back as typed keys. The file is
    written under a temporary name in the same directory, flushed, then renamed to
    `path`: a failure leaves any earlier checkpoint at `path` intact; an existing
    orbax directory is replaced only if it is a bridge checkpoint.

    Other jobs have calls of their own: `bridge.save_training` (with the optimizer
    state), `bridge.save_pretrained` (a Hugging Face folder), `bridge.save_state_dict`
    (one PyTorch-layout file), `bridge.save_quantized` (FP8 weights). Their
    keywords given here (`layout="torch"`, `opt_state=`, `config=`, ...) still work,
    with a `bridge.BridgeDeprecationWarning` naming the call.

    **Arguments:**

    - `path`: where to write.
    - `obj`: a `bridge.Tree` or a native model (anything `bridge.to_neutral` takes).
    - `metadata`: optional `dict[str, str]` stored with the arrays (safetensors,
      orbax); `bridge inspect` shows it.
    - `example`, `example_kwargs`: optional example inputs of the model (as
      `bridge.port` takes them): its forward pass is traced abstractly (no FLOPs)
      and the file records the order in which it first uses each array (metadata
      `order`). A file keeps no other order of a Linen model's layers (its
      variables are dicts): with it, `bridge.load(path, like=rewrite,
      example=...)` pairs the layers of a model with names of its own as the live
      model would. A safetensors file or an orbax directory.
    - `progress`: with `True`, a progress display (the bytes written out of the
      model's total, array by array; an orbax or msgpack file fills its bar at the
      end), as `bridge convert` shows: on stderr when it is a terminal, as a bar
      in a Jupyter notebook, and only once the save has taken a second.

    **Returns:**

    Nothing.

    **Example:**

    ```python
    >>> import bridge, tempfile, os
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> path = os.path.join(tempfile.mkdtemp(), "linear.safetensors")
    >>> bridge.save(path, model, metadata={"step": "100"})
    >>> bridge.load(path).kernel.shape
    (2, 3)

    ```
    """
    if other_jobs:  # an earlier spelling of another job's call
        return _other_job(
            path, obj, metadata, example, example_kwargs, progress, other_jobs
        )
    path = _destination(path)
    tree = _model(path, obj, False, "obj")
    _checked_inputs(metadata, example, example_kwargs, progress)
    uses = _uses(tree, example, example_kwargs)
    with _saving(progress, path, tree):
        write(path, *describe(tree, metadata, uses))


def save_training(
    path: str | os.PathLike,
    model: Any,
    opt_state: Any,
    *,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
    example: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> None:
    """Save a training state (the model, its optimizer state, the step and extra
    arrays) as a bridge checkpoint, atomically; `bridge.load(path, like=model,
    opt_state_like=...)` loads it into a model and optimizer of any framework.

    A safetensors file or an orbax directory (as `bridge.save` chooses by the
    path): the model's arrays as `bridge.save` writes them, the optimizer state's
    under the prefix `opt_state.` (`opt_state.0.mu.layers.0.kernel`: Adam's first
    moment of that parameter), `extra` arrays under `extra.`, and the state's
    structure and the step as JSON in the metadata (no pickle).

    **Arguments:**

    - `path`: where to write (`*.safetensors`, or a directory).
    - `model`: a `bridge.Tree` or a native model, the parameters `opt_state` was
      made for.
    - `opt_state`: the optimizer state: an optax state (`tx.init(params)`,
      `step.init(tree)`), an `nnx.Optimizer` or a Linen `TrainState` (their step is
      saved too); None for none (a step and `extra` alone).
    - `step`: optional, the step count (an int).
    - `extra`: optional `{name: array}` saved with it (a PRNG key, a data loader's
      position).
    - `metadata`, `example`, `example_kwargs`, `progress`: as for `bridge.save`.

    **Example:**

    ```python
    >>> import bridge, optax, tempfile, os
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> tx = optax.adam(1e-3)
    >>> opt_state = tx.init(bridge.from_nnx(model))
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.safetensors")
    >>> bridge.save_training(path, model, opt_state, step=100)
    >>> bridge.load(path, like=model, opt_state_like=opt_state).step
    100

    ```
    """
    path = _destination(path)
    tree = _model(path, model, False)
    check_step(step)
    check_extra(extra)
    _checked_inputs(metadata, example, example_kwargs, progress)
    uses = _uses(tree, example, example_kwargs)
    with _saving(progress, path, (tree, opt_state, extra)):
        contents, arrays = describe(tree, metadata, uses)
        write(path, *_training.add(contents, arrays, tree, opt_state, step, extra))


def save_pretrained(
    folder: str | os.PathLike,
    model: Any,
    *,
    config: Any = None,
    generation_config: Any = None,
    like: Any = None,
    example: Any = None,
    example_kwargs: Mapping[str, Any] | tuple[Any, Any] | None = None,
    rules: Mapping[str, str | None] | None = None,
    prefix: str = "",
    strict: bool = True,
    max_shard_size: int | str | None = None,
    packed_experts: str | None = None,
    metadata: Mapping[str, str] | None = None,
    progress: bool = False,
) -> None:
    """Write a model of any framework as a Hugging Face model folder, as
    `save_pretrained` writes it, which `from_pretrained` opens; atomically as a whole.

    The folder holds shards of at most `max_shard_size` named
    `model-00001-of-00003.safetensors` with `model.safetensors.index.json` (one
    `model.safetensors` when one shard holds everything), each in PyTorch's layout
    (`nn.Linear` weights `(out, in)`, OIHW convolutions, `running_mean`/`running_var`
    and `num_batches_tracked` 0, fused `in_proj_weight`) with `{"format": "pt"}`,
    and the `config.json` (and `generation_config.json`) given. Everything goes into
    a temporary folder swapped in at the end: a save killed at any point leaves the
    previous folder as it was. Files of the previous folder it does not write (a
    tokenizer) are kept. Under `jax.distributed`, called in every process, each
    writes only its own shards' bytes.

    The names written are checked before anything is: against `like` where given,
    else against the model `config` names (built from it on the `meta` device, with
    torch and transformers installed), so that a model whose names are its own is
    never written beside a config whose model would open it with random weights.

    **Arguments:**

    - `folder`: the folder to write (a path without a suffix; replaced if it is a
      model folder or empty).
    - `model`: a `bridge.Tree` or a native model (not a training state).
    - `config`, `generation_config`: a transformers configuration object
      (`hf.config`), a dict, or the folder the weights came from (its
      `config.json` and `generation_config.json` are copied). A diffusers
      model's `config` given with that model as `like` is written as diffusers
      writes it (its `_class_name`; the weights as
      `diffusion_pytorch_model.safetensors`).
    - `like`: the model the export is for: a PyTorch module
      (`AutoModelForCausalLM.from_config(config)`, on the `meta` device or not),
      its `state_dict()`, or a PyTorch-layout checkpoint (a Hugging Face folder,
      a safetensors file). The names and shapes written must be its own (a name it
      ties to another may be left out); otherwise a `ValueError` lists every
      difference and nothing is written.
    - `example`, `example_kwargs`: example inputs of the model (as `bridge.port`
      takes them). With a `like` that runs (a module, or a folder with its
      `config.json`), both forward passes pair the layers, as `bridge.port(model,
      like, example=...)` does, and `like`'s names are written: a model with names
      of its own goes back under the names of the model it rewrites. Without
      `like`, the forward pass decides the layouts the arrays leave open (a square
      kernel of a Linen model that stores its others `(out, in)`).
    - `rules`: the rules that imported the PyTorch model (`{PyTorch layer regex:
      this model's layer path}`, as given to `bridge.port`), each read backwards to
      name the layers as the PyTorch model does; a rule to None leaves out the
      layers of the model it matches (`{r"\\.classifier": None}`: a head the
      reference has not). A rule is reversible when its regex is literal text and
      capturing groups, each used in the replacement.
    - `prefix`: put before every name (`"bert."`), as Hugging Face's
      `base_model_prefix`.
    - `strict`: with `False`, what fits is written and the rest reported (logger
      `"bridge"`, WARNING), as a non-strict load does: the model's arrays the
      reference has no place for, or holds in another shape, are left out; the
      reference's names not written are listed (`from_pretrained` initialises
      them); a stored sinusoidal position table the model computes (Marian's
      `embed_positions.weight`) is written with the reference's values.
    - `max_shard_size`: bytes, or `"5GB"`-style text (default `"50GB"`).
    - `packed_experts`: a model family (`"qwen2_moe"`, `"mixtral"`) whose
      per-expert weights are written packed as transformers v5 holds them
      (`mlp.experts.gate_up_proj` `(E, 2F, D)`, `mlp.experts.down_proj`).
    - `metadata`: optional `dict[str, str]` in every shard's metadata.
    - `progress`: as for `bridge.save`.

    **Example:**

    ```python
    >>> import bridge, tempfile, os
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> out = os.path.join(tempfile.mkdtemp(), "out")
    >>> bridge.save_pretrained(out, model, max_shard_size="1KB")
    >>> sorted(os.listdir(out))
    ['model.safetensors']

    ```
    """
    path = _destination(folder, "folder")
    check_str(packed_experts, "packed_experts", optional=True)
    if format_of(path).suffixes:
        raise ValueError(_NOT_A_FOLDER.format(path=path))
    tree = _model(path, model, True)
    inputs = _exported(
        metadata, rules, prefix, strict, example, example_kwargs, progress
    )
    options = dict(
        max_shard_size=max_shard_size,
        config=completed(config, like),
        generation_config=generation_config,
        packed_experts=packed_experts,
    )
    with _saving(progress, path, tree):
        save_layout(
            path, tree, metadata, rules, prefix, options, None, like, strict, inputs
        )


def save_state_dict(
    path: str | os.PathLike,
    model: Any,
    *,
    like: Any = None,
    example: Any = None,
    example_kwargs: Mapping[str, Any] | tuple[Any, Any] | None = None,
    rules: Mapping[str, str | None] | None = None,
    prefix: str = "",
    strict: bool = True,
    metadata: Mapping[str, str] | None = None,
    progress: bool = False,
) -> None:
    """Write a model of any framework as one PyTorch-layout safetensors file, as
    `safetensors.torch.save_file(module.state_dict(), path)` would, for
    `module.load_state_dict(..., strict=True)` or a folder's `model.safetensors`;
    atomically.

    No bridge metadata, `{"format": "pt"}` as PyTorch's writers add; `nn.Linear`
    weights `(out, in)`, OIHW convolutions, `running_mean`/`running_var` (and
    `num_batches_tracked` 0), fused `in_proj_weight`. Layers are named by their
    dotted paths, by `rules` read backwards, or, with `like` and `example`, by the
    layers of `like` they pair with.

    **Arguments:**

    - `path`: a `*.safetensors` file.
    - `model`: a `bridge.Tree` or a native model (not a training state).
    - `like`, `example`, `example_kwargs`, `rules`, `prefix`, `strict`, `metadata`,
      `progress`: as for `bridge.save_pretrained`.

    **Example:**

    ```python
    >>> import bridge, tempfile, os
    >>> import safetensors.numpy
    >>> from flax import nnx
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> bridge.save_state_dict(path, nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> safetensors.numpy.load_file(path)["weight"].shape  # (out, in)
    (3, 2)

    ```
    """
    path = _destination(path)
    if format_of(path).save_plain is None:
        raise ValueError(_NOT_A_FILE.format(path=path))
    tree = _model(path, model, True)
    inputs = _exported(
        metadata, rules, prefix, strict, example, example_kwargs, progress
    )
    with _saving(progress, path, tree):
        save_layout(path, tree, metadata, rules, prefix, {}, None, like, strict, inputs)


def save_quantized(
    path: str | os.PathLike,
    model: Any,
    scheme: str = "fp8-block",
    *,
    like: Any = None,
    example: Any = None,
    example_kwargs: Mapping[str, Any] | tuple[Any, Any] | None = None,
    rules: Mapping[str, str | None] | None = None,
    prefix: str = "",
    strict: bool = True,
    metadata: Mapping[str, str] | None = None,
    progress: bool = False,
) -> None:
    """Write a model of any framework as one PyTorch-layout safetensors file with
    its linear layers' weights quantized, and the `quantization_config` into the
    `config.json` beside it, as one atomic write.

    `"fp8-block"` writes each linear layer's weight (but `lm_head`) as
    `float8_e4m3fn` with a float32 `weight_scale_inv` per 128x128 block (DeepSeek-V3's
    form, read by transformers and serving engines); the other arrays as
    `bridge.save_state_dict` writes them. See the quantized checkpoints guide.

    **Arguments:**

    - `path`: a `*.safetensors` file (its folder's `config.json` is updated, or
      made).
    - `model`: a `bridge.Tree` or a native model.
    - `scheme`: the quantization scheme (`"fp8-block"`).
    - `like`, `example`, `example_kwargs`, `rules`, `prefix`, `strict`, `metadata`,
      `progress`: as for `bridge.save_pretrained`.
    """
    path = _destination(path)
    if format_of(path).save_plain is None:
        raise ValueError(_NOT_A_FILE.format(path=path))
    check_str(scheme, "scheme")
    tree = _model(path, model, True)
    inputs = _exported(
        metadata, rules, prefix, strict, example, example_kwargs, progress
    )
    with _saving(progress, path, tree):
        save_layout(
            path, tree, metadata, rules, prefix, {}, scheme, like, strict, inputs
        )


_NOT_A_FOLDER = """\
{path}: bridge.save_pretrained writes a Hugging Face folder: give a path without a
suffix. For one PyTorch-layout file, call bridge.save_state_dict(path, model)."""
_NOT_A_FILE = """\
{path}: a PyTorch-layout file is a safetensors file: name it *.safetensors. For a
Hugging Face folder (a path without a suffix), call bridge.save_pretrained(folder,
model, config=...)."""


def _destination(path: Any, argument: str = "path") -> Path:
    """`path` as a Path, refused (before anything is read) when it is not a path or
    names a kind of file bridge does not write."""
    path = _path(path, argument)
    check_destination(path, " (a Hugging Face folder: bridge.save_pretrained)")
    return path


def _model(path: Path, model: Any, torch_layout: bool, argument: str = "model") -> Tree:
    """The model to save (the `argument`) as a Tree, refused naming it when it is or
    holds a training state (`torch_layout`: a PyTorch-layout export, which holds a
    model's arrays only), or holds what a plug-in cannot write (weights kept
    quantized)."""
    if torch_layout:  # refused by name before the model is read
        _training.refuse_training_state(path, model, True, argument)
    try:
        check_model(model, argument)
        tree = to_neutral(model)
    except (TypeError, ValueError):  # an optimizer container: said so
        _training.refuse_training_state(path, model, False, argument)
        raise
    for plugin in plugins():
        if plugin.check_save is not None:
            plugin.check_save(path, tree)
    return tree


def _checked_inputs(metadata: Any, example: Any, kwargs: Any, progress: Any) -> None:
    """The arguments every save call takes, checked."""
    check_metadata(metadata)
    check_inputs(example, "example")
    check_pair_or_mapping(kwargs, "example_kwargs")
    check_bool(progress, "progress")


def _exported(
    metadata: Any,
    rules: Any,
    prefix: Any,
    strict: Any,
    example: Any,
    kwargs: Any,
    progress: Any,
) -> Example | None:
    """The arguments of a PyTorch-layout export checked; its example inputs."""
    _checked_inputs(metadata, example, kwargs, progress)
    check_rules(rules)
    check_str(prefix, "prefix")
    check_bool(strict, "strict")
    return None if example is None else Example(example, kwargs)


@contextlib.contextmanager
def _saving(progress: bool, path: Path, arrays: Any) -> Iterator[None]:
    """The progress display of a save of `arrays` (any pytree) to `path`."""
    total = _nbytes(arrays) if progress else 0  # a walk: only if asked
    with shown(progress, f"saving {path.name} ({human(total)})", total):
        yield


_JOBS = {
    "save_training": ("opt_state", "step", "extra"),
    "save_pretrained": (
        "layout", "rules", "prefix", "like", "strict", "config", "generation_config",
        "max_shard_size", "packed_experts",
    ),
    "save_quantized": ("quantize",),
}  # fmt: skip
_OTHER_JOB = """\
bridge.save(..., {given}) writes {what}: call bridge.{call}({args}) instead, which
takes that job's keywords alone (help(bridge.{call})). The old spelling still works."""
_TWO_JOBS = """\
A PyTorch-layout file holds the model's arrays only: save the training state with
bridge.save_training(path, model, opt_state, step=...), and the model for PyTorch
with bridge.save_pretrained or bridge.save_state_dict."""
_ONLY_TORCH = """\
`layout` must be "torch" (or None for the model's own layout), got {layout!r}; to
write the PyTorch layout call bridge.save_pretrained(folder, model, ...) or
bridge.save_state_dict(path, model, ...)."""
_NEEDS_TORCH = """\
{given} apply to a PyTorch-layout export only: call bridge.save_pretrained(folder,
model, ...) for a Hugging Face folder, or bridge.save_state_dict(path, model, ...)
for one file."""
_FOLDER = ("config", "generation_config", "max_shard_size", "packed_experts")
_FOLDER_ONLY = """\
{given} apply to a Hugging Face folder only: call bridge.save_pretrained(folder,
model, ...) with a path without a suffix."""


def _other_job(
    path: Any,
    obj: Any,
    metadata: Any,
    example: Any,
    example_kwargs: Any,
    progress: Any,
    given: dict[str, Any],
) -> None:
    """`bridge.save` with another job's keywords (its earlier spelling): that job's
    call, with a `BridgeDeprecationWarning` naming it."""
    known = {k for keys in _JOBS.values() for k in keys}
    unknown = sorted(given.keys() - known)
    if unknown:
        raise TypeError(f"save() got an unexpected keyword argument {unknown[0]!r}")
    defaults = {"prefix": "", "strict": True}
    given = {
        k: v
        for k, v in given.items()
        if v is not None and (k not in defaults or defaults[k] != v)
    }
    shared = dict(metadata=metadata, progress=progress)
    layout = given.pop("layout", None)
    quantize = given.pop("quantize", None)
    training = {k: given.pop(k) for k in _JOBS["save_training"] if k in given}
    if layout is not None and layout != "torch":
        raise ValueError(_ONLY_TORCH.format(layout=layout))
    torch_layout = layout is not None or quantize is not None
    if training and (torch_layout or given):
        raise ValueError(_TWO_JOBS)
    if training:
        _warn(training, "a training state", "save_training", "path, model, opt_state")
        opt_state = training.pop("opt_state", None)
        return save_training(
            path, obj, opt_state, **training, **shared, example=example,
            example_kwargs=example_kwargs,
        )  # fmt: skip
    if not torch_layout:
        if given:
            named = ", ".join(f"`{k}`" for k in given)
            raise ValueError(_NEEDS_TORCH.format(given=named))
        return save(path, obj, **shared, example=example, example_kwargs=example_kwargs)
    given.update(example=example, example_kwargs=example_kwargs, **shared)
    told = {"layout": layout} if layout is not None else {}
    if quantize is not None:
        _warn(told | {"quantize": quantize}, "an FP8 file", "save_quantized",
              f"path, model, {quantize!r}")  # fmt: skip
        return save_quantized(path, obj, quantize, **given)
    if format_of(_path(path)).suffixes:
        folder = [f"`{k}`" for k in _FOLDER if k in given]
        if folder:
            raise ValueError(_FOLDER_ONLY.format(given=", ".join(folder)))
        _warn(told, "one PyTorch-layout file", "save_state_dict", "path, model")
        return save_state_dict(path, obj, **given)
    _warn(told, "a Hugging Face folder", "save_pretrained", "folder, model, config=...")
    return save_pretrained(path, obj, **given)


def _warn(given: Mapping[str, Any], what: str, call: str, args: str) -> None:
    """The `BridgeDeprecationWarning` of an earlier spelling of `call`."""
    spelled = ", ".join(
        "opt_state=..." if k == "opt_state" else f"{k}={v!r}" for k, v in given.items()
    )
    message = _OTHER_JOB.format(given=spelled, what=what, call=call, args=args)
    warn(message, BridgeDeprecationWarning)


def _nbytes(tree: Any) -> int:
    """The bytes of the arrays of `tree` (any pytree)."""
    return sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(tree))


_ORDER_UNTRACED = """\
save(..., example=...) traces the model's forward pass to record the order it uses
its arrays, but {why}. Pass a model that runs: `(module, variables)` for Linen, an NNX
or Equinox model, with the inputs it takes."""


def _uses(tree: Any, example: Any, kwargs: Any) -> dict | None:
    """The position of each array's first use in the model's forward pass on the
    example inputs (None without them)."""
    if example is None:
        return None
    given = Example(example, kwargs)
    try:
        native = to_native(tree)
    except (TypeError, ValueError) as e:
        raise ValueError(_ORDER_UNTRACED.format(why=f"it is not a model ({e})")) from e
    if isinstance(native, Mapping):
        why = "arrays without their model (Linen variables alone) have none"
        raise ValueError(_ORDER_UNTRACED.format(why=why))
    try:
        return first_uses(tree, given.inputs, given.kwargs[0])
    except Exception as e:  # the model's own error on these inputs
        why = f"it failed on these inputs ({type(e).__name__}: {e})"
        raise ValueError(_ORDER_UNTRACED.format(why=why)) from e


def _path(path: Any, argument: str = "path") -> Path:
    """`path` as a Path, or `TypeError`/`ValueError` naming the argument."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"`{argument}` must be a str or os.PathLike, got {type(path).__name__}."
        )
    if os.fspath(path) in ("", "."):
        raise ValueError(f"`{argument}` must name a file or directory, got {path!r}.")
    return Path(path)


def load(
    path: str | os.PathLike,
    like: Any = None,
    *,
    dtype: Any = None,
    opt_state_like: Any = None,
    rules: Mapping[str, str | None] | None = None,
    prefix: str = "",
    strict: bool = True,
    example: Any = None,
    example_kwargs: Mapping[str, Any] | tuple[Any, Any] | None = None,
    keep_quantized: bool = False,
    report: bool = False,
    progress: bool = False,
) -> Any:
    """Load a checkpoint written by `bridge.save` (or any safetensors file).

    Arrays are read one at a time, from the file handle the header was read from, so
    memory stays near one copy of the model and a file replaced meanwhile is never
    mixed with its successor. Nothing in the file is executed or imported: the formats
    hold data only, and module classes recorded in the metadata are matched only
    against classes already imported (see the guide "Safe writes and untrusted files").

    **Arguments:**

    - `path`: a `*.safetensors` or `*.msgpack` file, an orbax checkpoint directory,
      a `*.safetensors.index.json` file (a sharded checkpoint), or a Hugging Face
      folder (`save_pretrained`'s: `model.safetensors`, or shards and their
      `model.safetensors.index.json`).
    - `like`: optional, the model to fill: a `bridge.Tree` or a native model of any
      framework (anything `bridge.to_neutral` takes). Its arrays' shardings are kept.
      When the file has exactly `like`'s arrays (same dotted paths, shapes, dtypes)
      they are read straight into it; when it was saved from another framework, its
      arrays go through `bridge.port` (layers paired by kind, shape and order,
      layouts converted), read from a safetensors file as each layer is converted,
      so memory holds the filled model plus about one array of the file.
    - `dtype`: optional, the dtype every floating-point array is cast to as it is
      read (`jnp.bfloat16`, ...); default: the file's dtypes (with `like`, cast to
      `like`'s only where they agree, else an error naming the arrays).
    - `rules`: with `like`, as in `bridge.port`: `{source regex: target path}`
      pairs the file's layers with `like`'s by name (`{r"\\.model(.*)": r"\\1"}`),
      and a rule to `None` leaves the layers it matches out. The file is then
      always ported.
    - `prefix`: with `like`, stripped from the file's names that start with it
      (Hugging Face's `base_model_prefix`: `"model."`, `"transformer."`) before
      pairing: a file of `LlamaForCausalLM` into a model without the `model.` level.
    - `strict`: with `False`, as Hugging Face's `from_pretrained(...,
      ignore_mismatched_sizes=True)`: `like`'s layers the file does not fill, and
      layers whose shapes differ (a new head), keep `like`'s values; the file's
      layers that go nowhere are left out; all of them are logged as a warning
      (logger `"bridge"`) in the form Hugging Face uses, as `bridge.port` logs
      them. With `True` (the default), each is an error.
    - `report`: with `True` (and `like`), return `(model, bridge.Report)`: what
      the load left as it was (`missing`, `unexpected`, `mismatched` layers), as
      Hugging Face's `output_loading_info=True` (with `opt_state_like`: `(the
      named tuple below, report)`).
    - `example`, `example_kwargs`: with `like`, when the file is ported: example
      inputs of `like` (batched, as `bridge.compare` takes them) and keyword
      arguments, as `bridge.port` takes them. `like`'s forward pass is traced
      (abstractly: no FLOPs) and says where its layers are used and which axes of a
      kernel meet the input, which decides what shapes and names leave open (a
      per-head `nn.Einsum` kernel `(H, D, hd)` with equal sizes). The file itself
      cannot run: a choice only the source's computation could make is refused;
      port from the source model then (`bridge.port(model, like, example=x)`).
    - `keep_quantized`: with `like` and a quantized checkpoint (FP8, compressed-
      tensors, GPTQ: see the quantized guide), each quantized weight is kept as a
      `bridge.QuantizedArray` holding the checkpoint's own tensors, in the place of
      `like`'s dense weight (Linen, NNX and Equinox models), instead of being
      dequantized. Run the model through `bridge.dequantize(model)` inside your
      `jax.jit`; `bridge.make_step` dequantizes by itself and never trains them.
      A checkpoint with nothing quantized loads as usual.
    - `opt_state_like`: optional, with `like`: the optimizer state to fill, as the
      target's optimizer makes it (`tx.init(params)`, `step.init(tree)`, an
      `nnx.Optimizer(model, tx, wrt=...)`, a Linen `TrainState`). The saved state
      is put into its form by `bridge.port_opt_state`, whatever framework it was
      saved from.
    - `progress`: with `True`, a progress display on stderr (the bytes read out of
      the checkpoint's total, array by array, shard after shard), as `bridge
      convert` shows: only when stderr is a terminal, and only once the load has
      taken a second. Off by default, as a library's output should be.

    **Returns:**

    Without `like`: a `bridge.Tree` of the file's arrays, with their roles (typed
    PRNG keys restored, sharded arrays with their saved sharding under orbax). From
    a Flax (Linen or NNX) file or any other safetensors file it is the Tree of
    Linen-style variables (`bridge.to_native` gives `{role: {module: {name:
    array}}}`); from an Equinox file, its native model is an inert skeleton holding
    the arrays and each module's recorded settings (enough for `bridge.port`, not
    callable). With `like`: the same kind of object as `like` (a Tree, an NNX
    module, an Equinox model or `(model, state)`, Linen variables, `(module,
    variables)` or a bound module), filled from the file. With `opt_state_like`: a
    named tuple `(model, opt_state, step, extra)`: the model as above, the optimizer
    state of `opt_state_like`'s kind, the saved step (or None), and the `extra`
    arrays by name.

    **Raises:**

    `bridge.CheckpointError` (a `ValueError`) naming the file and what is wrong for
    anything that is not a readable checkpoint (a truncated, corrupted or hostile
    file, a special file, a directory that is not a checkpoint; also a
    `FileNotFoundError` for a missing path); `TypeError`/`ValueError` naming the
    argument for a `path` that is not a path; `ValueError`
    listing every missing, unexpected, shape and dtype problem when a file of
    `like`'s own framework does not fit it; `bridge.PortError` listing every problem
    when a file of another framework cannot be ported into it; `ValueError` when
    `opt_state_like` is given for a file saved without an optimizer state.

    **Example:**

    ```python
    >>> import bridge, tempfile, os
    >>> from flax import nnx
    >>> path = os.path.join(tempfile.mkdtemp(), "linear.safetensors")
    >>> bridge.save(path, nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> model = bridge.load(path, like=nnx.Linear(2, 3, rngs=nnx.Rngs(1)))
    >>> type(model).__name__
    'Linear'

    ```
    """
    # 0. the arguments checked, as one record the steps pass on
    request = _checked(
        Request(
            path=_path(path),
            like=like,
            target=None,  # made below, with the collector paused
            dtype=dtype,
            rules=rules,
            prefix=prefix,
            strict=strict,
            example=example,
            example_kwargs=example_kwargs,
            keep_quantized=keep_quantized,
            opt_state_like=opt_state_like,
        )
    )
    check_bool(report, "report")
    check_bool(progress, "progress")
    if report and like is None:
        raise TypeError("`report` needs `like`: it says what the load left of it.")
    with paused():
        if like is not None:
            request = request._replace(target=to_neutral(placeholders(like)))
        elif opt_state_like is not None:
            raise TypeError("`opt_state_like` needs `like`, the model to load into.")
        with open_checkpoint(request.path) as everything:
            # 1. the file's contents: the model's arrays, the training state's apart
            contents, training = _training.split(everything)
            read = everything if opt_state_like is not None else contents
            total = sum(s.nbytes for s in read.tensors)
            with shown(
                progress, f"loading {request.path.name} ({human(total)})", total
            ):
                if request.target is None:
                    return file_tree(contents, read_all(contents, request.dtype))
                # 2. under the names `like` gives its layers
                contents = _named(contents, request)
                # 3. `like` filled by the first reader that can
                filled = _fill(everything, contents, request)
                saved = None
                if opt_state_like is not None:
                    saved = _training.read_state(everything, training)
        # 4. what a non-strict port left, reported (and returned with `report`);
        # the optimizer state ported
        told = _told(filled.plan, contents.path, like)
        model = filled.model
        if saved is not None:
            # a plug-in that fills `like` its own way refuses `opt_state_like`
            assert filled.source is not None
            model = _training.restore(saved, filled.source, model, opt_state_like)
        return (model, told) if report else model


def _told(plan: Any, path: Path, like: Any) -> Report:
    """What a load left of `like` (logged as `bridge.port` logs it); `plan`: its
    port's, or None for a file read straight into `like`."""
    where = f"the checkpoint at {path}"
    if plan is None:
        return Report(source=where, target=name(like))
    return made_report(plan, where, like)


def _checked(request: Request) -> Request:
    """`request` once `load`'s arguments are checked (each plug-in checking those
    it serves: `keep_quantized`)."""
    like, example = request.like, request.example
    if like is not None:
        check_model(like, "like")
    check_inputs(example, "example")
    check_pair_or_mapping(request.example_kwargs, "example_kwargs")
    if example is not None and like is None:
        raise TypeError("`example` needs `like`, the model whose inputs they are.")
    check_bool(request.keep_quantized, "keep_quantized")
    check_bool(request.strict, "strict")
    check_str(request.prefix, "prefix")
    for plugin in asked(request):
        if plugin.check is not None:
            plugin.check(request)
    check_dtype(request.dtype)
    return request


def _named(contents: Contents, request: Request) -> Contents:
    """The file's contents under the names `like` gives its layers: as its format
    renames them (`Format.rename`: a GGUF file under Hugging Face's names), `prefix`
    taken off."""
    rename = format_named(contents.format).rename
    if rename is not None:
        contents = rename(contents, request.target)
    if request.prefix:
        contents = without_prefix(contents, request.prefix)
    return contents


def _fill(everything: Contents, contents: Contents, request: Request) -> Filled:
    """`like` filled from the file by the first reader that can: a plug-in's (weights
    kept quantized), the arrays read straight into `like` (a file with exactly its
    arrays), else `bridge.port` (a file of another framework, or `rules`/`prefix`
    given). `everything`: the whole checkpoint, the training state's arrays too."""
    for plugin in asked(request):
        filled = None if plugin.fill is None else plugin.fill(contents, request)
        if filled is not None:
            return filled
    target = request.target
    assert target is not None
    problems = misfits(contents, target, request.dtype)
    if not problems and request.as_saved:
        # a format that places arrays itself (orbax) restores into `like`'s
        # shardings only when every array is named
        whole = everything if format_named(everything.format).places else contents
        source = fill(whole, target, request.dtype)
        return Filled(like_form(request.like, source), source, None)
    # example inputs: the names may be a rewrite's own, the computation pairs them
    same = contents.framework == framework(target) and request.example is None
    if same and request.as_saved and request.strict:
        raise ValueError(
            _MISMATCH.format(path=contents.path, problems="\n".join(problems))
            + prefix_hint(contents, target)
        )
    return _port_file(contents, request)


def _port_file(contents: Contents, request: Request) -> Filled:
    """`like` filled from the file by `bridge.port`, with the file's Tree and the
    port's plan; a format that reads lazily (`Format.lazy`) is read while porting,
    array by array."""
    arrays = lazy(contents, request.dtype)
    early = arrays is not None
    if arrays is None:
        arrays = read(contents)
    try:
        # the file's first arrays read in a thread while the port is planned
        with read_early(arrays.values() if early else (), _early_bytes(arrays)):
            source = file_tree(contents, arrays)
            model, plan = port_and_plan(
                source,
                request.like,
                request.rules,
                request.strict,
                request.dtype,
                None,
                None,
                request.example,
                request.example_kwargs,
                target_tree=request.target,
                source_uses=recorded(contents),
            )
    except PortError as error:
        damaged = [p for p in error.problems if p.startswith("metadata: ")]
        if damaged:  # the file's own metadata contradicts it, whatever `like` is
            raise CheckpointError(f"{contents.path}: " + "\n".join(damaged)) from None
        error.add_note(_PORTING.format(path=contents.path))
        raise
    return Filled(model, source, plan)


def recorded(contents: Contents) -> dict | None:
    """`{array path: (rank,)}`: the order of use a file records (`save(...,
    example=...)`), which stands for its model's traced forward pass; None where
    it records none."""
    if not contents.order:
        return None
    paths = {s.key: s.path for s in contents.tensors}
    return {paths[name]: (i,) for i, name in enumerate(contents.order)}


EARLY = 4  # a load reads at most 1/EARLY of a lazily read file while it plans


def _early_bytes(arrays: Mapping[str, Any]) -> int:
    """The bytes `bridge.load` reads while it plans its port: 1/`EARLY` of the file
    (measured, 758 MiB Hugging Face Llama folder -> abstract NNX: planning takes
    ~0.1 s on a quiet 2-core machine, about the time of reading 1/8 of it)."""
    lazy = (a.nbytes for a in arrays.values() if isinstance(a, LazyArray))
    return sum(lazy) // EARLY
