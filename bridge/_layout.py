"""`bridge convert --to-layout`: a checkpoint's arrays in another framework's layout,
through the port codecs, without the model.

An Equinox checkpoint records each module's class and settings, so each layer a codec
recognises is decoded to the canonical layout, which is Flax's (Dense kernel
`(in, out)`, HWIO convolutions, BatchNorm `mean`/`var` as `batch_stats`). The other
direction needs the Equinox model's structure (which State entries, which biases), so
it is `bridge.load(path, like=equinox_model)` in Python.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._checkpoint import VERSION, Contents, Stored, dotted, file_tree
from ._port._errors import PortError
from ._port._layers import find_layers
from ._tree import Path


LAYOUTS = ("flax", "equinox")
_STATISTICS = ("mean", "var")  # the canonical BatchNorm entries: role batch_stats

_TO_EQUINOX = """\
{path} is in the {layout} layout; converting it to the Equinox layout needs the
Equinox model (which layers have biases, where BatchNorm keeps its State). Load it
into the model in Python: bridge.save(dst, bridge.load(src, like=equinox_model))."""


def relayout(
    contents: Contents, arrays: dict[str, Any], layout: str
) -> tuple[Contents, dict[str, Any]]:
    """The checkpoint's `contents` and `arrays` (by dotted name) in `layout`.

    **Arguments:**

    - `contents`, `arrays`: a checkpoint, from `open_checkpoint` and `read`.
    - `layout`: `"flax"` or `"equinox"`.

    **Returns:**

    New `(contents, arrays)`: unchanged when the file is in `layout` already.

    **Raises:**

    `PortError` listing the arrays under no layer a codec knows; `ValueError` for a
    conversion to the Equinox layout from another.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown layout {layout!r}: choose one of {LAYOUTS}.")
    if contents.layout == layout:
        return contents, arrays
    if layout == "equinox":
        raise ValueError(
            _TO_EQUINOX.format(path=contents.path, layout=contents.layout or "Flax")
        )
    tree = file_tree(contents, arrays)
    problems: list[str] = []
    layers = find_layers(tree, problems)
    if problems:
        raise PortError(problems)
    stored = {s.path: s for s in contents.tensors}
    tensors: list[Stored] = []
    out: dict[str, Any] = {}

    def add(path: Path, role: str, array: Any) -> None:
        name = dotted(path)
        out[name] = array
        tensors.append(Stored(name, path, role, np.shape(array), str(array.dtype)))

    for layer in layers:
        canonical = layer.codecs[0].decode(layer.leaves, layer.hyper)
        for name, array in canonical.items():
            role = "batch_stats" if name in _STATISTICS else "params"
            keys = tuple(int(k) if k.isdigit() else k for k in name.split("/"))
            add(layer.path + keys, role, array)
        for relative in layer.paths.values():
            stored.pop(layer.path + relative)
    for s in stored.values():  # what no layer holds (RNG state): as it is
        tensors.append(s)
        out[s.key] = arrays[s.key]
    converted = Contents(
        contents.path,
        contents.format,
        None,
        "flax",
        VERSION,
        (),
        contents.metadata,
        tuple(tensors),
    )
    return converted, out
