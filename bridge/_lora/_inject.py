"""`bridge.lora`: put LoRA adapters on the layers of a model of any framework."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._adapters._native import check_model, to_neutral
from .._arguments import (
    check_bool,
    check_dtype,
    check_number,
    check_pattern,
    is_array,
    type_error,
)
from .._paths import Path, at, path_of, path_str
from .._train._trainable import _selected_by_callable
from .._tree import Tree, framework, items, kind, leaf_roles, roles, walk
from . import _equinox, _linen, _nnx, _port, _torch  # noqa: F401  (they register)
from ._settings import Injection, Settings, Target, frame_of


Where = str | re.Pattern | Sequence[str] | Callable[[Tree], Any]

_NOTHING = """\
`where` selects no layer that can take a LoRA adapter ({what}).
The layers that can are:
{layers}
Select them by a regular expression over their paths (r"q_proj|v_proj"), by their \
names as PEFT's target_modules (["q_proj", "v_proj"]), or by a callable returning \
parts of the Tree (lambda t: t.layers[0].q_proj)."""

_UNSUPPORTED = (
    "{where} ({cls}): this kind of layer cannot take a LoRA adapter; LoRA supports "
    "dense and per-head projections (Dense, DenseGeneral, Linear, LinearGeneral), "
    "convolutions without groups, embeddings"
)
_RANK = (
    "{where} ({cls}): rank {rank} does not fit: the rank must be an integer from 1 "
    "to {limit} (the smaller of the layer's {fan_in} input and {fan_out} output "
    "features)"
)
_PROBLEMS = """\
bridge.lora cannot put adapters on this model: {n} problem(s), nothing was changed.
{problems}"""


