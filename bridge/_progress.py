"""A progress display for long loads and saves, on stderr: `bridge convert`'s, and
`bridge.load(..., progress=True)`'s and `bridge.save(..., progress=True)`'s (one
implementation).

The readers and writers count the bytes they move with `advance(nbytes)`, once per
array (or block written); without a display listening, that is one context-variable
lookup. A display draws itself only on a terminal, and only once the operation has
taken `DELAY` seconds: a quick load, a log file or a pipe gets nothing.

    >>> with counting(print):
    ...     advance(48)
    48
    >>> advance(48)  # nobody listens
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from rich.console import Console


DELAY = 1.0  # seconds an operation runs before its display draws itself

_SINK: contextvars.ContextVar[Callable[[int], object] | None] = contextvars.ContextVar(
    "bridge_progress", default=None
)


def advance(nbytes: int) -> None:
    """Count `nbytes` read or written by the operation under way (nothing when no
    display listens)."""
    sink = _SINK.get()
    if sink is not None:
        sink(nbytes)


@contextlib.contextmanager
def counting(sink: Callable[[int], object]) -> Iterator[None]:
    """`sink` called with the bytes of each `advance` in this thread while the block
    runs."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


class Display:
    """A progress display (on stderr, or `console`) that draws itself once an
    operation has taken `DELAY` seconds, on a terminal only: one line per phase with
    a spinner, a bar with the share of bytes done (for a phase given its total) and
    the time taken; gone when the operation ends."""

    def __init__(self, console: Console | None = None):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            SpinnerColumn,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        console = Console(stderr=True) if console is None else console
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            # a redraw costs ~1 ms of Python under the GIL: 4 a second keep a drawn
            # display's cost within the noise of a load (benchmarks/progress.py)
            refresh_per_second=4,
        )
        # on a terminal only: a log or a pipe gets no redrawn lines
        self.terminal = console.is_terminal
        self.timer = threading.Timer(DELAY, self._start if self.terminal else int)
        self.started = False
        self.task = None

    @contextlib.contextmanager
    def phase(
        self, description: str, total: int | None = None
    ) -> Iterator[Callable[[int], None]]:
        """A phase of the operation, of `total` bytes (without it, a pulsing bar):
        what `advance` counts in the block moves its bar, as does calling what it
        yields."""
        if self.task is not None:
            self.progress.update(self.task, total=1, completed=1)
        task = self.task = self.progress.add_task(description, total=total or None)

        def step(done: int) -> None:
            self.progress.advance(task, done)

        with counting(step):
            yield step
        self.progress.update(task, total=1, completed=1)

    def _start(self) -> None:
        from rich.errors import LiveError

        try:
            self.progress.start()
        except LiveError:  # the caller's own rich display is live: it keeps the screen
            return
        self.started = True

    def __enter__(self) -> Display:
        if DELAY <= 0 and self.terminal:
            self._start()  # drawn from the start
        else:
            self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.cancel()
        if self.timer.is_alive():
            self.timer.join()
        if self.started:
            self.progress.stop()


@contextlib.contextmanager
def shown(on: bool, description: str, total: int | None = None) -> Iterator[None]:
    """The block as one phase of a display of its own when `on` (`progress=True` of
    `bridge.load` and `bridge.save`), else as it is."""
    if not on:
        yield
        return
    with Display() as display, display.phase(description, total):
        yield
