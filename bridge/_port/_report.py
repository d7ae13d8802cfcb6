"""`Report`: what a non-strict `bridge.port` or `bridge.load` left as it was, told
as Hugging Face's `from_pretrained` tells it ("Some weights of ... were not used",
"... newly initialized ... You should probably TRAIN this model") and returned as
data (`report=True`, as `output_loading_info=True`). One code path for both."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._display._plan import report_html, report_treescope


LOG = logging.getLogger("bridge")
_PACKAGE = str(Path(__file__).resolve().parent.parent) + os.sep


@dataclass(frozen=True)
class Report:
    """What a port (or a load through one) left as it was: the form of Hugging Face's
    `output_loading_info=True` (`missing_keys`, `unexpected_keys`,
    `mismatched_keys`), by layer path. Returned by `bridge.port(..., report=True)`
    and `bridge.load(..., report=True)`; with `strict=True` (the default) every
    field is empty, since each of these is an error.

    **Attributes:**

    - `missing`: the target's layers no source layer fills; they keep the target's
      values (train them).
    - `unexpected`: the source's layers that go nowhere; left out.
    - `mismatched`: paired layers whose shapes differ (`".head -> .classifier
      (Dense): kernel (8, 10) in the source, (8, 5) in the target"`); the target
      keeps its values there (a new head).
    - `dropped`: the source's layers a rule `{pattern: None}` left out on purpose.
    - `computed_by_target`: the source's layers that hold what the target computes
      from its config (a stored sinusoidal position table, rotary inverse
      frequencies, position ids, a causal mask; it has no array for it): left out.
    - `computed_by_source`: the target's layers that hold such an array, which the
      source computes: they keep their values. Both are recognised by their values
      (a learned array is `unexpected` or `missing`) and leave the port
      `complete`.
    - `tied`: arrays held once under several names and how they were filled, as
      `port_plan` lists them (`".model.embed_tokens.weight -> .model.embed_tokens,
      .lm_head (config.json: tie_word_embeddings true, and no lm_head.weight in
      the files)"`: a folder's head filled from its embedding).
    - `source`, `target`: what was ported into what, as the messages name them
      (`"the checkpoint at bert/"`, `"Classifier"`).

    `str(report)` is the text logged (logger `"bridge"`, level WARNING) when the
    port ends; `report.complete` is True when every target layer was filled and
    every source layer used.

    **Example:**

    ```python
    >>> import bridge
    >>> from flax import nnx
    >>> source = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> target = nnx.Linear(2, 5, rngs=nnx.Rngs(1))  # a new head of 5 outputs
    >>> model, report = bridge.port(source, target, strict=False, report=True)
    >>> report.complete, report.mismatched[0].split(";")[0]
    (False, '(root) -> (root) (Dense): bias (3,) in the source, (5,) in the target')
    >>> print(str(report).splitlines()[-1])
    You should probably TRAIN this model.

    ```
    """

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    source: str = "the source"
    target: str = "the target"
    computed_by_target: tuple[str, ...] = ()
    computed_by_source: tuple[str, ...] = ()
    tied: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def paragraphs(self) -> list[str]:
        """The warnings, one paragraph per kind of layer left as it was."""
        said = []
        if self.unexpected:
            said.append(
                f"Some weights of {self.source} were not used when initializing "
                f"{self.target}: {list(self.unexpected)}"
            )
        if self.missing:
            said.append(
                f"Some weights of {self.target} were not initialized from "
                f"{self.source} and keep their values: {list(self.missing)}\n"
                "You should probably TRAIN this model."
            )
        if self.mismatched:
            said.append(
                f"Some weights of {self.target} were not initialized from "
                f"{self.source} and keep their values because the shapes did not "
                "match:\n- " + "\n- ".join(self.mismatched) + "\nYou should "
                "probably TRAIN this model."
            )
        return said

    def notes(self) -> list[str]:
        """What was left out or kept on purpose, one line each: by rules, and the
        stored position tables one side computes; and the ties."""
        said = []
        if self.dropped:
            said.append(f"Left out by rules: {list(self.dropped)}")
        if self.computed_by_target:
            said.append(
                "Computed by the target (stored sinusoidal position tables, left "
                f"out): {list(self.computed_by_target)}"
            )
        if self.computed_by_source:
            said.append(
                "Computed by the source (stored sinusoidal position tables, kept "
                f"as they are): {list(self.computed_by_source)}"
            )
        if self.tied:
            said.append(f"Tied (stored once): {list(self.tied)}")
        return said

    def __str__(self) -> str:
        said = self.paragraphs() + self.notes()
        if not self.paragraphs() and len(said) == bool(self.tied):  # ties alone
            said.insert(0, f"{self.target} was filled entirely from {self.source}.")
        return "\n".join(said)

    _repr_html_ = report_html
    __treescope_repr__ = report_treescope

    def log(self) -> None:
        """Log it (logger `"bridge"`): the warnings (WARNING), and what was left
        out or kept on purpose (INFO)."""
        for paragraph in self.paragraphs():
            LOG.warning("%s", paragraph)
        for note in self.notes():
            LOG.info("%s", note)


def report(plan: Any, source: str, target: Any) -> Report:
    """The report of a port that ran `plan`, logged; `target`: the model filled
    (its class names it)."""
    made = Report(
        missing=tuple(plan.missing),
        unexpected=tuple(plan.unexpected),
        mismatched=tuple(plan.mismatched),
        dropped=tuple(plan.dropped),
        computed_by_target=tuple(plan.computed_by_target),
        computed_by_source=tuple(plan.computed_by_source),
        tied=tuple(plan.tied),
        source=source,
        target=name(target),
    )
    made.log()
    return made


def name(model: Any) -> str:
    """How a report names a model: its class (`(model, state)`: the model's)."""
    if isinstance(model, tuple) and model and not isinstance(model[0], dict):
        model = model[0]
    return type(model).__name__


def warn(message: str, category: type[Warning]) -> None:
    """`warnings.warn`, pointing at the first line outside this package: the
    caller's (`bridge.load` inside `bridge.port` points at the user's `load`)."""
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
