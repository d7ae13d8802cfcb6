"""How much work building a model from a downloaded `config.json` may take.

A folder's `config.json` is hostile input: 200 bytes naming `"depths": [10**9]`
made transformers' Swin loop a billion times before it registered a single
parameter, ConvNext `depths: [10**8]` took 40 s and 4.5 GB, a Qwen2 of `10**8`
layers never finished its config. The work is bounded three ways, whatever the
config calls its sizes:

- before anything is built (`declared`): a layer count under a known name above
  the folder's number of tensors (a layer holds at least one), or a list of
  integers summing to more than `MOST_LISTED` (models loop over such lists:
  `sum(config.depths)` blocks; the largest legitimate sum seen, Whisper's
  `suppress_tokens`, is 1.1 million) or a count the config expands into as many
  entries (`num_labels`: `id2label`);
- while it is built (`Bounds`): each module, parameter and buffer registered and
  each torch function called is a step, at most `MOST_STEPS` plus `PER_TENSOR`
  per tensor of the folder (full-size models take at most 6.2 a tensor: T5,
  Whisper, ViT, BERT); a tensor made in memory (not on the `meta` device: Swin's
  drop-path rates, `torch.linspace(..., sum(depths), device="cpu")`), or a list
  made from a tensor (BiT's `x.tolist()`), is refused before it is made when it
  would hold more than `MOST_ELEMENTS` (or `PER_TENSOR` a tensor of the folder)
  elements (the largest seen: 36); a build that has computed for `MOST_SECONDS`
  (and 10 ms a tensor; its thread's CPU time, which a busy machine does not
  inflate) is stopped at its next step, or 2 s later wherever it is (full-size
  models build in 0.02-0.45 s, the library's modules imported before).

Each refusal is a `TooBig` naming what was declared or done.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from .._shown import shown


LAYER_COUNTS = frozenset(
    {
        "num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers",
        "decoder_layers", "num_decoder_layers", "num_encoder_layers",
    }
)  # fmt: skip
"""Fields that count layers (transformers lists each one's type in its config)."""
EXPANDED = frozenset({"num_labels"})
"""Fields a config expands into that many entries (`id2label`), as a list."""
MOST_STEPS = 10_000
"""Without the folder's tensor names, the most layers a config may declare and the
most steps its build may take; with them, the steps beyond `PER_TENSOR` each."""
PER_TENSOR = 16
MOST_LISTED = 1 << 22
MOST_ELEMENTS = 1 << 16
MOST_SECONDS = 5.0


_UNPACKED = frozenset({"tolist", "__iter__", "unbind"})
"""Tensor methods that make a Python object per value or row."""


class TooBig(Exception):
    """A config declaring far more than its folder holds, or a build doing so."""


def declared(raw: Any, tensors: int | None) -> str | None:
    """What in `raw` (or its nested configs and lists) declares more than a folder
    of `tensors` tensors holds (see the module docstring), shown shortly; None
    when nothing does."""
    most = tensors if tensors is not None else MOST_STEPS
    todo = [("", raw)]
    while todo:
        key, node = todo.pop()
        if isinstance(node, Mapping):
            todo += [(str(k), v) for k, v in node.items()]
        elif isinstance(node, list | tuple):
            total = _listed(node)
            if total > MOST_LISTED:
                return f"{shown(key)} summing to {total}"
            todo += [(key, v) for v in node if isinstance(v, Mapping)]
        elif key in LAYER_COUNTS and _integer(node) and node > most:
            return f"{key} {node}"
        elif key in EXPANDED and _integer(node) and node > MOST_LISTED:
            return f"{key} {node}"
    return None


def _integer(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _listed(items: list | tuple) -> int:
    """The sum of the integers in a list and in the lists inside it."""
    total, todo = 0, [items]
    while todo:
        for x in todo.pop():
            if _integer(x):
                total += abs(x)
            elif isinstance(x, list | tuple):
                todo.append(x)
    return total


class Bounds:
    """The work one build from a config may do, for a folder of `tensors` tensors
    (None: not known): `counting` its steps and the tensors it makes in memory,
    `stopping` it at the deadline (see the module docstring).

    Enter `counting` before the `meta` device's context (so that the tensors made
    with no `device` are seen on it) and `stopping` around the construction alone,
    inside every other context (so that they are left as they were entered)."""

    def __init__(self, tensors: int | None):
        self.steps = MOST_STEPS + PER_TENSOR * (tensors or 0)
        self.elements = max(MOST_ELEMENTS, PER_TENSOR * (tensors or 0))
        self.seconds = MOST_SECONDS + (tensors or 0) / 100
        self.started = time.thread_time()
        self.taken = 0

    def step(self, *_: Any) -> None:
        """One module, parameter or buffer registered, or one torch function."""
        self.taken += 1
        if self.taken > self.steps:
            raise TooBig(
                f"a model of more than {self.steps} modules, parameters, buffers "
                "and operations"
            )
        if time.thread_time() - self.started > self.seconds:
            raise TooBig(self.late())

    def late(self) -> str:
        return f"a model still being built after {self.seconds:g} s of computing"

    def made(self, torch: Any, func: Any, args: tuple, kwargs: dict) -> None:
        """Refuse `func` making a tensor of more than `elements` in memory (it is
        made on the `meta` device first, its size read there), or as many Python
        objects from one (`tolist`, iterating: one wrapper per row even for a
        fake tensor)."""
        name = getattr(func, "__name__", "")
        if name in _UNPACKED and args and isinstance(args[0], torch.Tensor):
            t = args[0]
            size = t.numel() if name == "tolist" else (t.shape or (0,))[0]
            if size > self.elements:
                raise TooBig(f"a list of {size} values made from a tensor")
        device = kwargs.get("device")
        if device is None or torch.device(device).type == "meta":
            return
        try:
            probe = func(*args, **{**kwargs, "device": "meta"})
        except Exception:  # not a factory of tensors: made as it is
            return
        size = probe.numel() if isinstance(probe, torch.Tensor) else 0
        if size > self.elements:
            raise TooBig(f"a tensor of {size} elements made in memory")

    @contextlib.contextmanager
    def counting(self, torch: Any) -> Iterator[None]:
        """Each registration (global module hooks) and each torch function (a
        `TorchFunctionMode`) a `step`; each tensor made in memory `made`. The
        steps (and the time) are counted from 0 at each entry (a build tried
        again elsewhere)."""
        bounds = self
        self.taken, self.started = 0, time.thread_time()

        class Steps(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                bounds.step()
                bounds.made(torch, func, args, kwargs)
                return func(*args, **kwargs)

        hooks = torch.nn.modules.module
        handles = [
            hooks.register_module_module_registration_hook(self.step),
            hooks.register_module_parameter_registration_hook(self.step),
            hooks.register_module_buffer_registration_hook(self.step),
        ]
        try:
            with Steps():
                yield
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def stopping(self) -> Iterator[None]:
        """`TooBig` raised in this thread if the block still runs 2 s past the
        deadline: a loop of Python alone (Swin's drop-path rates, a list of
        `sum(depths)` floats) makes no step. The exception is delivered between
        two of the thread's bytecodes (CPython's `PyThreadState_SetAsyncExc`);
        one not yet delivered when the block ends is withdrawn. The time is the
        thread's own (CPU time, where the system tells another thread's: a busy
        machine does not stop a build), counted from the block's start."""
        thread = threading.get_ident()
        clock = _cpu_clock(thread) or time.monotonic  # else the wall's time
        began = clock()

        def spent() -> float:
            return clock() - began

        lock = threading.Lock()
        done = threading.Event()
        fired = False

        def watch() -> None:
            nonlocal fired
            while not done.wait(max(0.05, self.seconds + 2 - spent())):
                with lock:
                    if done.is_set():
                        return
                    if spent() > self.seconds + 2:
                        _raise_in(thread, _Late)
                        fired = True
                        return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            yield
        except _Late:
            raise TooBig(self.late()) from None
        finally:
            with lock:
                done.set()
                if fired:
                    _raise_in(thread, None)


def _cpu_clock(thread: int) -> Any:
    """A function giving the CPU time `thread` has spent (seconds), read from any
    thread (Linux's `pthread_getcpuclockid`); None where there is no such clock."""
    try:
        clock = time.pthread_getcpuclockid(thread)
        time.clock_gettime(clock)
    except (AttributeError, OSError, OverflowError):
        return None
    return lambda: time.clock_gettime(clock)


class _Late(TooBig):
    """Raised into a build's thread at its deadline (`Bounds.stopping`)."""

    def __str__(self) -> str:
        return "a model still being built past its deadline"


def _raise_in(thread: int, exc: type | None) -> None:
    """Raise `exc` in `thread` at its next bytecode; None: withdraw a pending one."""
    import ctypes

    pending = ctypes.py_object(exc) if exc is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), pending)
