"""PEFT's LoRA files: `bridge.save_peft` writes a model's adapters as PEFT does
(`adapter_model.safetensors` + `adapter_config.json`), `bridge.load_peft` puts a
PEFT adapter on a model of any framework.

A layer's PyTorch name is the one `bridge.save_pretrained` gives it: its
dotted path, or the name the `rules` that paired a PyTorch model's layers with this
model's give it, read backwards. A stack of layers is written one layer at a time
(`layers.0.q_proj`, `layers.1.q_proj`, ...), the index after the stack's path. Keys
are `base_model.model.<prefix><name>.lora_A.weight` `(r, in)` and `.lora_B.weight`
`(out, r)` (a convolution's `(r, in, *window)` and `(out, r, 1, ...)`; an
embedding's `.lora_embedding_A` `(r, num)` and `.lora_embedding_B` `(dim, r)`).
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path as FilePath
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._adapters._native import check_model, to_neutral
from .._arguments import (
    check_inputs,
    check_pair_or_mapping,
    check_path,
    check_rules,
    check_str,
)
from .._io import _safetensors
from .._io._atomic import atomic_dir, reachable
from .._io._config import read_json
from .._io._errors import CheckpointError
from .._io._files import inode
from .._io._ported import paired_names
from .._io._torch_layout import _name, indexed_names
from .._paths import Path, at, path_str
from .._port._reverse import reverse_rules
from .._port._trace import Example
from .._port.codecs._torch import CONV1D_NAMES
from .._shown import shown
from .._tree import Tree, framework
from ._fused import Part, Split, check_split, fuse, part_of, parts_of, split_b
from ._merge import merge_lora
from ._settings import A, B, Injection, Settings, Target, frame_of


WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
MODEL = "base_model.model."
CONFIG_LIMIT = 10_000_000
"""The most bytes an `adapter_config.json` may have (PEFT's are a few kilobytes; a
`rank_pattern` over thousands of layers stays far below)."""
_FORMAT = "PEFT adapter"

_KNOWN = {
    # read and honoured
    "peft_type", "r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern",
    "alpha_pattern", "lora_dropout", "bias",
    "fan_in_fan_out",  # only how PEFT merges (Conv1D weights), not the adapter
    # only their defaults are supported (checked in `_unsupported_settings`)
    "use_dora", "lora_bias", "modules_to_save", "layers_to_transform",
    "layers_pattern", "exclude_modules", "layer_replication", "target_parameters",
    "trainable_token_indices", "alora_invocation_tokens", "use_qalora", "use_bdlora",
    # about training or the base model, no effect on the adapter's forward pass
    "task_type", "base_model_name_or_path", "revision", "inference_mode",
    "init_lora_weights", "auto_mapping", "peft_version", "megatron_config",
    "megatron_core", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
    "arrow_config", "kasa_config", "monteclora_config", "velora_config",
    "qalora_group_size", "ensure_weight_tying",
}  # fmt: skip
_DEFAULTS = {
    "use_dora": False, "lora_bias": False, "modules_to_save": None,
    "layers_to_transform": None, "layers_pattern": None, "exclude_modules": None,
    "layer_replication": None, "target_parameters": None,
    "trainable_token_indices": None, "alora_invocation_tokens": None,
    "use_qalora": False, "use_bdlora": None, "bias": "none",
}  # fmt: skip

_UNREAD = "DoRA's lora_magnitude_vector and other methods' tensors are not read"
_CANNOT_LOAD = """\
bridge.load_peft cannot apply {dir}: {n} problem(s), nothing was applied.
{problems}"""
_UNPAIRED = (
    "names: the adapted layers {layers} pair with no layer of `like` (both forward "
    "passes on the example inputs): PEFT could not find them in that model"
)
_PREFIX = (
    "`prefix` with `like`: the layers are named as `like` names them (its names "
    "already hold a head model's `base_model_prefix`); leave `prefix` out"
)
_CANNOT_SAVE = """\
bridge.save_peft cannot write the adapters: {n} problem(s), nothing was written.
{problems}"""


def names(
    tree: Tree,
    found: list[Target],
    rules: Mapping[str, str] | None,
    prefix: str,
    paired: Mapping[str, str] | None = None,
) -> list[tuple[str, Target, int | None]]:
    """Each target's PyTorch layer name(s), one per layer of a stack; with
    `paired` (`{layer path: name}`, `_ported.paired_names`), the names it gives
    (`ValueError` naming each layer it has none for)."""
    if paired is not None:
        lone = [w for t in found for w, _ in layer_paths(tree, t) if w not in paired]
        if lone:
            raise ValueError(_UNPAIRED.format(layers=lone))
        return [
            (paired[where], target, index)
            for target in found
            for where, index in layer_paths(tree, target)
        ]
    backwards = reverse_rules(rules or {})
    indexed = indexed_names(tree)  # as `bridge.save_pretrained` names them
    return [
        (prefix + _name(where, backwards, indexed), target, index)
        for target in found
        for where, index in layer_paths(tree, target)
    ]


def layer_paths(tree: Tree, target: Target) -> list[tuple[str, int | None]]:
    """The `keystr` path of each layer of `target` with its index in the stack
    (`.layers[0].q_proj`, ...), or the target's own path and None."""
    if not target.stack:
        return [(path_str(target.path), None)]
    root = _stack_root(tree, target)
    rest = target.path[len(root) :]
    return [(path_str(root + (i,) + rest), i) for i in range(target.stack[0])]


