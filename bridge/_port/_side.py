"""Step 1 of a port: read each side once.

A `Side` is everything one model says about itself that pairing needs, asked of its
adapter (and of the embedding wrappers it holds) in one place, before any layer is
found: the neutral Tree, the adapter that reads it (the canonical one for a part of
a model), the native modules (settings of each layer), the models of other
frameworks it wraps (`bridge.as_nnx`, `as_linen`, `as_equinox`: each a `Side` of its
own, found here and not re-entered later), the names it holds one array under (a
PyTorch model's ties), the constants its model keeps out of its state, and its
forward pass on the example inputs (`Trace`, made only when a later step asks).
The steps after this one ask the `Side`, never the adapter.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._adapters._native import to_neutral
from .._adapters._registry import Adapter, adapter_named, canonical_adapter
from .._embed._as_linen import hidden_wrappers
from .._embed._inside import embedded
from .._paths import Path, parse
from .._tree import Tree, framework
from ._trace import Example, Trace


@dataclass(eq=False)
class Side:
    """One model of a port, read once.

    - `index`: 0 for the source, 1 for the target (`name` says it in words).
    - `tree`: the model as a `bridge.Tree`.
    - `adapter`: the adapter of its framework; for a part of a model (no
      framework), the canonical one (a part is read in Flax's layout).
    - `whole`: whether `tree` is a whole model (it has a framework).
    - `native`: the native modules by path (`Adapter.modules`), or None.
    - `wrapped`: `{wrapper path: (prefix, Side)}` for each model of another
      framework the model wraps: its leaf `p` is this Tree's `prefix + p`.
    - `ties`: `{leaf path of a tied name: the leaf path the Tree holds it at}`.
    - `tie_records`: the adapter's ties as it gives them, `(name, same as[, why])`.
    - `trace`: the forward pass on the example inputs, or None without them.
    - `auto_named`: the modules whose names the framework made up
      (`Adapter.auto_named`: Keras's `dense_1`), which never pair by name.
    """

    index: int
    tree: Tree
    adapter: Adapter
    whole: bool
    native: Any = None
    wrapped: dict[Path, tuple[Path, Side]] = field(default_factory=dict)
    ties: dict[Path, Path] = field(default_factory=dict)
    tie_records: tuple[tuple[str, ...], ...] = ()
    trace: Trace | None = None
    auto_named: frozenset[Path] = frozenset()

    @functools.cached_property
    def constants(self) -> Mapping[Path, Any]:
        """`{path: value}` of what its model keeps out of its state (PyTorch's
        non-persistent buffers: `Adapter.constants`), read when first asked (their
        values are copied)."""
        hook = self.adapter.constants
        return hook(self.tree) if self.whole and hook is not None else {}

    @property
    def name(self) -> str:
        return ("source", "target")[self.index]

    @property
    def framework(self) -> str | None:
        """The framework's name, or None for a part of a model."""
        return self.adapter.name if self.whole else None

    def own_trace(self) -> bool:
        """Whether the side is traced by its adapter's own recorder (a framework JAX
        does not trace: PyTorch), the only trace that can show ties the Tree does
        not hold (a folder's model holds a tied array under every name)."""
        return self.whole and self.adapter.trace is not None

    def hidden_wrappers(self) -> str | None:
        """How to let a Linen model's wrappers be found (see `_embed`), or None;
        asked only when a port is refused with loose arrays left."""
        return hidden_wrappers(self.tree)


def read_side(
    model: Any,
    index: int,
    problems: list[str],
    example: Example | None = None,
    recorded: Mapping[Path, tuple[int, ...]] | None = None,
) -> Side:
    """The `Side` of `model` (any form `bridge.to_neutral` takes, or a Tree), with
    its forward pass on `example` (the order of use a file `recorded` standing for
    it); a failing pass is a problem in `problems` when a step first asks for it."""
    tree = model if isinstance(model, Tree) else to_neutral(model)
    name = framework(tree)
    whole = name is not None
    adapter = adapter_named(name) if whole else canonical_adapter()
    native = None if adapter.modules is None else adapter.modules(tree)
    wrapped = {
        path: (prefix, read_side(inner, index, problems))
        for path, (prefix, inner) in embedded(tree, native).items()
    }
    records = adapter.ties(tree) if whole and adapter.ties is not None else ()
    ties = {parse(t[0]): parse(t[1]) for t in records if t[1]}
    trace = None if example is None else Trace(tree, example, index, problems, recorded)
    auto = adapter.auto_named(tree) if whole and adapter.auto_named else frozenset()
    return Side(
        index, tree, adapter, whole, native, wrapped, ties, records, trace, auto
    )
