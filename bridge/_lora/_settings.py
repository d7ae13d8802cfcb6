"""What a LoRA adapter is: its settings, and the layers that can hold one.

An adapter on a layer is two arrays under the layer, `lora_a` and `lora_b`, whose
product has the shape of the layer's weight. `lora_a` maps the layer's inputs to
`rank` features, `lora_b` maps them to the layer's outputs; the layer computes
`x W + scaling (x A) B`, as PEFT's `lora.Linear` does.

Each framework stores the pair in its own orientation, the one of its weights:

- `"flax"` (Linen, NNX): `lora_a (fan_in, rank)`, `lora_b (rank, fan_out)`, as
  `nnx.LoRA`; a convolution's `lora_a` is a kernel `(*window, in, rank)`.
- `"peft"` (Equinox, PyTorch layout): `lora_a (rank, fan_in)`, `lora_b (fan_out,
  rank)`, as PEFT's `lora_A.weight` and `lora_B.weight`; a convolution's `lora_a` is
  `(rank, in, *window)`.
- `"conv1d"` (PyTorch layout, Hugging Face's `Conv1D`, weight `(in, out)`): the
  adapter as `"peft"`; only `A B` is transposed to fit the weight.

Per-head kernels (`DenseGeneral`, `LinearGeneral`) take one adapter over their
flattened feature axes; a stack of layers (`nn.scan`, `nnx.vmap`,
`eqx.filter_vmap`) takes one adapter per layer, stacked on the same leading axes.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from .._paths import Path, path_str


A, B = "lora_a", "lora_b"
"""The names of the two adapter arrays under their layer."""


class Settings(NamedTuple):
    """One layer's LoRA settings (static: they are not trained).

    **Fields:**

    - `rank`: the adapter's inner dimension `r`.
    - `alpha`: PEFT's `lora_alpha`; the adapter's output is scaled by
      `alpha / rank` (`alpha / sqrt(rank)` with `rslora`).
    - `rslora`: PEFT's `use_rslora`.
    - `dropout`: PEFT's `lora_dropout`, the rate of dropout on the adapter's input
      in training.
    """

    rank: int
    alpha: float
    rslora: bool = False
    dropout: float = 0.0

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class Target(NamedTuple):
    """A layer that can hold an adapter, as a framework's `targets` finds it.

    **Fields:**

    - `path`: the layer's node in the Tree.
    - `kind`: `"linear"` (dense and per-head kernels), `"conv"` or `"embed"`.
    - `weight`: the name of the adapted array under the layer (`"kernel"`,
      `"weight"`, `"embedding"`).
    - `layout`: `"flax"`, `"peft"` or `"conv1d"` (module docstring).
    - `stack`: the leading axes of a stack of layers (`()` for one layer).
    - `fan_in`: the dimensions `lora_a` maps from, without `rank`: `(in,)` for a
      dense layer, its flattened input features for a per-head kernel, the window
      and input channels of a convolution (`(*window, in)` in the `"flax"` layout,
      `(in, *window)` in `"peft"`), the vocabulary for an embedding.
    - `fan_out`: the number of output features (flattened).
    - `cls`: the layer's class name, for messages.
    - `settings`: the adapter's settings when the layer holds one, else None.
    """

    path: Path
    kind: str
    weight: str
    layout: str
    stack: tuple[int, ...]
    fan_in: tuple[int, ...]
    fan_out: int
    cls: str
    settings: Settings | None = None

    @property
    def where(self) -> str:
        return path_str(self.path) or "(root)"

    def shapes(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of `lora_a` and `lora_b` for `rank`."""
        if self.layout == "flax":
            return (
                self.stack + self.fan_in + (rank,),
                self.stack + (rank, self.fan_out),
            )
        return self.stack + (rank,) + self.fan_in, self.stack + (self.fan_out, rank)

    def limit(self) -> int:
        """The largest rank that means anything: the smaller side of the weight."""
        return min(math.prod(self.fan_in), self.fan_out)


class Injection(NamedTuple):
    """One adapter to put on a layer: its arrays in the target's layout and shapes,
    its settings, and a random key for its dropout."""

    target: Target
    a: Any
    b: Any
    settings: Settings
    key: Any


class Frame(NamedTuple):
    """How LoRA works with one framework's models.

    **Fields:**

    - `targets`: `targets(tree) -> [Target, ...]`: every layer that can hold an
      adapter, with the settings of those that hold one.
    - `inject`: `inject(tree, [Injection, ...]) -> Tree`: the model with those
      adapters (replacing any the layers hold), whose native model runs them.
    - `strip`: `strip(tree, weights) -> Tree`: the plain model without adapters,
      the weights `{layer path: array}` replacing the adapted ones.
    - `native`: `native(model, tree) -> model`: `tree` in the form `model` was
      given in, with the native model the Tree holds (Linen: its module, whose
      class runs the adapters).
    - `carried`: whether `bridge.port` into a model of this framework carries the
      source's adapters (a PyTorch-layout target does not: its state dict would
      no longer load into the plain PyTorch model; `merge_lora` or `save_peft`).
    - `qwix`: optional, `qwix(tree) -> (tree, [QwixAdapter, ...])`: the model
      without qwix's LoRA parameters (`<param>_lora_a`, `<param>_lora_b`) nor its
      interception, and those parameters (`bridge.from_qwix_lora`).
    """

    targets: Callable[[Any], list[Target]]
    inject: Callable[[Any, list[Injection]], Any]
    strip: Callable[[Any, dict[Path, Any]], Any]
    native: Callable[[Any, Any], Any]
    carried: bool = True
    qwix: Callable[[Any], tuple[Any, list[QwixAdapter]]] | None = None


class QwixAdapter(NamedTuple):
    """One layer's qwix LoRA parameters: the layer's path, the adapted parameter's
    name (`"kernel"`), and `<param>_lora_a`, `<param>_lora_b` (None when missing)."""

    path: Path
    param: str
    a: Any
    b: Any


_FRAMES: dict[str, Frame] = {}
_LOCK = threading.Lock()


def register_frame(framework: str, frame: Frame) -> Frame:
    """Register the LoRA support of framework `framework` (once)."""
    with _LOCK:
        if framework in _FRAMES:
            raise ValueError(f"LoRA support for {framework!r} is registered already.")
        _FRAMES[framework] = frame
    return frame


_NO_FRAME = """\
LoRA is not supported for {framework} models; it is for Flax Linen, Flax NNX, \
Equinox and PyTorch-layout models. Port the model to one of them first (bridge.port)."""


def frame_of(framework: str | None) -> Frame:
    """The LoRA support of a framework (`ValueError` when it has none)."""
    frame = _FRAMES.get(framework or "")
    if frame is None:
        raise ValueError(_NO_FRAME.format(framework=framework or "partial-Tree"))
    return frame
