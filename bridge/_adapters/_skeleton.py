"""Equinox models read back from a checkpoint without the model: skeletons.

An Equinox checkpoint records, for each module, its class and its plain settings
(`in_features`, `kernel_size`, `num_heads`, `eps`, ...). Reading the file back without
`like` cannot construct the classes (that would run code), so each module becomes a
`Skeleton`: an inert pytree node holding the module's arrays and settings as
attributes. That is what `bridge.port` needs to read layer settings from a file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.tree_util as jtu

from .._paths import Path
from .._shown import some


Plain = None | bool | int | float | str | tuple


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (tuple, list)) and all(map(_plain, value))


def settings(module: Any) -> dict[str, Plain]:
    """The plain (JSON-able) non-array fields of an Equinox module or a Skeleton."""
    if isinstance(module, Skeleton):
        return dict(module._settings)
    if not dataclasses.is_dataclass(module):
        return {}
    out = {}
    for f in dataclasses.fields(module):
        value = getattr(module, f.name, None)
        if _plain(value):
            out[f.name] = value
    return out


def _tuples(value: Any) -> Any:
    """JSON lists back to tuples (Equinox settings are tuples)."""
    return tuple(map(_tuples, value)) if isinstance(value, list) else value


_INERT = """\
This is a skeleton of {cls}, read from a checkpoint without `like`: it holds the arrays
and settings, not the model's code. Load into a model instead:
bridge.load(path, like=model)."""


class MissingSetting(AttributeError):
    """A setting a layer's codec reads that the checkpoint did not record for the
    class it names (metadata naming another class than its arrays and settings)."""

    def __init__(self, cls: str, name: str, found: str):
        self.cls, self.name, self.found = cls, name, found
        super().__init__(f"The skeleton of {cls} has no {name!r} ({found}).")


class Skeleton:
    """A module of a checkpoint: its arrays (children) and settings as attributes."""

    __slots__ = ("_cls", "_children", "_settings")

    def __init__(self, cls: str, children: dict[str, Any], settings: tuple):
        object.__setattr__(self, "_cls", cls)
        object.__setattr__(self, "_children", children)
        object.__setattr__(self, "_settings", settings)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self._children:
            return self._children[name]
        for key, value in self._settings:
            if key == name:
                return value
        settings = some((k for k, _ in self._settings), most=8) or "none"
        arrays = some(self._children, most=8) or "none"
        found = f"recorded settings: {settings}; arrays: {arrays}"
        raise MissingSetting(self._cls, name, found)

    def __getitem__(self, key: Any) -> Any:
        # a module whose fields are numbers (PyTorch's `nn.Sequential` names, not
        # `0..n-1`: `0`, `2`), reached by index as `bridge._paths.child` does
        try:
            return self._children[str(key)]
        except KeyError:
            raise KeyError(f"The skeleton of {self._cls} has no {key!r}.") from None

    def __call__(self, *args, **kwargs):
        raise TypeError(_INERT.format(cls=self._cls))

    def __repr__(self) -> str:
        return f"Skeleton({self._cls}, {', '.join(self._children)})"


def _flatten(s: Skeleton):
    keys = tuple(s._children)
    children = tuple((jtu.GetAttrKey(k), s._children[k]) for k in keys)
    return children, (s._cls, keys, s._settings)


def _unflatten(aux, children) -> Skeleton:
    cls, keys, settings = aux
    return Skeleton(cls, dict(zip(keys, children)), settings)


jtu.register_pytree_with_keys(
    Skeleton,
    _flatten,
    _unflatten,
    lambda s: (tuple(s._children.values()), (s._cls, tuple(s._children), s._settings)),
)


class _Slot:
    __slots__ = ("path",)

    def __init__(self, path: Path):
        self.path = path


def skeleton(
    paths: Sequence[Path], modules: dict[Path, tuple[str, dict[str, Any]]]
) -> tuple[Any, dict[Path, int]]:
    """The treedef of a skeleton model with a leaf at each of `paths`, and each
    path's position among its leaves. `modules[path]` is `(class name, settings)`; nodes
    whose keys are `0..n-1` become tuples (like Equinox's `Sequential`, `MLP`)."""
    root: dict = {}
    for path in paths:
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = None

    def make(node: Any, prefix: Path) -> Any:
        if not isinstance(node, dict):
            return _Slot(prefix)
        children = {k: make(v, prefix + (k,)) for k, v in node.items()}
        if list(children) == list(range(len(children))):
            return tuple(children.values())
        cls, fields = modules.get(prefix, ("a module", {}))
        frozen = tuple(sorted((k, _tuples(v)) for k, v in fields.items()))
        return Skeleton(cls, {str(k): v for k, v in children.items()}, frozen)

    model = make(root, ())
    slots = jtu.tree_leaves(model)
    return jtu.tree_structure(model), {slot.path: i for i, slot in enumerate(slots)}