def lora(
    model: Any,
    where: Where,
    *,
    rank: int,
    alpha: float | None = None,
    key: Any,
    use_rslora: bool = False,
    dropout: float = 0.0,
    dtype: Any = None,
) -> Any:
    """Put a LoRA adapter on every layer `where` selects.

    Each selected layer gains `lora_a` and `lora_b` under it and computes
    `y = x W + scaling * (dropout(x) A) B`, as PEFT's LoRA layers do: `lora_a` is
    drawn as PEFT draws it (Kaiming-uniform, bound `1/sqrt(fan_in)`), `lora_b` is
    zero (so the model's output is unchanged), `scaling = alpha / rank`
    (`alpha / sqrt(rank)` with `use_rslora`). An embedding's adapter starts the
    other way round, as PEFT's: `lora_a` zero, `lora_b` standard normal.

    Orientation: in a Linen or NNX model `lora_a` is `(in_features, rank)` and
    `lora_b` `(rank, out_features)`, as `nnx.LoRA`; in an Equinox model
    `lora_a (rank, in_features)` and `lora_b (out_features, rank)`, as PEFT's
    `lora_A.weight`/`lora_B.weight` and Equinox's own weights; in a PyTorch-layout
    Tree (`nn.Linear`, Hugging Face's `Conv1D`, `nn.Embedding`) the same, and
    `bridge.to_torch` gives the state dict of PEFT's LoRA model
    (`peft.inject_adapter_in_model`). A per-head kernel
    (`(in, heads, head_dim)`) takes one adapter over its flattened features; a
    convolution's `lora_a` is a `rank`-channel kernel with the layer's window; a
    stack of layers (`nn.scan`, `nnx.vmap`, `eqx.filter_vmap`) takes one adapter
    per layer, on the same leading axes.

    Train the adapters alone with `bridge.trainable(tree, "lora")`; `bridge.to_native`
    gives a model that runs them; `bridge.merge_lora` folds them into the weights;
    `bridge.save_peft` writes them for PEFT.

    **Arguments:**

    - `model`: a Linen `(module, variables)` pair or bound module, an `nnx.Module`,
      an Equinox model, a PyTorch-layout state dict or `torch.nn.Module` (given
      back as a state dict), or a `bridge.Tree` of one.
    - `where`: the layers: a regular expression searched in each layer's `keystr`
      path (`r"q_proj|v_proj"`); a list of layer names, matched against the end of
      each layer's dotted path, as PEFT's `target_modules` (`["q_proj", "v_proj"]`);
      or a callable like `bridge.trainable`'s (`lambda t: t.layers[0].q_proj`).
      Layers holding adapters already get new ones.
    - `rank`: the adapters' rank, from 1 to the smaller side of each layer's weight.
    - `alpha`: PEFT's `lora_alpha` (default: `rank`, a scaling of 1).
    - `key`: a `jax.random.key` for the adapters' initial values.
    - `use_rslora`: scale by `alpha / sqrt(rank)` (rank-stabilised LoRA).
    - `dropout`: PEFT's `lora_dropout`: dropout on the adapter's input in training
      (NNX: while the model is in `.train()` mode; Linen: when a `"dropout"`
      random stream is given; Equinox: when the layer is called with a `key`);
      kept elements scaled by `1 / (1 - dropout)`, nothing at inference, none on
      an embedding's adapter, as PEFT's. Adapters read by `bridge.load_peft` start
      in inference mode (NNX: `.train()` turns their dropout on).
    - `dtype`: the adapters' dtype (default: the weight's, float32 for a weight of
      fewer than 32 bits, as PEFT keeps adapters of half-precision models).

    **Returns:**

    The model with adapters, in the form it was given (a Tree gives a Tree); the
    given model is not changed and shares its arrays with the result.

    **Raises:**

    `ValueError` naming each layer, when `where` selects nothing or a layer of a
    kind without LoRA support, or `rank` does not fit a layer.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp, bridge
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu,
    ...                        nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
    >>> t = bridge.lora(bridge.from_nnx(model), r"layers\\[0\\]", rank=2,
    ...                 key=jax.random.key(0))
    >>> t.layers[0].lora_a.shape, t.layers[0].lora_b.shape
    ((4, 2), (2, 8))
    >>> bridge.trainable(t, "lora").layers[0].kernel
    False
    >>> x = jnp.ones((1, 4))
    >>> bool(jnp.array_equal(bridge.to_native(t)(x), model(x)))  # lora_b is zero
    True

    ```
    """
    check_model(model, "model")
    if isinstance(where, str):
        check_pattern(where, "where")
    check_number(alpha, "alpha", optional=True)
    if not is_array(key):
        raise type_error("key", "a JAX key (jax.random.key(0))", key)
    check_bool(use_rslora, "use_rslora")
    check_number(dropout, "dropout")
    check_dtype(dtype)
    tree = to_neutral(model)
    frame = frame_of(framework(tree))
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"`rank` must be an int, got {type(rank).__name__}.")
    if rank < 1:
        raise ValueError(f"`rank` must be at least 1, got {rank}.")
    settings = Settings(
        rank, float(rank if alpha is None else alpha), use_rslora, dropout
    )
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"`dropout` must be in [0, 1), got {dropout}.")
    found = frame.targets(tree)
    problems: list[str] = []
    chosen = select(tree, found, where, problems)
    if not chosen and not problems:
        problems.append(_nothing(found, where))
    for target in chosen:
        if not 1 <= rank <= target.limit():
            problems.append(
                _RANK.format(
                    where=target.where, cls=target.cls, rank=rank,
                    limit=target.limit(), fan_in=math.prod(target.fan_in),
                    fan_out=target.fan_out,
                )
            )  # fmt: skip
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(_PROBLEMS.format(n=len(problems), problems=lines))
    keys = jax.random.split(key, 2 * len(chosen))
    injections = []
    for i, target in enumerate(chosen):
        weight = getattr(at(tree, target.path), target.weight)
        a, b = initial(
            target,
            rank,
            weight.dtype if dtype is None else dtype,
            keys[2 * i],
            dtype is None,
        )
        injections.append(Injection(target, a, b, settings, keys[2 * i + 1]))
    out = frame.inject(tree, injections)
    return out if isinstance(model, Tree) else frame.native(model, out)


