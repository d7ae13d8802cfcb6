"""What `port` carries past the pairing: weights of a kind that a layer above port
knows (LoRA adapters), set aside from the source before the plan and put back on
the ported model after it.

A `Carrier` is two pure functions, registered once by the module that knows the
kind (`bridge._lora._port`): port itself never imports the layers above it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


class Carrier(NamedTuple):
    """**Fields:**

    - `split`: `split(model) -> (plain model, carried)`: the model without what
      this carrier carries, and that (None: nothing to carry; the model as it is).
    - `join`: `join(carried, steps, ported) -> ported`: the ported model with what
      was carried put on the layers the plan's `steps` paired its layers with.
    """

    split: Callable[[Any], tuple[Any, Any]]
    join: Callable[[Any, Sequence[Any], Any], Any]


_CARRIERS: list[Carrier] = []
_LOCK = threading.Lock()


def register_carrier(carrier: Carrier) -> Carrier:
    """Register a carrier (once)."""
    with _LOCK:
        if carrier in _CARRIERS:
            raise ValueError("This carrier is registered already.")
        _CARRIERS.append(carrier)
    return carrier


def split(model: Any) -> tuple[Any, list[tuple[Carrier, Any]]]:
    """`model` without what any carrier carries, and each carrier's part."""
    carried = []
    for carrier in tuple(_CARRIERS):
        model, part = carrier.split(model)
        if part is not None:
            carried.append((carrier, part))
    return model, carried


def join(carried: list[tuple[Carrier, Any]], steps: Sequence[Any], ported: Any) -> Any:
    """`ported` with every carried part put back."""
    for carrier, part in carried:
        ported = carrier.join(part, steps, ported)
    return ported
