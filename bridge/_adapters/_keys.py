"""`Keys`: the random keys a wrapper's caller has, in the forms frameworks take them.

Each outer framework gives keys its own way (NNX: an `nnx.Rngs`; Linen: `make_rng`
streams; Equinox: one `key=`); each wrapped framework takes them its own way (an
Equinox model: one key; an NNX module: a key per named stream, to reseed it; a
Linen module: every stream at once, to bind). A wrapper fills a `Keys`, the wrapped
framework's adapter (`Adapter.embed`) draws from it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


def _none(*_: Any) -> None:
    return None


class Keys(NamedTuple):
    """Functions that draw keys only when called (so no stream advances for a model
    that takes none); each gives None when the caller has no such key.

    - `one() -> key`: the key of a model that takes one (`key=`, Equinox).
    - `stream(name) -> key`: a key for the stream `name` (an NNX module's
      `RngStream` of that tag).
    - `every() -> {name: key} | key`: every stream at once, as Linen's
      `module.apply(rngs=...)` takes them (one key: the `params` stream)."""

    one: Callable[[], Any] = _none
    stream: Callable[[str], Any] = _none
    every: Callable[[], Any] = _none


def same_key(key: Any) -> Keys:
    """One key given for everything (`bridge.as_equinox`'s `key=`)."""
    if key is None:
        return Keys()
    return Keys(lambda: key, lambda _: key, lambda: key)