def _stack_root(tree: Tree, target: Target) -> Path:
    """The outermost node at or above `target` (below the root) whose arrays all
    share the stack's leading axes: the index of a layer goes after its path."""
    lead = target.stack
    root = target.path
    for n in range(len(target.path) - 1, 0, -1):  # the root is no stack: a model
        node = at(tree, target.path[:n])
        shapes = [np.shape(x) for x in _arrays(node)]
        if not shapes or any(s[: len(lead)] != lead for s in shapes):
            break
        root = target.path[:n]
    return root


def _arrays(node: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(node)


def _peft_shapes(target: Target, rank: int) -> list[tuple[int, ...]]:
    """The shapes of PEFT's `lora_A` and `lora_B` for one layer of `target`."""
    n = len(target.stack)
    # zero-strided views: nothing allocated, whatever rank the config claims
    a, b = (np.broadcast_to(np.int8(0), s[n:]) for s in target.shapes(rank))
    return [x.shape for x in to_peft(target, a, b)]


def to_peft(target: Target, a: Any, b: Any) -> tuple[np.ndarray, np.ndarray]:
    """One layer's adapter (not stacked) as PEFT's `lora_A` and `lora_B` tensors."""
    a, b = np.asarray(a), np.asarray(b)
    window = len(target.fan_in) - 1 if target.kind == "conv" else 0
    if target.layout == "flax":
        a = np.moveaxis(a, -1, 0)  # (*fan_in, r) -> (r, *fan_in)
        if target.kind == "conv":
            a = np.moveaxis(a, -1, 1)  # (r, *window, in) -> (r, in, *window)
        b = b.T
    return a, b.reshape(b.shape + (1,) * window)


def from_peft(target: Target, a: np.ndarray, b: np.ndarray) -> tuple[Any, Any]:
    """The inverse of `to_peft`: PEFT's tensors in the target's layout."""
    b = b.reshape(b.shape[:2])  # a convolution's (out, r, 1, ...)
    if target.layout == "flax":
        if target.kind == "conv":
            a = np.moveaxis(a, 1, -1)  # (r, in, *window) -> (r, *window, in)
        a = np.moveaxis(a, 0, -1)
        a = a.reshape(target.fan_in + (a.shape[-1],))
        b = b.T
    return jnp.asarray(a), jnp.asarray(b)


def _keys(name: str, target: Target) -> tuple[str, str]:
    if target.kind == "embed":
        return f"{MODEL}{name}.lora_embedding_A", f"{MODEL}{name}.lora_embedding_B"
    return f"{MODEL}{name}.lora_A.weight", f"{MODEL}{name}.lora_B.weight"


def save_peft(
    directory: str | os.PathLike,
    model: Any,
    *,
    rules: Mapping[str, str] | None = None,
    prefix: str = "",
    split: Split | None = None,
    like: Any = None,
    example: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Write a model's LoRA adapters as a PEFT adapter directory.

    Writes `adapter_model.safetensors` and `adapter_config.json`, which
    `peft.PeftModel.from_pretrained(torch_model, directory)` loads onto the PyTorch
    model whose layer names `bridge.save_pretrained(folder, model, rules=rules)`
    gives;
    with `like` and `example`, onto `like` itself, whatever the model's own names.
    The directory appears whole or not at all; over an existing adapter, only the
    adapter's own files are replaced (a README.md, tokenizer files are kept).

    **Arguments:**

    - `directory`: the adapter directory to write (replaced if it holds an adapter
      or nothing; refused if it holds other files only).
    - `model`: a model with adapters (`bridge.lora`, `bridge.load_peft`), in any
      form `bridge.lora` takes.
    - `rules`: the rules that paired a PyTorch model's layers with this model's on
      import (`{PyTorch layer regex: this model's layer path}`, as `bridge.port`
      takes), read backwards to name the layers.
    - `prefix`: put before every layer name (`"model."` for a model that is the
      inner `model` of a Hugging Face `...ForCausalLM`).
    - `split`: fused PyTorch layers whose parts are separate layers of this model,
      as `bridge.from_torch` takes it (`{r"h\\.\\d+\\.attn\\.c_attn": ("query",
      "key", "value")}` for GPT-2): the parts' adapters are written as one adapter
      of the fused layer (named by the pattern's literal end, `c_attn`), exactly:
      PEFT's `lora_A` and `lora_B` stacked when the parts share `lora_A` and
      settings (rank `r`), else of the parts' ranks together, `lora_B`
      block-diagonal (a part without adapter: zero rows).
    - `like`, `example`, `example_kwargs`: the base model the adapter is for, as
      `bridge.save_pretrained(..., like=..., example=...)` takes them: a
      Hugging Face folder (its model built from its `config.json`) or a PyTorch
      module, and example inputs of the model. Both forward passes pair the
      model's layers with `like`'s, and each adapter is named by the layer of
      `like` it pairs with: a model with names of its own (a rewrite of a hub
      model) writes an adapter PEFT opens on that hub model. `rules` then pair the
      layers they match first; `prefix` is refused.

    **Config:** `r` and `lora_alpha` are the most common rank and alpha;
    `rank_pattern`/`alpha_pattern` name the layers that differ; `target_modules` the
    adapted layers' last names; `use_rslora`, `lora_dropout`; `fan_in_fan_out`
    (true when every layer is a Hugging Face `Conv1D`, GPT-2's `c_attn`, `c_proj`,
    `c_fc`, as PEFT sets it) and `bias` `"none"` (bridge adapters have no bias).

    **Example:**

    ```python
    >>> import json, tempfile, jax, bridge
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    >>> model = bridge.lora(model, ["layers.0"], rank=2, alpha=4, key=jax.random.key(0))
    >>> from pathlib import Path
    >>> d = Path(tempfile.mkdtemp()) / "adapter"
    >>> bridge.save_peft(d, model)
    >>> json.loads((d / "adapter_config.json").read_text())["lora_alpha"]
    4.0

    ```
    """
    check_path(directory, "directory")
    check_model(model, "model")
    check_rules(rules)
    check_str(prefix, "prefix")
    split = check_split(split)
    check_inputs(example, "example")
    check_pair_or_mapping(example_kwargs, "example_kwargs")
    if (like is None) != (example is None):
        raise TypeError(
            "`like` and `example` go together: the layers are paired by "
            "both forward passes on the example inputs."
        )
    if like is not None and prefix:
        raise ValueError(_PREFIX)
    tree = to_neutral(model)
    frame = frame_of(framework(tree))
    found = [t for t in frame.targets(tree) if t.settings is not None]
    problems: list[str] = []
    if not found:
        problems.append("the model holds no LoRA adapter")
    paired = None
    if like is not None and found:
        # the layers paired as the base model's (the adapters' products would
        # read as computations of their own), abstractly: nothing is merged
        base = jax.eval_shape(merge_lora, tree)
        paired = paired_names(base, like, Example(example, example_kwargs), rules)
    named: list[tuple[str, Target, int | None]] = []
    try:
        named = names(tree, found, rules, prefix, paired)
    except ValueError as error:
        problems.append(str(error))
    tensors: dict[str, np.ndarray] = {}
    owners: dict[str, str] = {}
    written: list[tuple[str, Settings]] = []
    fused: dict[str, tuple[Part, dict[int, Any]]] = {}
    for name, target, index in named:
        node = at(tree, target.path)
        a, b = getattr(node, A), getattr(node, B)
        if index is not None:
            a, b = a[index], b[index]
        part = part_of(name, split, prefix, problems)
        if part is not None:
            pieces = fused.setdefault(part.fused, (part, {}))[1]
            pieces[part.position] = (*to_peft(target, a, b), target)
            continue
        if name in owners:
            problems.append(
                f"names: layers {owners[name]} and {target.where} would both be "
                f"written as {name!r}"
            )
        owners[name] = target.where
        ka, kb = _keys(name, target)
        tensors[ka], tensors[kb] = to_peft(target, a, b)
        assert target.settings is not None  # `found` holds those with an adapter
        written.append((name, target.settings))
    if fused:
        targets = frame.targets(tree)
        if paired is not None:  # the parts `like` pairs (a fused layer's)
            targets = [t for t in targets if path_str(t.path) in paired]
        every = {n: t for n, t, _ in names(tree, targets, rules, prefix, paired)}
        for name, (part, pieces) in fused.items():
            done = _fuse(name, part, pieces, every, problems)
            if done is not None and name in owners:
                problems.append(f"names: {name!r} is a layer and a fused layer")
            elif done is not None:
                a, b, settings = done
                tensors[f"{MODEL}{name}.lora_A.weight"] = a
                tensors[f"{MODEL}{name}.lora_B.weight"] = b
                written.append((name, settings))
    problems = list(dict.fromkeys(problems))  # a split pattern's problem, once
    problems += _not_floats(tensors)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(_CANNOT_SAVE.format(n=len(problems), problems=lines))
    config = _config(written)
    path = FilePath(directory)
    with atomic_dir(path, _is_adapter, _not_the_adapters) as tmp:
        tmp.mkdir()
        # bridge's writer: a full disk is an `OSError` naming `directory`
        _safetensors.write_file(
            tmp / WEIGHTS,
            {k: np.ascontiguousarray(v) for k, v in tensors.items()},
            {"format": "pt"},
        )
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))


_ATTEMPTS = 5


def _read_adapter(path: FilePath) -> tuple[Any, Any, FilePath]:
    """The config and tensors of the adapter directory at `path` (or where a killed
    save left it, `_atomic.reachable`), both of one version: read again while a save
    swaps the directory between the two reads (the directory at `path` is another
    one after the reads than before them)."""
    for _ in range(_ATTEMPTS):
        where = reachable(path)
        before = inode(where)
        config = read_config(where / CONFIG)
        tensors = read_tensors(where / WEIGHTS)
        if inode(where) == before:
            return config, tensors, where
    raise CheckpointError(
        f"{path}: the adapter directory was replaced {_ATTEMPTS} times while it was "
        "read (a save of the same directory is running): load it again once the "
        "writer is done."
    )


_OWN = (WEIGHTS, CONFIG, "adapter_model.bin")  # the adapter's own files


def _is_adapter(path: FilePath) -> bool:
    """Whether `save_peft` may replace the directory: it holds an adapter, or
    nothing."""
    return (path / CONFIG).exists() or not any(path.iterdir())


def _not_the_adapters(name: str) -> bool:
    """The files of an adapter directory a new save keeps (README.md, tokenizer
    files, ...): all but the adapter's own."""
    return name not in _OWN


def _fuse(
    name: str,
    part: Part,
    pieces: dict[int, Any],
    every: dict[str, Target],
    problems: list[str],
) -> tuple[np.ndarray, np.ndarray, Settings] | None:
    """The adapter of fused layer `name` from its parts' (`{position: (lora_A,
    lora_B, target)}`), or None with the problems noted."""
    missing = [p for p in part.parts if p not in every]
    targets = [every.get(p) for p in part.parts]
    kinds = {t.kind for t in targets if t is not None}
    ins = {a.shape[1:] for a, _, _ in pieces.values()}
    if missing or kinds != {"linear"} or len(ins) != 1:
        why = (
            f"the model has no layer {missing}"
            if missing
            else "its parts are not dense layers of one input size"
        )
        problems.append(f"{name} (split into {list(part.parts)}): {why}")
        return None
    sizes = [t.fan_out for t in targets if t is not None]
    return fuse(
        [
            (pieces[i][0], pieces[i][1], pieces[i][2].settings) if i in pieces else None
            for i in range(len(part.parts))
        ],
        sizes,
    )


def _config(named: list[tuple[str, Settings]]) -> dict[str, Any]:
    ranks = collections.Counter(s.rank for _, s in named)
    alphas = collections.Counter(s.alpha for _, s in named)
    r = ranks.most_common(1)[0][0]
    alpha = alphas.most_common(1)[0][0]
    first = named[0][1]
    return {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name, _ in named}),
        "use_rslora": first.rslora,
        "lora_dropout": first.dropout,
        "rank_pattern": {n: s.rank for n, s in named if s.rank != r},
        "alpha_pattern": {n: s.alpha for n, s in named if s.alpha != alpha},
        # PEFT's own value for Hugging Face Conv1D layers (GPT-2's), whose weights
        # are (in, out); it sets the same itself, with a warning, if told otherwise
        "fan_in_fan_out": all(
            name.rsplit(".", 1)[-1] in CONV1D_NAMES for name, _ in named
        ),
        "bias": "none",
        "task_type": None,
        "base_model_name_or_path": None,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def _targeted(name: str, target_modules: Any) -> bool:
    """PEFT's `check_target_module_exists` for a string or a list of names."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in target_modules)


def _pattern(name: str, pattern: Mapping[str, Any], default: Any) -> Any:
    """PEFT's rank/alpha pattern lookup: the first key matching the name's end."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def load_peft(
    directory: str | os.PathLike,
    like: Any,
    *,
    rules: Mapping[str, str] | None = None,
    prefix: str = "",
    split: Split | None = None,
) -> Any:
    """Put a PEFT LoRA adapter (trained in PyTorch, or written by `bridge.save_peft`)
    on a model of any framework.

    Each layer PEFT's `target_modules` names (by the PyTorch names
    `bridge.save_pretrained(folder, model, rules=rules)` gives `like`'s layers) gets
    its adapter, with the config's rank, alpha (`rank_pattern`, `alpha_pattern`),
    `use_rslora` and `lora_dropout`; the per-layer adapters of a stack of layers
    are stacked.

    **Arguments:**

    - `directory`: a PEFT adapter directory (`adapter_config.json`,
      `adapter_model.safetensors`).
    - `like`: the base model (Linen, NNX, Equinox; a Tree or native).
    - `rules`, `prefix`: as for `bridge.save_peft`.
    - `split`: as for `bridge.save_peft`: the adapter of a fused PyTorch layer
      (GPT-2's `c_attn`, `lora_B (3E, r)`) goes to its parts, each with the whole
      `lora_A` and its rows of `lora_B`.

    **Returns:**

    `like` with the adapters, in the form it was given.

    **Raises:**

    `ValueError` listing every problem before anything is applied: unknown or
    unsupported config keys, a target module or tensor with no matching layer, a
    layer without its tensors, tensors whose shapes do not fit their layer.
    """
    check_path(directory, "directory")
    check_model(like, "like")
    check_rules(rules)
    check_str(prefix, "prefix")
    split = check_split(split)
    config, tensors, path = _read_adapter(FilePath(directory))
    tree = to_neutral(like)
    frame = frame_of(framework(tree))
    problems = _unsupported_settings(config)
    wrong = _wrong_types(config)
    if wrong:  # nothing below can read such a config
        n = len(problems) + len(wrong)
        lines = _listing(problems + wrong)
        # a file that is not a PEFT config (a ValueError, as every problem here)
        raise CheckpointError(_CANNOT_LOAD.format(dir=path, n=n, problems=lines))
    problems += _not_floats(tensors)
    named = names(tree, frame.targets(tree), rules, prefix)
    by_name = {n: (t, i) for n, t, i in named}
    modules = {k.removeprefix(MODEL).rsplit(".lora_", 1)[0] for k in tensors}
    # the layers PEFT names: one layer, or the parts of a fused layer (`split`)
    units: dict[str, list[tuple[str, Target, int | None]]] = {}
    for module in sorted(modules):
        parts = parts_of(module, split, prefix) if split else None
        if parts is None or module in by_name:
            continue
        missing = [p for p in parts if p not in by_name]
        if missing:
            problems.append(
                f"{module} (split into {parts}): the model has no {missing}"
            )
            continue
        units[module] = [(p, *by_name[p]) for p in parts]
    inside = {p for unit in units.values() for p, _, _ in unit}
    units.update({n: [(n, t, i)] for n, t, i in named if n not in inside})
    target_modules = config.get("target_modules") or []
    r, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    chosen = {n: unit for n, unit in units.items() if _targeted(n, target_modules)}
    used: set[str] = set()
    stacks: dict[Path, dict[int | None, tuple[np.ndarray, np.ndarray]]] = {}
    settings: dict[Path, Settings] = {}
    targets: dict[Path, Target] = {}
    for name, unit in chosen.items():
        where = ", ".join(t.where for _, t, _ in unit)
        ka, kb = _keys(name, unit[0][1])
        if ka not in tensors or kb not in tensors:
            problems.append(f"{name} ({where}): no {ka} / {kb} in {WEIGHTS}")
            continue
        used.update((ka, kb))
        a, b = tensors[ka], tensors[kb]
        rank = int(_pattern(name, config.get("rank_pattern") or {}, r))
        want = [_peft_shapes(t, rank) for _, t, _ in unit]
        fits = len({w[0] for w in want}) == 1 and {t.kind for _, t, _ in unit} == {
            unit[0][1].kind
        }
        want_b = (sum(w[1][0] for w in want),) + want[0][1][1:]
        if not fits or (a.shape, b.shape) != (want[0][0], want_b):
            cls = ", ".join(sorted({t.cls for _, t, _ in unit}))
            problems.append(
                f"{name} ({where}, {cls}): the adapter's shapes {a.shape} and "
                f"{b.shape} do not fit the layer, which takes {want[0][0]} and "
                f"{want_b} at rank {rank}"
            )
            continue
        layer_settings = Settings(
            rank,
            float(_pattern(name, config.get("alpha_pattern") or {}, alpha)),
            bool(config.get("use_rslora", False)),
            float(config.get("lora_dropout", 0.0)),
        )
        bs = split_b(b, [w[1][0] for w in want]) if len(unit) > 1 else [b]
        for (_, target, index), part_b in zip(unit, bs):
            old = settings.setdefault(target.path, layer_settings)
            if old != layer_settings:
                problems.append(
                    f"{name} ({target.where}): a stack of layers takes one rank and "
                    f"alpha, but its layers have {old[:2]} and {layer_settings[:2]}"
                )
            stacks.setdefault(target.path, {})[index] = (a, part_b)
            targets[target.path] = target
    for key in sorted(set(tensors) - used):
        module = key.removeprefix(MODEL).rsplit(".lora_", 1)[0]
        if module not in units:
            problems.append(f"{key}: no layer of the model is named {module!r}")
        elif module not in chosen:
            problems.append(
                f"{key}: target_modules {shown(target_modules)} leave out "
                f"{module!r}, so its adapter would be dropped: add it to "
                f"target_modules in {CONFIG}, or remove the tensor"
            )
        else:
            ka, kb = _keys(module, chosen[module][0][1])
            problems.append(
                f"{key}: not a tensor of a LoRA adapter (the layer's adapter is "
                f"{ka} and {kb}; {_UNREAD}), so it would be dropped: remove it, or "
                "load the adapter with PEFT"
            )
    if isinstance(target_modules, list):
        for t in target_modules:
            if not any(_targeted(n, [t]) for n in modules | set(units)) or not any(
                _targeted(n, [t]) for n in units
            ):
                problems.append(
                    f"target module {t!r}: no layer of the model matches it"
                )
    if not chosen and not problems:
        problems.append(
            f"target_modules {target_modules!r} match no layer of the model"
        )
    if problems:
        lines = _listing(problems)
        raise ValueError(_CANNOT_LOAD.format(dir=path, n=len(problems), problems=lines))
    injections = []
    for tpath, per in stacks.items():
        target = targets[tpath]
        if target.stack:  # a layer PEFT has no adapter for: a zero one
            zero = [np.zeros_like(x) for x in next(iter(per.values()))]
            pairs = [
                from_peft(target, *per.get(i, zero)) for i in range(target.stack[0])
            ]
            a = jnp.stack([p[0] for p in pairs])
            b = jnp.stack([p[1] for p in pairs])
        else:
            a, b = from_peft(target, *per[None])
        injections.append(Injection(target, a, b, settings[tpath], None))
    out = frame.inject(tree, injections)
    return out if isinstance(like, Tree) else frame.native(like, out)


SHOWN = 20
"""The most problems an error lists (an adapter naming 20,000 missing layers gave a
1.6 MB message); the rest are counted."""


def _listing(problems: list[str]) -> str:
    lines = [f"  - {p}" for p in problems[:SHOWN]]
    if len(problems) > SHOWN:
        lines.append(f"  ... and {len(problems) - SHOWN} more")
    return "\n".join(lines)


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    twice = sorted(
        k for k, n in collections.Counter(k for k, _ in pairs).items() if n > 1
    )
    if twice:
        raise ValueError(f"it names {twice[:5]} more than once")
    return dict(pairs)


def read_config(file: FilePath) -> dict[str, Any]:
    """The JSON object in `adapter_config.json`, read as bridge reads a checkpoint's
    header: a regular file (opened without blocking: a FIFO or a device is refused,
    never waited on), at most `CONFIG_LIMIT` bytes, one value per key. Raises
    `CheckpointError` (a `ValueError`; `FileNotFoundError` when missing) naming the
    file."""
    return read_json(file, _FORMAT, CONFIG_LIMIT, _unique)


def read_tensors(file: FilePath) -> dict[str, np.ndarray]:
    """Every tensor of `adapter_model.safetensors`, read by bridge's safetensors
    reader (a regular file, its header checked before any array is read)."""
    with _safetensors.metadata(file) as contents:
        return {s.key: _safetensors.read_one(contents, s.key) for s in contents.tensors}


def _not_floats(tensors: Mapping[str, Any]) -> list[str]:
    """A problem for each tensor of an adapter that is not of a floating-point dtype
    (an integer or bool `lora_A` would be read as a silently wrong adapter)."""
    return [
        f"{WEIGHTS}: {shown(key)} is {np.dtype(a.dtype)}, not a floating-point tensor "
        "(LoRA's matrices are float32, bfloat16 or float16): convert it with "
        ".astype, or train the adapter again"
        for key, a in tensors.items()
        if not jnp.issubdtype(a.dtype, jnp.floating)
    ]


def _number(value: Any) -> bool:
    """A finite JSON number (Python's json reads `NaN` and `Infinity`)."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


_MOST_RANK = 2**31 - 1
"""The largest rank read: `r: 2**62` made even the zero-strided views that compare
shapes overflow (NumPy's raw 'iterator is too large'); real ranks are below 10**4."""


def _rank(value: Any) -> bool:
    return type(value) is int and 0 < value <= _MOST_RANK


_TYPES: dict[str, tuple[str, Any]] = {
    "r": ("a positive integer below 2**31", _rank),
    "lora_alpha": ("a finite number", _number),
    "use_rslora": ("true or false", lambda v: isinstance(v, bool)),
    "lora_dropout": ("a number from 0 to 1", lambda v: _number(v) and 0 <= v < 1),
    "target_modules": (
        "a regular expression or a list of names",
        lambda v: (
            v is None
            or isinstance(v, str)
            or (isinstance(v, list) and all(isinstance(t, str) for t in v))
        ),
    ),
    "rank_pattern": (
        "a map of names to positive integers below 2**31",
        lambda v: v is None or (isinstance(v, dict) and all(map(_rank, v.values()))),
    ),
    "alpha_pattern": (
        "a map of names to finite numbers",
        lambda v: v is None or (isinstance(v, dict) and all(map(_number, v.values()))),
    ),
}


def _wrong_types(config: Mapping[str, Any]) -> list[str]:
    """The config values bridge reads that are not of PEFT's types."""
    wrong = [
        f"{CONFIG}: {key} is {shown(config[key])}, not {what}"
        for key, (what, ok) in _TYPES.items()
        if key in config and not ok(config[key])
    ]
    if wrong:
        return wrong
    patterns = [
        (key, p)
        for key in ("rank_pattern", "alpha_pattern")
        for p in config.get(key) or {}
    ]
    if isinstance(config.get("target_modules"), str):
        patterns.append(("target_modules", config["target_modules"]))
    for key, pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            wrong.append(
                f"{CONFIG}: {key} {shown(pattern)} is no regular expression ({e})"
            )
    return wrong


def _unsupported_settings(config: Mapping[str, Any]) -> list[str]:
    problems = []
    unknown = sorted(set(config) - _KNOWN)
    if unknown:
        problems.append(
            f"{CONFIG}: unknown key(s) {unknown}; bridge reads PEFT's LoRA configs "
            f"(keys {sorted(_KNOWN)})"
        )
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"{CONFIG}: peft_type {config['peft_type']!r} is not LORA")
    for key, default in _DEFAULTS.items():
        value = config.get(key, default)
        if value != default and not (value in ({}, []) and default is None):
            problems.append(
                f"{CONFIG}: {key}={value!r} is not supported (only {default!r})"
            )
    return problems
