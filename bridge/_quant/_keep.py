"""Loading a quantized checkpoint kept quantized: `bridge.load(path, like=model,
keep_quantized=True)`.

The load is planned as a dequantizing one (`bridge.port`'s plan: the same pairing,
the same checks), and runs the same for every layer without a quantized weight. A
layer holding one is not converted: its conversion (`decode` then `encode` of its
codecs) is traced abstractly, and each output that is the quantized weight moved by
layout changes only (transposes, reshapes, a cast) becomes a `QuantizedArray` holding
the checkpoint's own tensors and those changes, applied after dequantizing. A
conversion that computes with the weight (anything else) is refused, naming the
layer: the kept weight could not be what the dequantizing load gives.

Not kept (refused, naming the cause): GGUF files (their blocks are dequantized by
`gguf`'s NumPy code only), layers of a stack (`nn.scan`) on either side, and a
PyTorch-layout `like` (a state dict has no place for a quantized leaf).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from .._adapters._native import (
    check_model,
    like as like_form,
    to_neutral,
)
from .._adapters._registry import TORCH_LAYOUT, layout_of
from .._io._contents import Contents
from .._io._format import format_named
from .._io._model import file_tree
from .._io._plugins import Filled, Request
from .._io._read import lazy
from .._kept._array import SCHEMES, QuantizedArray, Scheme, dequantized, is_quantized
from .._paths import Path, path_of, path_str
from .._port import _errors
from .._port._plan import PlanRow
from .._port._planning import make_plan
from .._port._port import examples
from .._port._run import _decoded, _encoded, run
from .._tree import Tree, framework, map_with_path
from . import _gguf
from ._read import applies, scan
from ._schemes import Quantized, read_parts


class KeepError(ValueError):
    """`keep_quantized=True` cannot keep this checkpoint's weights quantized."""


_NO_KEEP = """\
{path}: keep_quantized=True cannot keep {n} weight(s) quantized, so nothing was \
loaded:
{problems}
Load without keep_quantized (each weight dequantized as its layer is converted) for \
these."""

_LAYOUT_OPS = {"transpose", "reshape", "convert_element_type", "copy", "copy_p"}


def dequantize(model: Any) -> Any:
    """The model with every weight kept quantized replaced by its dense weight.

    Call it inside your `jax.jit` (or `nnx.jit`, `eqx.filter_jit`) before the
    forward pass: the dense weights are then temporaries of the compiled computation,
    not arrays you hold. `bridge.make_step` does it by itself.

    **Arguments:**

    - `model`: a model from `bridge.load(..., keep_quantized=True)`, of any
      framework (or its `bridge.Tree`); a model without quantized weights comes back
      as it is.

    **Returns:**

    The same kind of object, each `bridge.QuantizedArray` replaced by a dense array
    of its `shape` and `dtype`, bit for bit what `bridge.load` without
    `keep_quantized` gives.

    **Example:**

    ```python
    >>> import jax, bridge
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> @jax.jit
    ... def forward(model, x):
    ...     return bridge.dequantize(model)(x)
    >>> forward(model, jax.numpy.ones((1, 2))).shape
    (1, 3)

    ```
    """
    if isinstance(model, Tree):
        return dequantized(model)
    check_model(model, "model")
    tree = to_neutral(model)
    return like_form(model, dequantized(tree))


_NO_SAVE = """\
{path}: the model holds {n} weight(s) kept quantized (bridge.load(..., \
keep_quantized=True)): {paths}. bridge does not write them yet, so nothing was \
written (their tensors under a dense model's names would be a file no reader \
expects). Save the dense model, bridge.save(path, bridge.dequantize(model)); LoRA \
adapters trained on it, bridge.save_peft(directory, model); the quantized weights are \
the checkpoint you loaded."""


