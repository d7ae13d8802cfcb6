"""Adapter: Keras 3 models (JAX backend; KerasHub's too) <-> `bridge.Tree`.

A Keras model holds its weights in `keras.Variable`s, each with a path
(`transformer_layer_0/self_attention/query/kernel`) and, on the JAX backend, a
`jax.Array` as its value. The Tree is made of those arrays at those paths; the model
is recorded, so that `bridge.to_native` gives a new model of the same config whose
variables hold the Tree's arrays, and a training step runs the recorded model in a
`keras.StatelessScope` (what `model.stateless_call` does), which never writes to it.
keras itself is never imported by `bridge`: an object of its classes means the user
has.
"""

from __future__ import annotations

import abc
import re
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jax.numpy as jnp
import jax.tree_util as jtu
from jax.core import Tracer

from .._paths import Path, natural, path_str
from .._shown import some
from .._tree import Held, Tree
from ._build import build, module_nodes, native_leaves, native_order, source_of
from ._registry import Adapter, Optimizer, register_adapter


if TYPE_CHECKING:
    from ._keys import Keys


_BACKEND = """\
bridge.from_keras: this Keras runs on the {backend!r} backend; bridge reads Keras \
models on the JAX backend only: set KERAS_BACKEND=jax before importing keras."""

_NOT_A_LAYER = """\
bridge.from_keras expects `model`, a Keras model or layer (keras.Model, \
keras.layers.Layer), got {got}."""

_NOT_BUILT = """\
bridge.from_keras: `model` ({cls}) has no variables yet: a Keras model creates its
weights when it is built. Call it once on an example, or `model.build(input_shape)`,
first."""

_SAME_PATH = """\
bridge.from_keras: two variables of the model have the path {path} ({a} and {b}); a
Tree holds one array per path. Give the layers distinct names (`name=`)."""

_CHANGED = """\
This Tree no longer fits the Keras model it came from:
{problems}
A Keras variable keeps its shape and dtype: change values with eqx.tree_at, keeping
shapes and dtypes (cast with `.astype(...)`), or port into a model of the new
shapes (bridge.port)."""

_NO_CONFIG = """\
bridge.to_native rebuilds a Keras model from its config (`type(model).from_config(
model.get_config())`), which failed for {cls}: {error}
Give the model (and its custom layers) `get_config` and `from_config`, as Keras's own
saving needs, or use the Tree's arrays directly."""

_OTHER_MODEL = """\
bridge.to_native: the model rebuilt from {cls}'s config has other variables than the
model the Tree came from ({problems}): its `get_config` leaves out a setting (KerasHub
0.32's LlamaBackbone drops `tie_word_embeddings`). Keras's own saving rebuilds it the
same way. Use a model whose config rebuilds it, or the Tree's arrays directly."""

_INPUTS = """\
This Keras model takes the inputs {names}; {problem}. Give them as keyword arguments
by name (`per_side=(..., {{"token_ids": ids, "padding_mask": mask}})` in
bridge.compare, `example_kwargs` in bridge.port), or positionally in that order."""

INPUT_DEFAULTS: Mapping[str, Callable[[Any], Any]] = {
    "padding_mask": lambda ids: jnp.ones(ids.shape, bool),
    "segment_ids": lambda ids: jnp.zeros(ids.shape, ids.dtype),
}
"""KerasHub text models' inputs that a call may leave out, as Hugging Face's models
take them left out: no padding (a mask of ones, like an absent `attention_mask`) and
one segment (zeros, like an absent `token_type_ids`), shaped as the token ids."""


def _keras() -> Any:
    return sys.modules.get("keras")


class KerasLayer(abc.ABC):
    """Stands for `keras.Layer` (and `SeedGenerator`) in `Adapter.module_types`
    without importing keras."""

    @classmethod
    def __subclasshook__(cls, sub: type) -> bool:
        keras = _keras()
        return keras is not None and issubclass(
            sub, (keras.Layer, keras.random.SeedGenerator)
        )


def _is_layer(obj: Any) -> bool:
    keras = _keras()
    return keras is not None and isinstance(obj, keras.Layer)


def _recognise(obj: Any) -> bool:
    return _is_layer(obj) or isinstance(obj, Bound)


