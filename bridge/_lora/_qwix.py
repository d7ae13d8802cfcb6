"""`bridge.from_qwix_lora`: qwix's LoRA parameters read as bridge adapters.

qwix (`qwix.apply_lora_to_model`) intercepts a Flax model's `dot_general` and
`conv_general_dilated` and keeps each adapted weight's adapter beside it, as
`<param>_lora_a` and `<param>_lora_b` (`nnx.LoRAParam` in NNX, arrays in Linen's
`params`), in Flax's orientation: `lora_a (*fan_in, rank)` (a convolution's `(*window,
in, rank)`, a per-head kernel's contracted axes flattened), `lora_b (rank, *fan_out)`.
Its rank and alpha are not in the model but in the provider's rules (`LoraRule(
module_path=regex, rank=, alpha=, dropout=)`, the first whose `module_path` fully
matches the layer's `/`-joined path, and whose `op_names` hold the layer's operation).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .._adapters._native import check_model, to_neutral
from .._arguments import check_number, type_error
from .._tree import Tree, framework
from ._settings import Injection, QwixAdapter, Settings, Target, frame_of


_NOT_QWIX = (
    "bridge.from_qwix_lora reads Flax NNX and Linen models adapted by qwix; got a "
    "{framework} model."
)
_RULES_OR_ALPHA = (
    "bridge.from_qwix_lora needs the adapters' alpha, which qwix keeps in its rules, "
    "not in the model: pass rules= (the qwix.LoraProvider, or its list of "
    "qwix.LoraRule) or alpha= (one alpha for every layer), not {what}."
)
_CANNOT_READ = """\
bridge.from_qwix_lora cannot read this model's qwix adapters: {n} problem(s), \
nothing was changed.
{problems}"""
_OPS = {"linear": "dot_general", "conv": "conv_general_dilated"}


def from_qwix_lora(model: Any, *, rules: Any = None, alpha: float | None = None) -> Any:
    """qwix's LoRA adapters as bridge adapters.

    Every `<param>_lora_a`/`<param>_lora_b` pair that `qwix.apply_lora_to_model`
    put on a Dense/Linear, per-head `DenseGeneral`/`LinearGeneral` or Conv kernel
    becomes the layer's `lora_a`/`lora_b`, with the rank of `lora_a` and the alpha
    (and dropout) of the qwix rule that adapted the layer, so the model computes
    what qwix's computed (`x W + alpha / rank (x A) B`), without qwix: the model's
    own class again, qwix's attributes gone. Then `bridge.save_peft`,
    `bridge.merge_lora`, `bridge.port` and the step work on them as on any bridge
    adapter.

    **Arguments:**

    - `model`: a qwix-adapted NNX model, a Linen `(module, variables)` pair, bound
      module or variables (a module is needed to run the adapters), or a
      `bridge.Tree` of one.
    - `rules`: the `qwix.LoraProvider` that adapted the model, or its list of
      `qwix.LoraRule`s: each layer takes the first rule whose `module_path` fully
      matches its `/`-joined path (and whose `op_names`, if any, hold its
      operation), as qwix chooses it.
    - `alpha`: instead of `rules`, one alpha for every layer (no dropout).

    **Returns:**

    The model with bridge adapters, in the form it was given; the given model is not
    changed and shares its arrays with the result.

    **Raises:**

    `ValueError` listing every adapter that cannot be read (on a layer kind bridge
    adapts otherwise, such as `Embed.attend`, or an `Einsum`; shapes that do not
    fit; no rule, or a rule of another rank), or when the model holds none.

    **Example:**

    qwix's `apply_lora_to_model(model, qwix.LoraProvider(module_path=".*", rank=2,
    alpha=4.0), x, rngs=nnx.Rngs(1))` leaves such parameters on each `Linear`:

    ```python
    >>> import jax.numpy as jnp, bridge
    >>> from flax import nnx
    >>> layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    >>> layer.kernel_lora_a = nnx.LoRAParam(jnp.ones((4, 2)))
    >>> layer.kernel_lora_b = nnx.LoRAParam(jnp.zeros((2, 3)))
    >>> read = bridge.from_qwix_lora(nnx.Sequential(layer), alpha=4.0)
    >>> read.layers[0].lora_a.shape, read.layers[0].lora_settings.scaling
    ((4, 2), 2.0)

    ```
    """
    check_model(model, "model")
    if (rules is None) == (alpha is None):
        what = "both" if rules is not None else "neither"
        raise TypeError(_RULES_OR_ALPHA.format(what=what))
    check_number(alpha, "alpha", optional=True)
    rule_list = _rules(rules) if rules is not None else None
    tree = to_neutral(model)
    name = framework(tree)
    frame = frame_of(name) if name in ("nnx", "linen") else None
    if frame is None or frame.qwix is None:
        raise TypeError(_NOT_QWIX.format(framework=name or "partial-Tree"))
    plain, found = frame.qwix(tree)
    by_path = {t.path: t for t in frame.targets(plain)}
    problems: list[str] = []
    injections = []
    for adapter in found:
        target = by_path.get(adapter.path)
        settings = _settings(adapter, target, rule_list, alpha, problems)
        if settings is not None and target is not None:
            injections.append(Injection(target, adapter.a, adapter.b, settings, None))
    if not found:
        problems.append("the model holds no qwix LoRA parameter (<param>_lora_a)")
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(_CANNOT_READ.format(n=len(problems), problems=lines))
    out = frame.inject(plain, injections)
    return out if isinstance(model, Tree) else frame.native(model, out)


def _rules(rules: Any) -> list[Any]:
    """A provider's rules (qwix keeps them in `_rules`), or the rules given."""
    listed = getattr(rules, "_rules", rules)
    if isinstance(listed, (str, bytes)) or not isinstance(listed, Sequence):
        raise type_error(
            "rules", "a qwix.LoraProvider or a list of qwix.LoraRule", rules
        )
    for rule in listed:
        if not hasattr(rule, "module_path"):
            raise type_error("rules", "qwix.LoraRule objects", rule)
    return list(listed)


def _settings(
    adapter: QwixAdapter,
    target: Target | None,
    rules: list[Any] | None,
    alpha: float | None,
    problems: list[str],
) -> Settings | None:
    where = "/".join(map(str, adapter.path)) or "(root)"
    at = f"{where} ({adapter.param}_lora_a)"
    if target is None or target.weight != adapter.param or target.kind == "embed":
        what = target.cls if target is not None else "layer"
        problems.append(
            f"{at}: qwix adapted the {adapter.param} of a {what}, which bridge "
            "adapts otherwise or not at all (bridge reads qwix adapters on "
            "Dense/Linear, DenseGeneral/LinearGeneral and Conv kernels)"
        )
        return None
    if adapter.b is None:
        problems.append(f"{at}: no {adapter.param}_lora_b beside it")
        return None
    rank = adapter.a.shape[-1]
    want = target.shapes(rank)
    if (tuple(adapter.a.shape), tuple(adapter.b.shape)) != want:
        problems.append(
            f"{at}: lora_a {tuple(adapter.a.shape)} and lora_b "
            f"{tuple(adapter.b.shape)} do not fit the {target.cls} there, which "
            f"takes {want[0]} and {want[1]} at rank {rank}"
        )
        return None
    if rules is None:
        assert alpha is not None  # from_qwix_lora takes `rules` or `alpha`
        return Settings(rank, float(alpha), False, 0.0)
    op = _OPS[target.kind]
    rule = next(
        (
            r
            for r in rules
            if re.fullmatch(r.module_path, where)
            and (not getattr(r, "op_names", ()) or op in r.op_names)
        ),
        None,
    )
    if rule is None or not hasattr(rule, "alpha"):
        problems.append(
            f"{at}: no LoRA rule matches the path {where!r} ({op}); qwix would not "
            "have adapted it with these rules: pass the rules that did"
        )
        return None
    if rule.rank != rank:
        problems.append(
            f"{at}: the rule matching it (module_path {rule.module_path!r}) has rank "
            f"{rule.rank}, the adapter {rank}: pass the rules that made it"
        )
        return None
    return Settings(rank, float(rule.alpha), False, float(rule.dropout))
