"""The clash of names with Flax's `flax.nnx.bridge` (Flax's Linen <-> NNX guide writes
`from flax.nnx import bridge`): whichever of the two is bound to `bridge` last hides
the other, and the next `bridge.<name>` of the hidden one raises a bare
`AttributeError`. Both errors are made to say what happened and the two-line fix.

Nothing here imports Flax: Flax's module is given a module `__getattr__` (consulted
only for a name it lacks) when it is already imported, else when it gets imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


FLAX = "flax.nnx.bridge"
HERE = str(Path(__file__).resolve().parent)

# names of flax.nnx.bridge (flax 0.12), for a clash seen before Flax is imported
_FLAX_NAMES = {
    "ToNNX",
    "ToLinen",
    "to_linen",
    "lazy_init",
    "Module",
    "Scope",
    "compact",
    "NNXMeta",
    "with_partitioning",
    "current_context",
    "current_module",
    "variables",
    "wrappers",
    "interop",
}

FIX = (
    "Import Flax's under another name: `from flax.nnx import bridge as nnx_bridge` "
    "(then `import bridge` is this package)."
)


def missing(name: str) -> str:
    """The message of an `AttributeError` for `bridge.<name>` on this package."""
    text = f"module 'bridge' has no attribute {name!r}"
    flax = sys.modules.get(FLAX)
    if name in _FLAX_NAMES or (flax is not None and name in vars(flax)):
        text += (
            f". This `bridge` is the bridge package ({HERE}), not Flax's "
            f"{FLAX}, which has {name!r}: an `import bridge` after `from flax.nnx "
            f"import bridge` replaced the name. {FIX}"
        )
    return text


def _ours() -> set[str]:
    here = sys.modules.get("bridge")
    return set(getattr(here, "_PUBLIC", ())) if here is not None else set()


def _guard(module: ModuleType) -> None:
    """Give Flax's module a `__getattr__` naming this package for its names."""
    if getattr(module, "__getattr__", None) is not None:
        return  # Flax's own, or ours already

    def __getattr__(name: str) -> Any:
        text = f"module {FLAX!r} has no attribute {name!r}"
        if name in _ours():
            text += (
                f". `bridge.{name}` is a name of the bridge package ({HERE}), but "
                f"this `bridge` is Flax's {FLAX}: a `from flax.nnx import bridge` "
                f"after `import bridge` replaced the name. {FIX}"
            )
        raise AttributeError(text)

    module.__getattr__ = __getattr__  # type: ignore[attr-defined]


class _Finder(importlib.abc.MetaPathFinder):
    """Guards Flax's module once it is imported (after this package)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != FLAX:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _guard(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def watch() -> None:
    """Guard Flax's module now if it is imported, else when it is."""
    module = sys.modules.get(FLAX)
    if module is not None:
        _guard(module)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