def _to_tree(obj: Any) -> Tree:
    """`from_keras`; a `Bound` model's Tree holds its values."""
    if not isinstance(obj, Bound):
        return from_keras(obj)
    tree = from_keras(obj.model)
    order = source_of(tree).order
    treedef = jtu.tree_structure(tree)
    return jtu.tree_unflatten(treedef, [obj.values[pos] for pos in order])


class KerasRecord(NamedTuple):
    """What `to_keras` rebuilds the model from (a Tree's `Source.record`).

    - `model`: the Keras model the Tree came from (its config is rebuilt; a
      training step runs it in a `StatelessScope`, which never writes to it).
    - `specs`: `(shape, dtype)` of each variable, in `model.variables` order (the
      native order of the Tree's leaves).
    """

    model: Held
    specs: tuple[tuple[tuple[int, ...], str], ...]


def from_keras(model: Any) -> Tree:
    """Convert a Keras 3 model (JAX backend) to a `bridge.Tree`, without copying.

    Each variable's array (its `.value`, a `jax.Array`) sits at its Keras path
    split at `/`, the model's own name left out: `token_embedding/embeddings` is
    `t.token_embedding.embeddings`, a `Sequential`'s `sequential/dense/kernel` is
    `t.dense.kernel`. Roles: trainable variables are `"params"`; a
    `BatchNormalization`'s moving statistics `"batch_stats"`; a `SeedGenerator`'s
    state (a `Dropout`'s) `"rngs"`, never ported; other non-trainable variables (a
    frozen layer's weights, a `Normalization`'s statistics) `"state"`. Each node
    records its layer's class.

    **Arguments:**

    - `model`: a built Keras model or layer (`keras.Model`, `keras.Sequential`,
      a KerasHub backbone or task). It is not modified.

    **Returns:**

    A `bridge.Tree`; `bridge.to_native` gives a new model of the same config whose
    variables hold the Tree's arrays.

    **Raises:**

    `ValueError` on another Keras backend than JAX (set `KERAS_BACKEND=jax`), for a
    model not built yet, or two variables at one path.

    **Example:**

    ```python
    >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")
    'jax'
    >>> import keras, bridge
    >>> head = keras.layers.Dense(2, name="head")
    >>> model = keras.Sequential([keras.Input((3,)), head])
    >>> t = bridge.from_keras(model)
    >>> t.head.kernel.shape, t.head.kernel is model.layers[0].kernel.value
    ((3, 2), True)

    ```
    """
    if not _is_layer(model):
        raise TypeError(_NOT_A_LAYER.format(got=type(model).__name__))
    keras = sys.modules["keras"]
    backend = keras.backend.backend()
    if backend != "jax":
        raise ValueError(_BACKEND.format(backend=backend))
    variables = model.variables
    if not variables:
        raise ValueError(_NOT_BUILT.format(cls=type(model).__name__))
    roles, kinds, paths = _read_layers(model)
    entries: list[tuple[Path, str, Any, int]] = []
    seen: dict[Path, str] = {}
    specs = []
    for i, variable in enumerate(variables):
        path = paths[id(variable)]
        if path in seen:
            raise ValueError(
                _SAME_PATH.format(path=path_str(path), a=seen[path], b=variable.path)
            )
        seen[path] = variable.path
        value = variable.value
        entries.append((path, roles.get(id(variable), "state"), value, i))
        specs.append((tuple(value.shape), str(value.dtype)))
    native = native_order([e[0] for e in entries])
    entries.sort(key=lambda e: tuple(map(natural, e[0])))
    return build(
        entries, kinds, "keras", KerasRecord(Held(model), tuple(specs)), native
    )


def _tree_path(keras_path: str, prefix: str) -> Path:
    if keras_path.startswith(prefix):
        keras_path = keras_path[len(prefix) :]
    return tuple(keras_path.split("/"))


