"""Safe class lookup: the class a checkpoint names (`module:qualname`), found only among
modules already imported, reading `__dict__`s (nothing imported, no hook run)."""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from typing import Any


def resolve(name: str) -> type | None:
    """The class named `module:qualname`, found only among modules already imported,
    by their `__dict__` (nothing is imported, no attribute of a module is touched, so
    no module `__getattr__` or property runs); None when there is no such class."""
    module, _, qualname = name.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        namespace = _namespace(obj)
        if namespace is None:
            return None
        obj = namespace.get(part)
    return obj if issubclass(type(obj), type) else None


def _namespace(obj: Any) -> Mapping[str, Any] | None:
    """The `__dict__` of a module or a class, read without calling anything of it."""
    if issubclass(type(obj), type):
        return vars(type)["__dict__"].__get__(obj)
    if issubclass(type(obj), types.ModuleType):
        return vars(types.ModuleType)["__dict__"].__get__(obj)
    return None