def initial(
    target: Target, rank: int, dtype: Any, key: Any, widen: bool = True
) -> tuple[jax.Array, jax.Array]:
    """PEFT's initial adapter for `target`: `lora_A` Kaiming-uniform with
    `a=sqrt(5)` (bound `1/sqrt(fan_in)`), `lora_B` zero; an embedding's
    `lora_embedding_A` zero and `lora_embedding_B` standard normal."""
    dtype = jnp.dtype(dtype)
    if widen and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        dtype = jnp.dtype(jnp.float32)
    a_shape, b_shape = target.shapes(rank)
    if target.kind == "embed":
        return jnp.zeros(a_shape, dtype), jax.random.normal(key, b_shape, dtype)
    bound = 1.0 / math.sqrt(math.prod(target.fan_in))
    a = jax.random.uniform(key, a_shape, dtype, -bound, bound)
    return a, jnp.zeros(b_shape, dtype)


def select(
    tree: Tree, found: list[Target], where: Where, problems: list[str]
) -> list[Target]:
    """The targets `where` selects; layers it selects that cannot take an adapter
    are reported in `problems`."""
    by_path = {t.path: t for t in found}
    if callable(where) and not isinstance(where, (re.Pattern, Tree)):
        flat, treedef = jtu.tree_flatten_with_path(tree)
        picked = _selected_by_callable(where, treedef, len(flat))
        roles = leaf_roles(tree)
        leaf_paths = [p for p, _ in jtu.tree_flatten_with_path(tree)[0]]
        chosen: dict[Path, Target] = {}
        for i in sorted(picked):
            path = path_of(leaf_paths[i])
            owner = next(
                (path[:n] for n in range(len(path), -1, -1) if path[:n] in by_path),
                None,
            )
            if owner is not None:
                chosen[owner] = by_path[owner]
            elif roles[i] == "params":
                problems.append(_unsupported(tree, path[:-1]))
        return list(chosen.values())
    if isinstance(where, (str, re.Pattern)):
        pattern = re.compile(where)
        matches = lambda p: bool(pattern.search(jtu.keystr(_keypath(p))))  # noqa: E731
    elif isinstance(where, Sequence):
        names = [str(n) for n in where]
        matches = lambda p: any(  # noqa: E731
            _dotted(p) == n or _dotted(p).endswith("." + n) for n in names
        )
    else:
        raise TypeError(
            "`where` must be a regex, a list of names or a callable, got "
            f"{type(where).__name__}."
        )
    chosen_list = [t for t in found if matches(t.path)]
    for path, node in walk(tree):
        if path in by_path or not path or not matches(path) or matches(path[:-1]):
            continue
        if _has_params(node) and not any(t.path[: len(path)] == path for t in found):
            problems.append(_unsupported(tree, path))
    return chosen_list


def _keypath(path: Path) -> tuple:
    return tuple(
        jtu.SequenceKey(k) if isinstance(k, int) else jtu.GetAttrKey(k) for k in path
    )


def _dotted(path: Path) -> str:
    return ".".join(str(k) for k in path)


def _has_params(node: Tree) -> bool:
    role_items = dict(items(roles(node)))
    return any(
        not isinstance(child, Tree) and role_items.get(k) == "params"
        for k, child in items(node)
    )


def _unsupported(tree: Tree, path: Path) -> str:
    cls = kind(at(tree, path))
    name = getattr(cls, "__name__", "Linen module")
    return _UNSUPPORTED.format(where=path_str(path) or "(root)", cls=name)


def _nothing(found: list[Target], where: Where) -> str:
    if isinstance(where, re.Pattern):
        what = f"r'{where.pattern}'"
    elif isinstance(where, str):
        what = f"r'{where}'"
    else:
        what = "a callable" if callable(where) else repr(list(where))
    layers = "\n".join(f"  {t.where} ({t.cls})" for t in found[:20]) or "  (none)"
    if len(found) > 20:
        layers += f"\n  ... and {len(found) - 20} more"
    return _NOTHING.format(what=what, layers=layers)


def adapters_of(tree: Tree) -> list[Target]:
    """The layers of `tree` that hold adapters (their `settings` set)."""
    return [
        t for t in frame_of(framework(tree)).targets(tree) if t.settings is not None
    ]