def _read_layers(
    model: Any,
) -> tuple[dict[int, str], dict[Path, Any], dict[int, Path]]:
    """Each variable's role and Tree path by `id`, and the class of each layer (and
    seed generator) by its Tree path. A seed generator's scope is numbered by its
    place in the model (`seed_generator_0`, `_1`, ...): Keras numbers it by what the
    process made before, which a model rebuilt from its config does not repeat."""
    roles: dict[int, str] = {}
    kinds: dict[Path, Any] = {(): type(model)}
    prefix = f"{model.path or model.name}/"
    seeds: dict[int, Any] = {}
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if layer is not model and layer.path:
            kinds.setdefault(_tree_path(layer.path, prefix), type(layer))
        stats = {
            id(getattr(layer, n, None)) for n in ("moving_mean", "moving_variance")
        }
        for v in layer._trainable_variables + layer._non_trainable_variables:
            if id(v) not in roles:
                stat = "batch_stats" if id(v) in stats else "state"
                roles[id(v)] = "params" if v.trainable else stat
        for generator in layer._seed_generators:
            roles[id(generator.state)] = "rngs"
            seeds[id(generator.state)] = generator
    paths: dict[int, Path] = {}
    numbered = 0
    for variable in model.variables:
        path = _tree_path(variable.path, prefix)
        generator = seeds.get(id(variable))
        if generator is not None:
            path = path[:-2] + (f"seed_generator_{numbered}", path[-1])
            numbered += 1
            kinds[path[:-1]] = type(generator)
        paths[id(variable)] = path
    return roles, kinds, paths


def to_keras(tree: Tree) -> Any:
    """A new Keras model of the config of the model a `bridge.Tree` came from
    (`bridge.from_keras`), whose variables hold the Tree's arrays (not copied).

    The model is rebuilt with `type(model).from_config(model.get_config())` (a
    KerasHub task keeps its preprocessor object, whose vocabulary a config does not
    carry), its variables created without running their initializers. The model the
    Tree came from is not modified.

    **Arguments:**

    - `tree`: a `bridge.Tree` from `bridge.from_keras`, with the same leaf paths,
      shapes and dtypes.

    **Returns:**

    A Keras model. Inside a JAX trace (`jax.jit`, `jax.make_jaxpr`: the Tree holds
    tracers, which no variable outlives), a `Bound` instead: the model the Tree
    came from, called with its variables read from the Tree (`keras.StatelessScope`,
    as `model.stateless_call` does), its attributes the model's.

    **Raises:**

    `ValueError` naming every leaf whose shape or dtype changed, or a model whose
    config does not rebuild it (its variables differ).
    """
    src, leaves = native_leaves(tree, "keras", KerasRecord)
    _check_specs(tree, leaves, src.record)
    model = src.record.model.value
    if any(isinstance(x, Tracer) for x in leaves):
        return Bound(model, leaves)
    new = _rebuilt(model)
    variables = new.variables
    got = [(tuple(v.shape), str(v.dtype)) for v in variables]
    if got != list(src.record.specs):
        raise ValueError(
            _OTHER_MODEL.format(
                cls=type(model).__name__,
                problems=_differences(model.variables, variables),
            )
        )
    for variable, leaf in zip(variables, leaves):
        _set(variable, leaf)
    return new


class Bound:
    """A Keras model called with its variables read from given arrays, never
    written to (`keras.StatelessScope`): what `to_keras` gives inside a JAX trace.
    Its attributes are the model's; `bound(x)` returns what `model(x)` would."""

    def __init__(self, model: Any, values: list[Any]):
        self.model = model
        self.values = values

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        keras = sys.modules["keras"]
        mapping = list(zip(self.model.variables, self.values))
        with keras.StatelessScope(state_mapping=mapping):
            return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _differences(want: list[Any], got: list[Any]) -> str:
    """The variables two models of one config do not share, by path."""
    a, b = [v.path for v in want], [v.path for v in got]
    extra, missing = [p for p in b if p not in a], [p for p in a if p not in b]
    out = [f"{len(got)} variables where the model has {len(want)}"]
    if extra:
        out.append(f"rebuilt with {some(extra)}")
    if missing:
        out.append(f"rebuilt without {some(missing)}")
    return "; ".join(out)


def _check_specs(tree: Tree, leaves: list[Any], record: KerasRecord) -> None:
    problems = []
    src = source_of(tree)
    paths: list[Path] = [()] * len(leaves)
    for path, pos in zip(src.paths, src.order):
        paths[pos] = path
    for path, leaf, (shape, dtype) in zip(paths, leaves, record.specs):
        got = (tuple(leaf.shape), str(leaf.dtype))
        if got != (shape, dtype):
            problems.append(
                f"  {path_str(path)}: {got[1]}{list(got[0])}, the variable is "
                f"{dtype}{list(shape)}"
            )
    if problems:
        raise ValueError(_CHANGED.format(problems="\n".join(problems)))


