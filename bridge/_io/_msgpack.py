"""A flax msgpack file (`flax.serialization`): nested dicts of arrays, no metadata.

bridge writes it as Linen variables, `{collection: {module: {name: array}}}`, so the
collections keep each array's role and `flax.serialization.from_bytes(variables, ...)`
reads it directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flax import serialization

from ._atomic import atomic_file


def write(path: Path, variables: dict[str, Any]) -> None:
    """Write the nested dict `variables` atomically."""
    data = serialization.msgpack_serialize(variables)
    with atomic_file(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def read(path: Path) -> dict[str, Any]:
    """The nested dict of numpy arrays in the file (msgpack decodes plain data and
    arrays only; nothing in the file is executed)."""
    variables = serialization.msgpack_restore(path.read_bytes())
    if not isinstance(variables, dict):
        raise ValueError(f"holds a {type(variables).__name__}, not a dict of arrays")
    return variables
