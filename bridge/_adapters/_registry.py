"""The adapter registry: one small frozen record per framework, in one table.

Everything `bridge` knows about a framework is in its `Adapter` record: its name, how
to recognise its models, how to turn them into a `bridge.Tree` and back, and the few
framework-specific steps that training, porting, comparing and checkpoints need.
`to_neutral`, `to_native`, `make_step`, `port`, `compare` and `load` look the
adapter up here; nothing outside an adapter module asks which framework it has.

Adding a framework = one module that builds an `Adapter` and calls
`register_adapter` once, its layer codecs (`bridge.register_codec`, with the same
`framework` name), and a row in `tests/test_adapters.py`. `tests/test_adapters.py`
also registers a toy fourth adapter (a dict of arrays) from inside a test, with no
other change: the proof that this is the whole recipe (with its `embed`, the toy
model also runs inside NNX, Linen and Equinox models through `bridge.as_*`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple


if TYPE_CHECKING:
    from .._paths import Key, Path
    from .._tree import Tree
    from .._uses import Uses


_RNGS_HINT = (
    "Pass random keys as batch arguments, `step(tree, opt_state, x, y, key)`, and "
    "give them to the model in loss_fn."
)


class Adapter(NamedTuple):
    """How `bridge` works with the models of one framework.

    **Fields:**

    - `name`: the short name, as stored in a Tree's source and in a checkpoint's
      metadata, and as `bridge.Codec.framework` (`"linen"`, `"nnx"`, `"equinox"`).
    - `display`: the name in messages (`"Flax NNX"`).
    - `recognise`: `recognise(obj) -> bool`: whether `obj` is a model of this
      framework, in any form `to_tree` takes (an `nnx.Module`; an Equinox model or
      `(model, state)`; Linen variables, `(module, variables)` or a bound module).
    - `to_tree`: `to_tree(obj) -> Tree`, for every `obj` that `recognise` accepts.
    - `to_native`: `to_native(tree) -> native model`, the inverse.
    - `module_types`: the base classes of the framework's modules (`nnx.Module`): a
      module class recorded in a Tree or a checkpoint belongs to this framework when
      it subclasses one of them, and its layers are read by this framework's codecs.
    - `layout`: the names and shapes this framework stores arrays in, as recorded in
      checkpoints (`"flax"` for Linen and NNX, which agree; `"equinox"`).
    - `like`: optional, `like(target, tree) -> object`: a filled `tree` in the form
      the caller gave `target` in (`port`, `load(like=...)`); by default
      `to_native(tree)`.
    - `placeholders`: optional, `placeholders(model) -> model`: an abstract model
      (from `eval_shape`) made acceptable to `to_tree` at no memory cost; by
      default the model as it is.
    - `forward`: optional, `forward(tree, loss_fn, batch, rngs) -> (out, after)` for
      `bridge.make_step`: call `loss_fn` on the native model and return its output and
      the Tree after the forward pass (with the state it wrote: batch statistics, RNG
      counters), or `None` when the forward pass writes no state. By default
      `loss_fn(to_native(tree), *batch), None`.
    - `infer`: optional, `infer(model, inputs, kwargs) -> outputs` for
      `bridge.compare`: run the native model (any form `recognise` accepts) for
      inference on batched inputs and keyword arguments; by default
      `model(*inputs, **kwargs)`.
    - `bind`: optional, `bind(tree, rngs) -> native model`: `to_native` with random
      streams (Linen, whose modules take them when bound). Without it, `rngs` are
      refused with `rngs_hint` as the fix.
    - `rngs_hint`: how this framework's models take random keys instead.
    - `shape_hint`: what to try when one of this framework's models, run inside a
      wrapper of another framework, fails on the shapes of its arguments (Equinox:
      a model takes one example, not a batch); empty when there is nothing to add.
    - `called`: optional, `called(run) -> (run(), {path: module})`: a forward pass
      of this framework's model run with every submodule it calls (its class and
      settings) recorded by path, for a framework whose Trees do not record them
      (`records_classes` False: Linen's compact submodules); the port's trace uses
      it to tell layers whose arrays fit several kinds (a square `Conv` or
      `ConvTranspose`).
    - `modules`: optional, `modules(tree) -> native model` whose submodules, found
      by path, the codecs read hyperparameters from; `None` when they are not
      available (Linen submodules exist only inside `apply`).
    - `records_classes`: whether every module of a Tree has its class (NNX,
      Equinox): then the first codec that recognises a module decides its kind.
      Linen records the class of the root only: its layers are recognised by
      auto-name (`Dense_0`) or by their arrays, possibly as several candidate kinds.
    - `settings`: optional, `settings(module) -> dict`: a native module's plain
      settings (`in_features`, `eps`, ...), recorded in checkpoints with its class, so
      that a layer can be ported from the file without the model (Equinox, whose
      codecs read settings from the module). Requires `modules`.
    - `from_file`: optional, `from_file(tensors, modules, kinds, empty) -> Tree`: a
      Tree of this framework made from a checkpoint without the model, from its
      arrays `[(name in the file, path, role, array), ...]`, its recorded modules
      `{path: (class name, settings)}`, the classes already imported `{path:
      class}` and its empty mappings `[(role, path), ...]` (Equinox: a skeleton
      model, `_skeleton.py`; Linen: variables; PyTorch: a state dict). Without it,
      a file of this framework is read by the adapter of its layout that has one
      (an NNX file as Flax variables, `file_reader`).
    - `empty`: optional, `empty(tree) -> [(role, path), ...]`: the native model's
      empty mappings, which a Tree of arrays cannot show (Linen's `{"params": {"a":
      {}}}` gives `("params", ("a",))`); checkpoints record them, so `load` without
      `like` gives them back.
    - `ties`: optional, `ties(tree) -> ((name, same as), ...)`: the arrays the
      native model holds once under two names (a state dict's tied embedding), for
      the port plan; a third string says why where the tie is inferred (a Hugging
      Face folder's `config.json`), and an empty "same as" names an array the
      model's files lack and nothing can fill (refused where a target needs it).
    - `plain_file`: optional, `plain_file(meta, names) -> bool`: whether a file
      without bridge metadata (its metadata strings, its array names) is in this
      framework's layout (a PyTorch state dict: `{"format": "pt"}`, `weight`s).
    - `role_of`: optional, `role_of(name) -> role`: the role of an array of such a
      file by its dotted name (`running_mean`: `batch_stats`); `params` otherwise.
    - `optimizer`: optional, an `Optimizer`: the framework's optimizer container.
    - `creation_order`: optional, `creation_order(cls, keys) -> bool | None`, for
      pairing: whether a node of class `cls` (a module class recorded in a Tree)
      whose children come in the order of `keys` (its native order) lists them in
      the order they were created: True (Equinox: fields in class order), False
      when its classes keep that order but this node lost it (an NNX module's
      attributes sorted by `nnx.jit`, `nnx.eval_shape`), `APART` when the node's
      arrays are in creation order among themselves and its submodules among
      themselves, but not one against the other (a `torch.nn.Module` registers
      them in two dicts); None when `cls` is not of this framework. Without it
      (Linen's dicts), the order is never trusted.
    - `declared`: optional, `declared(tree, wanted) -> [(path, module), ...] |
      None`: the submodules of the Tree's native model that `wanted(module)`
      accepts (not looking inside them), for a framework whose `modules` cannot
      give them (Linen: those its module declares as fields or in `setup`, found
      by binding it); None when the Tree records no module. `bridge.port` finds
      the `bridge.as_*` wrappers inside such a model with it.
    - `listed`: optional, `listed(tree) -> {path: indexed path}`: the submodules
      the native model holds in a list or tuple attribute under names of their own
      (Linen's `setup` names `self.layer = [A(), B()]`'s `layer_0`, `layer_1`), at
      the path other frameworks give an element of a list (`("layer", 0)`, as
      PyTorch's `nn.ModuleList` and NNX and Equinox lists do). Names written for
      another framework (`bridge.save_pretrained`) use it.
    - `check`: optional, `check()`: raise `ImportError` naming the versions when
      the installed framework is too old for this adapter (`require`).
    - `writer`: optional, a `LayoutWriter`: how a Tree of any framework is written
      in this adapter's layout and names (`bridge.save_pretrained`).
    - `trace`: optional, `trace(tree, inputs, kwargs) -> bridge._uses.Uses | None`:
      what the native model's forward pass on example inputs (batched, as
      `infer` takes them) does with each of the Tree's arrays, keyed by leaf path
      (`Path`): order of first use, contracted axes, convolution kernels, norms,
      weight norm, dependence (the PyTorch adapter's: `_torch_trace.trace_module`
      on the module the Tree holds, or on one built from the Hugging Face config
      it records). None when the Tree holds nothing to run (a bare state dict).
      Without it, a framework whose forward pass `jax.make_jaxpr` cannot trace has
      no trace.
    - `constants`: optional, `constants(tree) -> {path: numpy array}`: the
      constants the native model computes at build and keeps out of its state
      (PyTorch's non-persistent buffers: transformers' Gemma 3
      `embed_tokens.embed_scale`), by the path they would have in the Tree, with
      their values; empty where the Tree holds no model (a state dict, a file). The
      port compares them with the other side's unpaired loose arrays
      (`bridge._port._constants`).
    - `runnable`: optional, `runnable(target, ported) -> model or None`: what
      `ported` (what `like(target, ...)` gave) runs as for inference, or None where
      it cannot run (PyTorch: a state dict loaded into a copy of the `target`
      module, None for a module on the `meta` device); by default `ported`.
    - `run_tree`: optional, `run_tree(tree) -> model`: what a Tree runs as for
      inference where its native form does not run (PyTorch: a state dict; the
      module it holds, or a folder's model built with real tensors, each given the
      Tree's arrays); by default `to_native(tree)`.
    - `auto_named`: optional, `auto_named(tree) -> {module path}`: the modules
      whose name the framework made up from what the process built before, not
      the model's own (Keras's `dense`, `dense_1`: a counter per class, per
      process): the port never pairs layers by such names, only by the order of
      use or of creation.
    - `with_config`: optional, `with_config(tree, folder) -> Tree`: the same Tree
      read from the files of a Hugging Face folder, recording that folder, whose
      `config.json` `trace` builds the model from (the PyTorch adapter's).
    - `embed`: optional, `embed(tree, args, kwargs, keys, inference) -> (output,
      after, kept)`: run the model once inside a wrapper of another framework
      (`bridge.as_nnx`, `as_linen`, `as_equinox`). `keys` is the caller's random
      keys (`bridge._adapters._keys.Keys`: one key, a key per stream, or every stream),
      `inference` the mode (True: evaluation, False: training, None: the model's
      own). Returns the output, the Tree after the call (None: the call writes no
      state) and the roles whose new values are not kept (an NNX module's RNG
      streams, reseeded for the call). Without it, the framework's models cannot be
      wrapped.
    """

    name: str
    display: str
    recognise: Callable[[Any], bool]
    to_tree: Callable[[Any], Tree]
    to_native: Callable[[Tree], Any]
    module_types: tuple[type, ...]
    layout: str
    like: Callable[[Any, Tree], Any] | None = None
    placeholders: Callable[[Any], Any] | None = None
    forward: Callable[..., tuple[Any, Tree | None]] | None = None
    infer: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] | None = None
    bind: Callable[[Tree, Any], Any] | None = None
    rngs_hint: str = _RNGS_HINT
    shape_hint: str = ""
    modules: Callable[[Tree], Any] | None = None
    records_classes: bool = True
    called: Callable[[Callable[[], Any]], tuple[Any, dict[tuple, Any]]] | None = None
    settings: Callable[[Any], dict[str, Any]] | None = None
    from_file: Callable[..., Tree] | None = None
    empty: Callable[[Tree], list[tuple[str, tuple[str | int, ...]]]] | None = None
    embed: Callable[..., tuple[Any, Tree | None, tuple[str, ...]]] | None = None
    ties: Callable[[Tree], tuple[tuple[str, ...], ...]] | None = None
    plain_file: Callable[[Mapping[str, str], Iterable[str]], bool] | None = None
    role_of: Callable[[str], str] | None = None
    optimizer: Optimizer | None = None
    creation_order: Callable[[Any, Sequence[Key]], bool | str | None] | None = None
    declared: (
        Callable[[Tree, Callable[[Any], bool]], list[tuple[Path, Any]] | None] | None
    ) = None
    check: Callable[[], None] | None = None
    listed: Callable[[Tree], dict[Path, Path]] | None = None
    writer: LayoutWriter | None = None
    trace: Callable[[Tree, tuple[Any, ...], dict[str, Any]], Uses | None] | None = None
    with_config: Callable[[Tree, Any], Tree] | None = None
    constants: Callable[[Tree], Mapping[Path, Any]] | None = None
    auto_named: Callable[[Tree], frozenset[Path]] | None = None
    runnable: Callable[[Any, Any], Any] | None = None
    run_tree: Callable[[Tree], Any] | None = None


class LayoutWriter(NamedTuple):
    """How a Tree of any framework is written in one adapter's layout and names,
    without a native model (the PyTorch adapter's: a state dict).

    - `own(tree, prefix) -> {name: array}`: one of this adapter's own Trees, by the
      names its files hold them under (`prefix` before each; `""`: the Tree's own).
    - `node(name, family) -> node`: what this adapter's codecs' `hyperparameters`
      read for a layer known by its name alone (no module) in a model of `family`
      (a Hugging Face `model_type`, or None): GPT-2's `c_attn` is a `Conv1D`.
    - `fresh`: `{kind: {entry: array}}`, the entries a layer of `kind` has in this
      layout that no other framework keeps, written fresh (BatchNorm's
      `num_batches_tracked`).
    """

    own: Callable[[Tree, str], dict[str, Any]]
    node: Callable[[str, str | None], Any]
    fresh: Mapping[str, Mapping[str, Any]]


class Optimizer(NamedTuple):
    """A framework's optimizer container (`nnx.Optimizer`, Linen's `TrainState`), for
    `bridge.port_opt_state` and training checkpoints.

    - `unwrap(obj) -> (optax state, step) | None`: the state (array leaves) and step
      a container of this framework holds; None when `obj` is not one.
    - `wrap(like, state, step) -> container`: a new container of `like`'s kind
      holding `state` and `step`.
    - `model(obj) -> Tree | None`: the Tree of the parameters a container holds
      (a `TrainState`'s), None when it holds none (an `nnx.Optimizer`) or `obj` is
      not one of its containers.
    - `params(tree) -> pytree`: optional, the parameters of a Tree of this framework
      in the form its optimizers are initialised with (Linen's `params` dict,
      `eqx.filter(model, eqx.is_array)`, `nnx.state(model, nnx.Param)`), for a state
      `port_opt_state` builds without `like`; by default a dict keyed by path.
    - `start(tree, tx) -> container | None`: optional, the framework's usual
      container for a Tree of this framework trained by the optax `tx`
      (`nnx.Optimizer(model, tx, wrt=nnx.Param)`); None or absent: a bare optax state.
    """

    unwrap: Callable[[Any], tuple[Any, Any] | None]
    wrap: Callable[[Any, Any, Any], Any]
    model: Callable[[Any], Tree | None] = lambda obj: None
    params: Callable[[Tree], Any] | None = None
    start: Callable[[Tree, Any], Any] | None = None


_ADAPTERS: dict[str, Adapter] = {}
_LOCK = threading.Lock()

_TWICE = """\
An adapter named {name!r} is registered already ({display}): a framework has one \
adapter. Pick another name."""


def register_adapter(adapter: Adapter) -> Adapter:
    """Register a framework's `Adapter`; refuses a second adapter of the same name.

    Adapters are consulted most recently registered first, so an adapter whose
    models are also Mappings (a state dict) is tried before Linen's variables.

    **Arguments:**

    - `adapter`: an `Adapter`.

    **Returns:**

    The adapter, so registration can be an expression.
    """
    if not isinstance(adapter, Adapter):
        raise TypeError(f"Expected an Adapter, got {type(adapter).__name__}.")
    with _LOCK:
        known = _ADAPTERS.get(adapter.name)
        if known is not None:
            raise ValueError(_TWICE.format(name=adapter.name, display=known.display))
        _ADAPTERS[adapter.name] = adapter
    return adapter


def adapters() -> list[Adapter]:
    """Every registered adapter, most recently registered first."""
    return list(reversed(_ADAPTERS.values()))


def names() -> tuple[str, ...]:
    """The registered framework names, in registration order."""
    return tuple(_ADAPTERS)


def adapter_named(name: str) -> Adapter:
    """The adapter of framework `name`; `KeyError` naming the registered ones."""
    adapter = _ADAPTERS.get(name)
    if adapter is None:
        raise KeyError(
            f"No framework {name!r} is registered; the frameworks are {names()}."
        )
    return adapter


def registered(name: str | None) -> Adapter | None:
    """The adapter of framework `name`, or None (not registered, or no name)."""
    return None if name is None else _ADAPTERS.get(name)


def display_name(name: str) -> str:
    """`"nnx"` -> `"Flax NNX"`; an unregistered name as it is."""
    adapter = _ADAPTERS.get(name)
    return name if adapter is None else adapter.display


def adapter_for(obj: Any) -> Adapter | None:
    """The adapter whose `recognise` accepts `obj`, or None. A module of one
    framework's classes (`Adapter.module_types`: an `nnx.Module`, an `eqx.Module`)
    asks that adapter first: the others are asked only if it says no."""
    found = adapters()
    owner = next(
        (a for a in found if a.module_types and isinstance(obj, a.module_types)), None
    )
    if owner is not None and owner.recognise(obj):
        return owner
    return next((a for a in found if a is not owner and a.recognise(obj)), None)


def adapter_of_class(cls: Any) -> Adapter | None:
    """The adapter whose modules subclass one of its `module_types`, or None."""
    if not isinstance(cls, type):
        return None
    return next((a for a in adapters() if issubclass(cls, a.module_types)), None)


CANONICAL_LAYOUT = "flax"
"""The layout codecs decode to and encode from (Linen and NNX agree on it): a Tree
that is a part of a model, and a file of no known layout, are read in it."""


def canonical_adapter() -> Adapter:
    """The first registered adapter of the canonical layout that reads files: the one
    that reads a model part's layers and a file of no known framework."""
    return next(
        a
        for a in _ADAPTERS.values()
        if a.layout == CANONICAL_LAYOUT and a.from_file is not None
    )


def file_reader(framework: str | None, layout: str) -> Callable[..., Tree]:
    """The `from_file` that reads a file saved from `framework` in `layout`: the
    framework's own adapter's when it reads files, else that of the first adapter of
    that layout that does, else the canonical adapter's."""
    candidates = [registered(framework)]
    candidates += [a for a in _ADAPTERS.values() if a.layout == layout]
    for adapter in [*candidates, canonical_adapter()]:
        if adapter is not None and adapter.from_file is not None:
            return adapter.from_file
    raise LookupError("no registered adapter reads files")


def of_layout(layout: str) -> Adapter:
    """The first registered adapter that stores arrays in `layout`."""
    return next(a for a in _ADAPTERS.values() if a.layout == layout)


def plain_reader(meta: Mapping[str, str], names: Iterable[str]) -> Adapter | None:
    """The adapter whose layout a file without bridge metadata is in, or None."""
    names = list(names)
    return next(
        (
            a
            for a in adapters()
            if a.plain_file is not None and a.plain_file(meta, names)
        ),
        None,
    )


TORCH_LAYOUT = "torch"
"""The layout of PyTorch state dicts and Hugging Face folders (`bridge convert
--to-layout torch`): weights `(out, in)`, convolutions `(O, I, *k)`."""


def layout_of(framework: str | None) -> str:
    """The layout a framework stores its arrays in (`Adapter.layout`); the
    canonical one for a part of a model (no framework)."""
    found = registered(framework)
    return CANONICAL_LAYOUT if found is None else found.layout


def reads_classes(framework: str) -> bool:
    """Whether a framework's Trees record every module's class
    (`Adapter.records_classes`)."""
    found = registered(framework)
    return found is None or found.records_classes


def ties_of(tree: Tree) -> tuple[tuple[str, ...], ...]:
    """The tied names `(name, same as)` of a whole-model Tree, from its adapter
    (empty for a part, or a framework without ties)."""
    src = tree._info.source
    adapter = None if src is None else registered(src.framework)
    return () if adapter is None or adapter.ties is None else adapter.ties(tree)


def constants_of(tree: Tree) -> Mapping[Path, Any]:
    """The constants a Tree's native model keeps out of its state, from its adapter
    (`Adapter.constants`; empty for a framework without them)."""
    src = tree._info.source
    adapter = None if src is None else registered(src.framework)
    return (
        {} if adapter is None or adapter.constants is None else adapter.constants(tree)
    )


APART = "apart"
"""`Adapter.creation_order`'s answer for a node whose arrays and submodules are each
in creation order, but not ordered one against the other."""


def creation_order(cls: Any, keys: Sequence[Key]) -> bool | str | None:
    """Whether a node of class `cls` lists its children (in the order of `keys`) in
    creation order, as the adapter whose classes `cls` is of says
    (`Adapter.creation_order`); None when no adapter knows `cls`."""
    for adapter in adapters():
        if adapter.creation_order is not None:
            known = adapter.creation_order(cls, keys)
            if known is not None:
                return known
    return None


def declared(tree: Tree, wanted: Callable[[Any], bool]) -> list[tuple[Path, Any]]:
    """The submodules `wanted` accepts that the native model of `tree` declares,
    from its adapter's `declared` (empty for a framework without one, or a Tree
    that records no module)."""
    src = tree._info.source
    adapter = None if src is None else registered(src.framework)
    if adapter is None or adapter.declared is None:
        return []
    return adapter.declared(tree, wanted) or []


def listed(tree: Tree) -> dict[Path, Path]:
    """The paths of the submodules the native model of `tree` holds in list
    attributes, as other frameworks index them (`Adapter.listed`; empty for a
    framework without it, or a Tree that records no module)."""
    src = tree._info.source
    adapter = None if src is None else registered(src.framework)
    if adapter is None or adapter.listed is None:
        return {}
    return adapter.listed(tree)


def records_no_module(tree: Tree) -> bool | None:
    """For a Tree of a framework with `declared`: whether it records no module to
    find declared submodules in (Linen variables given alone); None for another
    framework's Tree."""
    src = tree._info.source
    adapter = None if src is None else registered(src.framework)
    if adapter is None or adapter.declared is None:
        return None
    return adapter.declared(tree, lambda _: True) is None  # the root: no walk


def require(name: str) -> Adapter:
    """The adapter of framework `name`, after its `check` (an `ImportError` naming
    the versions when the installed framework is too old for it)."""
    adapter = adapter_named(name)
    if adapter.check is not None:
        adapter.check()
    return adapter


def _unregister(name: str) -> None:
    """Remove an adapter (for tests that register a toy one)."""
    with _LOCK:
        _ADAPTERS.pop(name, None)