def refuse_saving_kept(path: Any, tree: Tree) -> None:
    """Refuse to save a Tree holding weights kept quantized (see `_NO_SAVE`)."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_quantized)[0]
    kept = [jax.tree_util.keystr(p) for p, x in flat if is_quantized(x)]
    if kept:
        shown = ", ".join(kept[:3]) + (
            f", ... ({len(kept)} in all)" if len(kept) > 3 else ""
        )
        raise ValueError(_NO_SAVE.format(path=path, n=len(kept), paths=shown))


def check(request: Request) -> None:
    """Refuse `keep_quantized=True` without `like` or with `opt_state_like`."""
    if request.keep_quantized and request.like is None:
        raise TypeError(
            f"{request.path}: keep_quantized=True needs `like`, the model to load "
            "into (a quantized weight is kept in the place of a model's dense weight)."
        )
    if request.keep_quantized and request.opt_state_like is not None:
        raise TypeError(
            "keep_quantized=True loads a model to run or to train adapters on, not a "
            "training checkpoint: leave out `opt_state_like`."
        )


def load_kept(contents: Contents, request: Request) -> Filled | None:
    """`like` filled from the checkpoint, quantized weights kept quantized (see the
    module's note), with the plan; None without `keep_quantized=True` or for a
    checkpoint with nothing quantized (loaded as usual)."""
    if not request.keep_quantized:
        return None
    like, dtype = request.like, request.dtype
    if isinstance(contents.source, _gguf.Source):
        raise KeepError(
            f"{contents.path}: keep_quantized=True does not keep GGUF weights "
            "quantized yet (their blocks are dequantized by the gguf package's "
            "NumPy code, not inside jax.jit). Load it without keep_quantized."
        )
    target = request.target  # like's Tree, its leaves placeholders
    assert target is not None
    if layout_of(framework(target)) == TORCH_LAYOUT:
        raise KeepError(
            f"{contents.path}: keep_quantized=True keeps weights quantized in Flax "
            "Linen, Flax NNX and Equinox models, not in a PyTorch-layout model "
            "(a state dict has no place for a quantized weight). Load into one of "
            "those, or without keep_quantized."
        )
    sharded = _sharded_leaves(target)
    if sharded:
        raise KeepError(
            f"{contents.path}: keep_quantized=True places the weights it keeps on the "
            "default device, but `like` has leaves sharded over several devices "
            f"({', '.join(sharded[:3])}{', ...' if len(sharded) > 3 else ''}). Load "
            "without keep_quantized to keep `like`'s shardings, or load into an "
            "unsharded `like` and place the model yourself with jax.device_put."
        )
    fmt = format_named(contents.format)
    arrays = lazy(contents, dtype)
    if arrays is None or fmt.lazy is None or not applies(contents):
        return None  # nothing quantized: an ordinary load
    stored = fmt.lazy(contents)
    found = scan(contents, stored).quantized
    if not found:
        return None
    # each quantized weight's LazyArray (of the dense dtype) -> its description
    by_id = {id(arrays[name]): (q, arrays[name].dtype) for name, q in found.items()}
    source = file_tree(contents, arrays)
    plan, problems = make_plan(
        source,
        target,
        request.rules,
        request.strict,
        dtype,
        examples(request.example, request.example_kwargs),
    )
    if problems:
        error = _errors.PortError(problems)
        error.add_note(f"(while porting {contents.path} into the model)")
        raise error
    quantized_steps, others, refused = [], [], []
    for step in plan.steps:
        s, t = step._source, step._target
        assert s is not None and t is not None
        held = [k for k, v in s.leaves.items() if id(v) in by_id]
        if s.arrays is not None:
            held += [k for k, v in s.arrays.items() if id(v) in by_id]
        if not held:
            others.append(step)
        elif s.index is not None or t.index is not None:
            refused.append(
                f"{step.source} -> {step.target}: a layer of a stack (nn.scan) "
                "is not kept quantized"
            )
        else:
            quantized_steps.append(step)
    unkept = sorted(
        f"{q.name}: {q.describe()} is not kept quantized yet"
        for q in found.values()
        if q.scheme not in SCHEMES or (q.scheme == "gptq" and 32 % q.bits)
    )
    refused += unkept
    kept: dict[Path, QuantizedArray] = {}
    for step in quantized_steps:
        kept.update(_kept_layer(step, by_id, stored, refused, contents.path))
    if refused:
        raise KeepError(
            _NO_KEEP.format(
                path=contents.path,
                n=len(refused),
                problems="\n".join(f"  - {p}" for p in refused),
            )
        )
    # every other layer (and a kept layer's other arrays, in `kept`) as a
    # dequantizing load moves it
    tree = run(dataclasses.replace(plan, steps=tuple(others)))
    tree = map_with_path(lambda path, leaf: kept.get(path, leaf), tree)
    said = list(plan.warnings)  # mismatched layers: in load's report, as port's
    if said:
        warnings.warn(
            "Port warnings:\n  " + "\n  ".join(said), _errors.PortWarning, stacklevel=4
        )
    return Filled(like_form(like, tree), None, plan)


def _sharded_leaves(target: Tree) -> list[str]:
    """The paths of `target`'s leaves placed (or to be placed) on several devices."""
    return [
        path_str(path_of(p))
        for p, leaf in jax.tree_util.tree_flatten_with_path(target)[0]
        if len(getattr(getattr(leaf, "sharding", None), "device_set", ())) > 1
    ]


def _kept_layer(
    step: PlanRow,
    by_id: dict[int, tuple[Quantized, Any]],
    stored: Mapping[str, Any],
    refused: list[str],
    file: Any,
) -> dict[Path, Any]:
    """The target arrays of one layer holding quantized weights: each quantized
    weight as a `QuantizedArray` (its layout changes traced), each other array
    converted as `bridge.port` converts it."""
    s, t = step._source, step._target
    assert s is not None and t is not None
    leaves = dict(s.leaves)
    quantized = {k: by_id[id(v)] for k, v in leaves.items() if id(v) in by_id}
    dense = {k: v for k, v in leaves.items() if k not in quantized}
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in leaves.items()}

    def convert(values: dict[str, Any]) -> dict[str, Any]:
        return _encoded(step, _decoded(step, values), t.leaves)

    try:
        closed = jax.make_jaxpr(convert)(abstract)
    except jax.errors.JAXTypeError as e:
        refused.append(f"{step.source}: its conversion cannot be traced ({e})")
        return {}
    names = sorted(abstract)  # make_jaxpr flattens the dict in sorted key order
    origin: dict[Any, Any] = {}
    for name, var in zip(names, closed.jaxpr.invars):
        if name in quantized:
            origin[var] = (name, ())
    outs = _follow(closed.jaxpr, origin)
    out_names = sorted(jax.eval_shape(convert, abstract))
    out: dict[Path, Any] = {}
    plain: list[str] = []
    for key, found in zip(out_names, outs):
        path = t.path + t.paths[key]
        if found is None:
            plain.append(key)
        elif found == "mixed":
            refused.append(
                f"{step.source} -> {path_str(path)}: the conversion "
                f"({step.transform or step.kind}) computes with the quantized weight, "
                "not only moves it"
            )
        else:
            name, ops = found
            q, dtype = quantized[name]
            out[path] = _quantized_array(q, dtype, ops, stored, file)
    if plain and not any(r.startswith(step.source) for r in refused):
        # the layer's other arrays (a bias): converted with the quantized ones as
        # zeros that XLA drops, since nothing kept depends on them
        def others(values: dict[str, Any]) -> dict[str, Any]:
            full = dict(values)
            for k in quantized:
                full[k] = jnp.zeros(leaves[k].shape, leaves[k].dtype)
            result = convert(full)
            return {k: result[k] for k in plain}

        values = {k: jnp.asarray(np.asarray(v)) for k, v in dense.items()}
        for key, value in jax.jit(others)(values).items():
            out[t.path + t.paths[key]] = value
    return out


