"""A progress display for long loads and saves, on stderr or in a Jupyter notebook:
`bridge convert`'s, and `progress=True`'s of `bridge.load` and every save call (one
implementation).

The readers and writers count the bytes they move with `advance(nbytes)`, once per
array (or block written); without a display listening, that is one context-variable
lookup. A display draws itself only on a terminal (with rich) or in a notebook (an
HTML bar updated in place, no widget library), and only once the operation has
taken `DELAY` seconds: a quick load, a log file or a pipe gets nothing.

    >>> with counting(print):
    ...     advance(48)
    48
    >>> advance(48)  # nobody listens
"""

from __future__ import annotations

import contextlib
import contextvars
import html
import importlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any


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


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (IPython with a kernel attached)."""
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return getattr(shell, "kernel", None) is not None


class Notebook:
    """A progress bar in a Jupyter notebook's output: an HTML `<progress>` shown
    once the operation has taken `DELAY` seconds, updated in place (IPython's
    `display_id`) at most `PER_SECOND` times a second from the thread that counts,
    and marked done at the end."""

    PER_SECOND = 4

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.begun = clock()
        self.handle: Any = None
        self.drawn = 0.0
        self.description, self.total, self.done = "", 0, 0

    def _html(self, finished: bool = False) -> str:
        share = self.done / self.total if self.total else 0.0
        bar = (
            f'<progress value="{self.done}" max="{self.total}" style="width: 24em">'
            "</progress>"
            if self.total
            else "<progress></progress>"
        )
        seconds = self.clock() - self.begun
        state = "done" if finished else f"{share:.0%}" if self.total else ""
        return (
            '<div style="font-family: monospace; font-size: 12px">'
            f"{html.escape(self.description)} {bar} {state} {seconds:.1f} s</div>"
        )

    def _draw(self, finished: bool = False) -> None:
        now = self.clock()
        if self.handle is None and now - self.begun < DELAY and not finished:
            return
        if not finished and now - self.drawn < 1 / self.PER_SECOND:
            return
        shown = importlib.import_module("IPython.display")  # in a notebook only
        HTML, display = shown.HTML, shown.display
        self.drawn = now
        if self.handle is None:
            if finished:
                return  # over before it was shown: nothing to show
            self.handle = display(HTML(self._html()), display_id=True)
        else:
            self.handle.update(HTML(self._html(finished)))

    @contextlib.contextmanager
    def phase(
        self, description: str, total: int | None = None
    ) -> Iterator[Callable[[int], None]]:
        """As `Display.phase`."""
        self.description, self.total, self.done = description, total or 0, 0

        def step(done: int) -> None:
            self.done += done
            self._draw()

        with counting(step):
            yield step
        self._draw(finished=True)

    def __enter__(self) -> Notebook:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@contextlib.contextmanager
def shown(on: bool, description: str, total: int | None = None) -> Iterator[None]:
    """The block as one phase of a display of its own when `on` (`progress=True` of
    `bridge.load` and the save calls): in a notebook its bar, else on stderr; else
    the block as it is."""
    if not on:
        yield
        return
    display = Notebook() if in_notebook() else Display()
    with display, display.phase(description, total):
        yield
