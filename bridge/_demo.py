"""`bridge demo`: the main job end to end, on a small model and a generated task.

Build a model in Flax NNX, freeze everything but its head the Equinox way
(`bridge.trainable` + `bridge.make_step`), train it, port it to Equinox and to Linen,
check that all three give the same outputs (`bridge.compare`), save a checkpoint and
load it back into Equinox, and print a summary.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ._adapters._native import to_native, to_neutral
from ._adapters._registry import require
from ._io._checkpoint import load, save
from ._port._compare import compare
from ._port._port import port
from ._train._step import make_step
from ._train._trainable import trainable


D_IN, WIDTH, D_OUT = 8, 64, 4
SAMPLES = 512


class DemoNNX(nnx.Module):
    """The demo model in Flax NNX: two hidden layers, a LayerNorm, a linear head."""

    def __init__(self, rngs: nnx.Rngs):
        self.body = nnx.List(
            [nnx.Linear(D_IN, WIDTH, rngs=rngs), nnx.Linear(WIDTH, WIDTH, rngs=rngs)]
        )
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, D_OUT, rngs=rngs)

    def __call__(self, x):
        for layer in self.body:
            x = jax.nn.gelu(layer(x))
        return self.head(self.norm(x))


class DemoLinen(nn.Module):
    """The same model in Flax Linen."""

    @nn.compact
    def __call__(self, x):
        x = jax.nn.gelu(nn.Dense(WIDTH)(x))
        x = jax.nn.gelu(nn.Dense(WIDTH)(x))
        return nn.Dense(D_OUT)(nn.LayerNorm()(x))


class DemoEquinox(eqx.Module):
    """The same model in Equinox (one example at a time)."""

    body: tuple[eqx.nn.Linear, eqx.nn.Linear]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.body = (
            eqx.nn.Linear(D_IN, WIDTH, key=k1),
            eqx.nn.Linear(WIDTH, WIDTH, key=k2),
        )
        self.norm = eqx.nn.LayerNorm(WIDTH, eps=1e-6)
        self.head = eqx.nn.Linear(WIDTH, D_OUT, key=k3)

    def __call__(self, x):
        for layer in self.body:
            x = jax.nn.gelu(layer(x))
        return self.head(self.norm(x))


def task() -> tuple[jax.Array, jax.Array]:
    """A regression task generated from a fixed seed: a random teacher network's
    outputs on Gaussian inputs. No download."""
    kx, k1, k2 = jax.random.split(jax.random.key(42), 3)
    x = jax.random.normal(kx, (SAMPLES, D_IN))
    w1 = jax.random.normal(k1, (D_IN, WIDTH)) / np.sqrt(D_IN)
    w2 = jax.random.normal(k2, (WIDTH, D_OUT)) / np.sqrt(WIDTH)
    return x, jnp.tanh(x @ w1) @ w2


def loss_fn(model: DemoNNX, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


@dataclass(frozen=True)
class Result:
    """The demo's figures."""

    loss_before: float
    loss_after: float
    frozen_unchanged: bool
    head_changed: bool
    diff_equinox: float
    diff_linen: float
    diff_reloaded: float
    checkpoint: Path
    file_size: int
    seconds: float


def run(steps: int, directory: Path, console: Console) -> Result:
    """Run the demo, writing the checkpoint in `directory`; returns the figures."""
    start = time.perf_counter()
    require("nnx")  # the demo starts from an NNX model: flax new enough for it
    x, y = task()
    model = DemoNNX(nnx.Rngs(0))
    tree = to_neutral(model)
    spec = trainable(tree, lambda t: t.head)  # everything else is frozen
    step = make_step(loss_fn, optax.adam(1e-2), spec)
    opt_state = step.init(tree)
    before = float(loss_fn(model, x, y))

    trained, loss = tree, before
    columns = (
        TextColumn("training the head"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps  loss {task.fields[loss]:.4f}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task("train", total=steps, loss=before)
        for i in range(steps):
            trained, opt_state, loss = step(trained, opt_state, x, y)
            if i % 10 == 9 or i == steps - 1:
                progress.update(bar, completed=i + 1, loss=float(loss))

    frozen = [(tree.body, trained.body), (tree.norm, trained.norm)]
    frozen_unchanged = all(
        np.array_equal(a, b)
        for old, new in frozen
        for a, b in zip(jax.tree_util.tree_leaves(old), jax.tree_util.tree_leaves(new))
    )
    head_changed = not np.array_equal(tree.head.kernel, trained.head.kernel)

    nnx_model = to_native(trained)
    equinox_model = port(nnx_model, DemoEquinox(jax.random.key(1)))
    linen_module = DemoLinen()
    linen_variables = linen_module.init(jax.random.key(2), x[:1])
    linen_model = port(nnx_model, (linen_module, linen_variables))

    checkpoint = directory / "demo.safetensors"
    save(checkpoint, nnx_model, metadata={"demo_steps": str(steps)})
    reloaded = load(checkpoint, like=DemoEquinox(jax.random.key(3)))

    return Result(
        loss_before=before,
        loss_after=float(loss_fn(nnx_model, x, y)),
        frozen_unchanged=frozen_unchanged,
        head_changed=head_changed,
        diff_equinox=compare(nnx_model, equinox_model, x),
        diff_linen=compare(nnx_model, linen_model, x),
        diff_reloaded=compare(nnx_model, reloaded, x),
        checkpoint=checkpoint,
        file_size=checkpoint.stat().st_size,
        seconds=time.perf_counter() - start,
    )


def summary(result: Result) -> Table:
    """The demo's figures as a rich table."""
    table = Table(title="bridge demo", title_justify="left")
    table.add_column("check")
    table.add_column("result", justify="right")
    yes = lambda ok: "[green]yes[/]" if ok else "[red]NO[/]"  # noqa: E731
    table.add_row("loss before training (MSE)", f"{result.loss_before:.4f}")
    table.add_row("loss after training (MSE)", f"{result.loss_after:.4f}")
    table.add_row(
        "frozen layers (body, norm) unchanged, bit for bit",
        yes(result.frozen_unchanged),
    )
    table.add_row("head trained", yes(result.head_changed))
    table.add_row("max |NNX - Equinox| (ported)", f"{result.diff_equinox:.2e}")
    table.add_row("max |NNX - Linen| (ported)", f"{result.diff_linen:.2e}")
    table.add_row("max |NNX - Equinox loaded from file|", f"{result.diff_reloaded:.2e}")
    table.add_row(f"checkpoint {result.checkpoint.name}", f"{result.file_size:,} bytes")
    table.add_row("total time", f"{result.seconds:.1f} s")
    return table


def demo(
    steps: int = 300, console: Console | None = None, out: Path | None = None
) -> Result:
    """Run the demo and print its progress and summary; returns the figures.

    **Arguments:**

    - `steps`: training steps.
    - `console`: where to print (a `rich.console.Console`); a new one by default.
    - `out`: directory for the checkpoint; a temporary one (deleted) by default.

    **Returns:**

    A `Result` with the losses, the checks and the output differences.
    """
    console = console or Console()
    console.print(
        f"NNX model: {D_IN} -> {WIDTH} -> {WIDTH} -> LayerNorm -> head {D_OUT}; "
        f"task: {SAMPLES} generated samples. Freezing all but the head.",
        highlight=False,
    )
    if out is not None:
        result = run(steps, Path(out), console)
    else:
        with tempfile.TemporaryDirectory() as directory:
            result = run(steps, Path(directory), console)
    console.print(summary(result))
    return result