def _rebuilt(model: Any) -> Any:
    """A new model of `model`'s config, its variables made but not initialised
    (a `StatelessScope` defers their initializers): `_set` gives them their arrays.
    A model whose construction makes variables from values (a KerasHub task
    compiles itself: its optimizer's counter) is made outside the scope, its
    backbone inside."""
    keras = sys.modules["keras"]
    config = model.get_config()
    if getattr(model, "preprocessor", None) is not None and "preprocessor" in config:
        config = {**config, "preprocessor": model.preprocessor}
    if (
        isinstance(getattr(model, "backbone", None), keras.Model)
        and "backbone" in config
    ):
        config = {**config, "backbone": _rebuilt(model.backbone)}
    pending = _pending()
    before = {id(v) for v in pending}
    try:
        try:
            with keras.StatelessScope(initialize_variables=False):
                new = type(model).from_config(config)
        except ValueError as error:
            if "stateless scope" not in str(error):
                raise
            new = type(model).from_config(config)
    except Exception as error:
        raise ValueError(
            _NO_CONFIG.format(cls=type(model).__name__, error=error)
        ) from error
    # the variables made in the scope: the model's get their arrays from `_set`,
    # any other is initialised, as leaving the scope would have done
    ours = {id(v) for v in new.variables}
    made = [v for v in _pending() if id(v) not in before]
    _set_pending([v for v in _pending() if id(v) not in ours and id(v) in before])
    for variable in made:
        if id(variable) not in ours:
            variable._deferred_initialize()
    return new


def _pending() -> list[Any]:
    from keras.src.backend.common import global_state

    return list(global_state.get_global_attribute("uninitialized_variables") or [])


def _set_pending(variables: list[Any]) -> None:
    from keras.src.backend.common import global_state

    global_state.set_global_attribute("uninitialized_variables", variables)


def _set(variable: Any, value: Any) -> None:
    """Give a variable `value` as its array (same shape and dtype: checked), as
    `variable.assign` does outside a scope, without a conversion or a copy."""
    variable._initializer = None
    if getattr(variable, "_shape", None) is None:
        variable._shape = tuple(value.shape)
    variable._direct_assign(value)


# --- the adapter record -------------------------------------------------------------


def _record(tree: Tree) -> KerasRecord:
    return source_of(tree, "keras", KerasRecord).record


def _scoped(tree: Tree, call: Callable[[Any], Any]) -> tuple[Any, Tree]:
    """`call(model)` on the recorded model in a `keras.StatelessScope` mapping its
    variables to the Tree's arrays, and the Tree after it (what the call assigned:
    moving statistics, seed states)."""
    keras = sys.modules["keras"]
    src, leaves = native_leaves(tree, "keras", KerasRecord)
    model = src.record.model.value
    variables = model.variables
    with keras.StatelessScope(state_mapping=list(zip(variables, leaves))) as scope:
        out = call(model)
    after = [scope.get_current_value(v) for v in variables]
    flat, treedef = jtu.tree_flatten(tree)
    return out, jtu.tree_unflatten(treedef, [after[pos] for pos in src.order])


def _forward(
    tree: Tree, loss_fn: Callable[..., Any], batch: tuple, rngs: Any
) -> tuple[Any, Tree]:
    """`loss_fn(model, *batch)` on the recorded model, its variables read from the
    Tree (`model(x, training=True)` updates batch statistics and draws dropout
    masks: the Tree after the step holds them)."""
    return _scoped(tree, lambda model: loss_fn(model, *batch))


