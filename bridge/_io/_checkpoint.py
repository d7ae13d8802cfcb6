"""`save` and `load`: a model of any framework to and from a checkpoint on disk.

A checkpoint is in one of the registered formats (`bridge._io._format`): a
safetensors file (`*.safetensors`), a sharded safetensors folder, a flax msgpack file
(`*.msgpack`), a GGUF file (read only) or an orbax checkpoint directory (any other
path). Arrays are stored under their dotted neutral path (`layers.0.kernel`); the
metadata records, for each array, its path, role, shape and dtype (and for a typed PRNG
key its impl), plus the source framework, its layout, the native class of each module
(and for Equinox its plain settings, so a file can be ported without the model) and
the bridge version.

This module is the public `save`/`load` only; the work is done by one module per
concept: `_model.py` (a Tree as a checkpoint's contents and back), `_write.py` (the
checks before writing, the PyTorch-layout file), `_read.py` (opening, reading,
reading into `like`), `_training.py` (the optimizer state); each format answers for
its file kind through its `Format` record (`_format.py`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
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
from .._gc import paused
from .._lazy import LazyArray, read_early
from .._port._errors import PortError
from .._port._port import port_and_plan
from .._port._report import Report, name, report as made_report
from .._port._trace import Example, first_uses
from .._progress import shown
from .._sizes import human
from .._tree import framework
from . import (  # noqa: F401  (they register formats)
    _msgpack,
    _orbax,
    _safetensors,
    _sharded,
    _training,
)
from ._contents import Contents
from ._errors import CheckpointError
from ._format import format_named
from ._model import describe, file_tree
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
from ._write import FOLDER_OPTIONS, check_destination, given, save_layout, write


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
    metadata: dict | None = None,
    layout: str | None = None,
    rules: Mapping[str, str] | None = None,
    prefix: str = "",
    quantize: str | None = None,
    opt_state: Any = None,
    step: int | None = None,
    extra: Mapping[str, Any] | None = None,
    max_shard_size: int | str | None = None,
    config: Any = None,
    generation_config: Any = None,
    packed_experts: str | None = None,
    like: Any = None,
    progress: bool = False,
    strict: bool = True,
    example: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Save a model of any framework as a checkpoint, atomically; with `opt_state`,
    `step` or `extra`, the whole training state.

    The format follows the path: `*.safetensors` writes one safetensors file, keyed
    by the dotted neutral paths (`layers.0.kernel`), with the role, shape and dtype
    of every array, the source framework and its layout (`"flax"` or `"equinox"`),
    and the bridge version in the file's metadata, so any framework can read it.
    `*.msgpack` writes a flax msgpack file of Linen-style variables
    (`{role: {module: {name: array}}}`). Any other path is an orbax checkpoint
    directory (items `state`: the arrays as a nested dict with their shardings, and
    `bridge`: the metadata).

    Typed PRNG keys (NNX's `RngKey`) are stored as their key data, with the impl name
    in the metadata (safetensors, orbax), and come back as typed keys.

    A training checkpoint (safetensors or orbax) adds the optimizer state's arrays
    under the prefix `opt_state.` (`opt_state.0.mu.layers.0.kernel`: Adam's first
    moment of that parameter), `extra` arrays under `extra.`, and records the
    state's structure and the step as JSON in the metadata (no pickle). It loads into
    a model and optimizer of any framework: `bridge.load(path, like=model,
    opt_state_like=...)`.

    The checkpoint is written under a temporary name in the same directory, flushed
    to disk, then renamed to `path`: a failure leaves any earlier checkpoint at
    `path` intact. An existing orbax directory is replaced only if it is a bridge
    checkpoint.

    **Arguments:**

    - `path`: where to write.
    - `obj`: a `bridge.Tree` or a native model (anything `bridge.to_neutral` takes).
    - `metadata`: optional `dict[str, str]` stored with the arrays (safetensors,
      orbax); `bridge inspect` shows it.
    - `layout`: `"torch"` writes a plain PyTorch-layout safetensors file (no bridge
      metadata, `{"format": "pt"}` as PyTorch's writers add), as
      `safetensors.torch.save_file(module.state_dict(), path)` would: `nn.Linear`
      weights `(out, in)`, OIHW convolutions, `running_mean`/`running_var` (and
      `num_batches_tracked` 0), fused `in_proj_weight`. Layers are named by their
      dotted paths, or by `rules` read backwards. Default: the model's own layout.
      A training state (an `nnx.Optimizer`, a `TrainState`, an optax state, a
      Linen `opt_state` collection) is refused: save the model alone this way.
    - `rules`: with `layout="torch"`, the rules that imported the PyTorch model
      (`{PyTorch layer regex: this model's layer path}`, as given to `bridge.port`):
      each is read backwards to name the layers as the PyTorch model does. A rule is
      reversible when its regex is literal text and capturing groups, each used in
      the replacement.
    - `prefix`: with `layout="torch"`, put before every name (`"bert."`), as
      Hugging Face's `base_model_prefix`.
    - `quantize`: with `layout="torch"` and a `*.safetensors` path, `"fp8-block"`
      writes each linear layer's weight (but `lm_head`) as `float8_e4m3fn` with a
      float32 `weight_scale_inv` per 128x128 block, and the matching
      `quantization_config` into the `config.json` beside the file (DeepSeek-V3's
      form, read by transformers and serving engines). See the quantized
      checkpoints guide.
    - `opt_state`: optional, the optimizer state made for `obj`'s parameters: an
      optax state (`tx.init(params)`, `step.init(tree)`), an `nnx.Optimizer` or a
      Linen `TrainState` (their step is saved too). See the guide "Resume
      training in another framework".
    - `step`: optional, the step count (an int).
    - `extra`: optional `{name: array}` saved with it (a PRNG key, a data loader's
      position).
    - `max_shard_size`, `config`, `generation_config`: with `layout="torch"` and a
      folder `path` (no `.safetensors` suffix): a Hugging Face model folder as
      `save_pretrained` writes it: shards of at most `max_shard_size` (bytes, or
      `"5GB"`; default `"50GB"`) named `model-00001-of-00003.safetensors` with
      `model.safetensors.index.json` (one `model.safetensors` when one shard holds
      everything), and `config.json` / `generation_config.json` from a transformers
      configuration object, a dict, or the folder the weights came from. Written
      atomically as a whole (a temporary folder swapped in); under
      `jax.distributed`, called in every process, each writes only its own shards'
      bytes.
    - `packed_experts`: with a Hugging Face folder, a model family (`"qwen2_moe"`,
      `"mixtral"`) whose per-expert weights (`mlp.experts.{e}.gate_proj.weight`, as
      a stack of experts is written) are written packed as transformers v5 holds
      them (`mlp.experts.gate_up_proj` `(E, 2F, D)`, `mlp.experts.down_proj`).
    - `like`: with `layout="torch"`, the model the export is for: a PyTorch module
      (`AutoModelForCausalLM.from_config(config)`, on the `meta` device or not), its
      `state_dict()`, or a PyTorch-layout checkpoint (a safetensors file or a Hugging
      Face folder). The names and shapes written must be exactly its own (a name it
      ties to another may be left out); otherwise a `ValueError` lists every
      difference and nothing is written. With `example` and a `like` that runs (a
      module, or a folder with its `config.json`), the model is ported into it as
      `bridge.port(model, like, example=...)` ports: both forward passes pair the
      layers (a rewrite with names of its own), and `like`'s names are written.
    - `progress`: with `True`, a progress display on stderr (the bytes written out
      of the model's total, array by array; an orbax or msgpack file fills its bar
      at the end), as `bridge convert` shows: only when stderr is a terminal, and
      only once the save has taken a second. Off by default, as a library's output
      should be.
    - `strict`: with `like` and `False`, the names under which `like` holds a
      stored sinusoidal position table that the model computes and has no array
      for (transformers' Marian, Pegasus, RoFormer `embed_positions.weight`,
      recognised by its values) are written with `like`'s values (logged, logger
      `"bridge"`, INFO); with `True`, the default, each is a difference too. Every
      other difference raises either way.
    - `example`, `example_kwargs`: optional example inputs of the model (as
      `bridge.port` takes them): its forward pass is traced abstractly (no FLOPs)
      and the file records the order in which it first uses each array (metadata
      `order`). A file keeps no other order of a Linen model's layers (its
      variables are dicts): with it, `bridge.load(path, like=rewrite,
      example=...)` pairs the layers of a model with names of its own as the live
      model would, with no rules. A safetensors file or an orbax directory. With
      `layout="torch"` (no metadata to record it in) the forward pass is traced
      only where the arrays leave a layout open, and decides it: a square kernel
      of a Linen model that stores its other kernels `(out, in)` (transformers'
      `FlaxConv1D`), refused without; with `like`, it pairs the layers (above),
      `example_kwargs` as `bridge.port` takes them (a pair: the model's, `like`'s).

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
    # 1. the arguments checked
    path = _path(path)
    check_destination(path, ' (a Hugging Face folder with layout="torch")')
    check_str(layout, "layout", optional=True)
    check_rules(rules)
    check_str(prefix, "prefix")
    plain = layout is not None or rules is not None or prefix or quantize is not None
    if plain:  # a training state is refused by name before `obj` is read as a model
        _training.refuse_training_state(path, obj, torch_layout=True)
    try:
        check_model(obj, "obj")
    except TypeError:  # an optimizer container: said so
        _training.refuse_training_state(path, obj, torch_layout=False)
        raise
    check_bool(strict, "strict")
    check_step(step)
    check_extra(extra)
    check_bool(progress, "progress")
    check_inputs(example, "example")
    check_pair_or_mapping(example_kwargs, "example_kwargs")
    training = opt_state is not None or step is not None or extra is not None
    folder = {"max_shard_size": max_shard_size, "config": config}
    folder["generation_config"] = generation_config
    folder["packed_experts"] = packed_experts
    if layout is None and any(v is not None for v in folder.values()):
        raise ValueError(FOLDER_OPTIONS.format(options=given(folder)))
    if layout is None and like is not None:
        raise ValueError(
            "`like` is the PyTorch model a layout='torch' export is checked against: "
            'pass layout="torch" with it.'
        )
    if plain and training:
        raise ValueError(
            "A PyTorch-layout file holds the model's arrays only: save the "
            "training state (`opt_state`, `step`, `extra`) in bridge's layout."
        )
    # 2. the model as a Tree, refused by a plug-in that cannot write what it holds
    # (weights kept quantized)
    try:
        tree = to_neutral(obj)
    except (TypeError, ValueError):  # a model holding its optimizer: said so
        _training.refuse_training_state(path, obj, torch_layout=False)
        raise
    for plugin in plugins():
        if plugin.check_save is not None:
            plugin.check_save(path, tree)
    # 3. written: as another library writes it (`layout`, a `quantize` scheme a
    # plug-in gives), or bridge's own file with its metadata and training state
    uses = None if plain else _uses(tree, example, example_kwargs)
    total = _nbytes((tree, opt_state, extra)) if progress else 0  # a walk: if asked
    with shown(progress, f"saving {path.name} ({human(total)})", total):
        if plain:
            inputs = None if example is None else Example(example, example_kwargs)
            save_layout(
                path,
                tree,
                metadata,
                layout,
                rules,
                prefix,
                folder,
                quantize,
                like,
                strict,
                inputs,
            )
            return
        contents, arrays = describe(tree, metadata, uses)
        if training:
            contents, arrays = _training.add(
                contents, arrays, tree, opt_state, step, extra
            )
        write(path, contents, arrays)


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


def _path(path: Any) -> Path:
    """`path` as a Path, or `TypeError`/`ValueError` naming the argument."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"`path` must be a str or os.PathLike, got {type(path).__name__}."
        )
    if os.fspath(path) in ("", "."):
        raise ValueError(f"`path` must name a file or directory, got {path!r}.")
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