def _follow(jaxpr: Any, origin: dict[Any, Any]) -> list[Any]:
    """For each output of `jaxpr`: None if it depends on no quantized input;
    `(input name, layout ops)` if it is one moved by layout changes only;
    `"mixed"` otherwise."""
    env: dict[Any, Any] = dict(origin)

    def read(v: Any) -> Any:
        return None if isinstance(v, Literal) else env.get(v)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if all(i is None for i in ins):
            continue
        sub = eqn.params.get("jaxpr")
        if sub is not None and hasattr(sub, "jaxpr"):  # a nested jit
            inner = {v: i for v, i in zip(sub.jaxpr.invars, ins) if i is not None}
            results = _follow(sub.jaxpr, inner)
        elif (
            eqn.primitive.name in _LAYOUT_OPS
            and len(eqn.invars) == 1
            and ins[0] != "mixed"
        ):
            name, ops = ins[0]
            results = [(name, ops + (_op(eqn),))]
        else:
            results = ["mixed"] * len(eqn.outvars)
        for v, r in zip(eqn.outvars, results):
            if r is not None:
                env[v] = r
    return [read(v) for v in jaxpr.outvars]


def _op(eqn: Any) -> tuple[str, Any]:
    name = eqn.primitive.name
    if name == "transpose":
        return ("transpose", tuple(int(a) for a in eqn.params["permutation"]))
    if name == "reshape":
        return ("reshape", tuple(int(d) for d in eqn.params["new_sizes"]))
    if name == "convert_element_type":
        return ("astype", jnp.dtype(eqn.params["new_dtype"]).name)
    return ("reshape", tuple(int(d) for d in eqn.outvars[0].aval.shape))  # a copy


def _quantized_array(
    q: Quantized,
    dtype: Any,
    ops: tuple[tuple[str, Any], ...],
    stored: Mapping[str, Any],
    file: Any,
) -> QuantizedArray:
    read = read_parts(file, q, lambda name: stored[name].read())  # scales checked
    parts = {
        part: jnp.asarray(array)
        for part, array in read.items()
        if part != "shape"  # compressed-tensors' weight_shape: in the scheme
    }
    settings = tuple(
        (k, tuple(v) if isinstance(v, list) else v)
        for k, v in sorted(q.settings.items())
    )
    name = jnp.dtype(dtype).name
    scheme = Scheme(q.scheme, q.bits, tuple(q.shape), name, settings, ops)
    return QuantizedArray(parts, scheme)