def _call(model: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`model(inputs)`, named inputs (a KerasHub backbone's dict) filled from the
    positional inputs in order and the keyword arguments by name, the optional
    ones (`INPUT_DEFAULTS`) as Hugging Face's models default them."""
    structure = getattr(model, "_inputs_struct", None)
    if not isinstance(structure, Mapping):
        return model(*inputs, **kwargs)
    names = list(structure)
    given = dict(zip(names, inputs))
    for name in names:
        if name in kwargs:
            given[name] = kwargs.pop(name)
    if len(inputs) > len(names):
        problem = f"{len(inputs)} positional inputs were given"
        raise TypeError(_INPUTS.format(names=names, problem=problem))
    missing = [n for n in names if n not in given]
    first = next(iter(given.values()), None)
    for name in list(missing):
        if name in INPUT_DEFAULTS and first is not None:
            given[name] = INPUT_DEFAULTS[name](first)
            missing.remove(name)
    if missing:
        problem = f"{some(missing)} {'is' if len(missing) == 1 else 'are'} missing"
        raise TypeError(_INPUTS.format(names=names, problem=problem))
    # one kind of array (Keras refuses numpy beside JAX arrays in one input)
    return model({n: jnp.asarray(x) for n, x in given.items()}, **kwargs)


def _infer(model: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The model for inference: `model(x, training=False)`."""
    return _call(model, inputs, {"training": False, **kwargs})


def _embed(
    tree: Tree, args: tuple, kwargs: dict[str, Any], keys: Keys, inference: Any
) -> tuple[Any, Tree, tuple[str, ...]]:
    """A call inside a wrapper: `training=not inference` (the model's own default
    when `inference` is None); a `Dropout`'s seed state comes back in the Tree."""
    if inference is not None and "training" not in kwargs:
        kwargs = {**kwargs, "training": not inference}
    out, after = _scoped(tree, lambda model: _call(model, args, dict(kwargs)))
    return out, after, ()


def _modules(tree: Tree) -> Any:
    """The recorded model's layers by Tree path (`Adapter.modules`)."""
    model = _record(tree).model.value
    prefix = f"{model.path or model.name}/"
    layers = model._flatten_layers(include_self=False, recursive=True)
    found = [(_tree_path(x.path, prefix), x) for x in layers if x.path]
    return module_nodes(found, model)


def _auto_named(tree: Tree) -> frozenset[Path]:
    """The layers whose names Keras made up (`Adapter.auto_named`): the class's
    name in snake case, alone or with `_<n>` (`keras.src.utils.naming`: `dense`,
    `dense_1`, numbered by the layers of the class the process built before)."""
    model = _record(tree).model.value
    prefix = f"{model.path or model.name}/"
    out = set()
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if not layer.path:
            continue
        made = _snake(type(layer).__name__)
        name = layer.name
        if name == made or re.fullmatch(re.escape(made) + r"_\d+", name):
            out.add(_tree_path(layer.path, prefix))
    return frozenset(out)


def _snake(name: str) -> str:
    """Keras's `to_snake_case` (`keras.src.utils.naming`): `Conv2D` -> `conv2d`,
    `BatchNormalization` -> `batch_normalization`."""
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def _creation_order(cls: Any, keys: Any) -> bool | None:
    """A Keras layer lists its sublayers and variables in the order it tracked
    them (`model.variables`: a Sequential's in the order given, a subclassed
    model's as its attributes were set): its creation order."""
    return True if isinstance(cls, type) and issubclass(cls, KerasLayer) else None


def _optimizer_params(tree: Tree) -> Any:
    """The trainable variables' arrays, as `model.trainable_variables` lists them
    (what Keras's optimizers are built for)."""
    src, leaves = native_leaves(tree, "keras", KerasRecord)
    model = src.record.model.value
    trainable = {id(v) for v in model.trainable_variables}
    return [x for v, x in zip(model.variables, leaves) if id(v) in trainable]


ADAPTER = register_adapter(
    Adapter(
        name="keras",
        display="Keras",
        recognise=_recognise,
        to_tree=_to_tree,
        to_native=to_keras,
        module_types=(KerasLayer,),
        layout="keras",
        forward=_forward,
        infer=_infer,
        rngs_hint="A Keras model draws its dropout masks from its own seed "
        "generators, which bridge.make_step carries from step to step: drop `rngs`.",
        modules=_modules,
        auto_named=_auto_named,
        creation_order=_creation_order,
        embed=_embed,
        optimizer=Optimizer(
            lambda obj: None, lambda like, state, step: state, params=_optimizer_params
        ),
    )
)
