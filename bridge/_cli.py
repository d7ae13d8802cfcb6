"""The `bridge` command: `inspect`, `convert` and `demo` (also `python -m bridge`)."""

from __future__ import annotations

import argparse
import math
import sys
import unicodedata
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ._demo import demo
from ._io import _training
from ._io._checkpoint import Contents, open_checkpoint, read, write
from ._io._format import format_of, formats
from ._io._relayout import BATCH_NORM_MODES, LAYOUTS, model_only, relayout


_DESCRIPTION = """\
Inspect and convert checkpoints of Flax (Linen, NNX) and Equinox models and PyTorch-
layout checkpoints (Hugging Face's included), and run the demo. The checkpoint formats,
chosen by each path: {formats}. A directory holding a model.safetensors.index.json is
a sharded checkpoint. Pickle files (*.bin, *.pt) are refused, never unpickled."""

_CONVERT_HELP = """\
Convert a checkpoint between the formats ({formats}), keeping each array's role; the
format follows each path. The destination is written atomically. With --to-layout, the
arrays are also converted to another framework's names and shapes through the port
codecs, without the model: Equinox or PyTorch -> Flax (Linen/NNX), Flax or PyTorch ->
Equinox (Dense kernel (in,out) -> Linear weight (out,in), HWIO -> OIHW convolutions,
fused attention heads, BatchNorm statistics as eqx.nn.State entries), or any ->
PyTorch (nn.Linear weight (out,in), OIHW, running_mean/running_var, fused
in_proj_weight; layers named by their dotted paths). A PyTorch-layout file records
no classes: a lone 2-D weight is an Embedding when its name says so (emb..., wte,
wpe, shared), else a Linear. A layer no codec recognises is an error naming it;
nothing is written then. A training checkpoint (saved with an optimizer state) is
refused by --to-layout unless --weights-only leaves its training state out."""


def _formats() -> str:
    return "; ".join(fmt.summary for fmt in formats())


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors on one line."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human(nbytes: int) -> str:
    """A size in bytes, for people.

    ```python
    >>> human(20), human(1536), human(2**30)
    ('20 B', '1.5 KiB', '1.0 GiB')

    ```
    """
    size, unit = float(nbytes), 0
    while size >= 1024 and unit < len(_UNITS) - 1:
        size, unit = size / 1024, unit + 1
    return f"{nbytes} B" if unit == 0 else f"{size:.1f} {_UNITS[unit]}"


def printable(text: object) -> Text:
    r"""`text` (a string from a file) as rich text shown literally: no markup is
    interpreted, and control and format characters (terminal escapes, bidi marks,
    NUL) are shown escaped (`\x1b`).

    ```python
    >>> printable("[red]a\x1b[2Jb").plain
    '[red]a\\x1b[2Jb'

    ```
    """
    chars = (
        repr(c)[1:-1] if unicodedata.category(c) in _UNPRINTABLE else c
        for c in str(text)
    )
    return Text("".join(chars))


_UNPRINTABLE = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}


_ROWS = 1000  # a table longer than this shows its first rows only (rich is slow)


def inspect_table(contents: Contents) -> tuple[Table, str]:
    """The arrays of a checkpoint as a rich table (the first 1,000), and the line of
    totals (of all)."""
    table = Table()
    table.add_column("path", overflow="fold")
    table.add_column("role")
    table.add_column("shape")
    table.add_column("dtype")
    table.add_column("size", justify="right")
    params = elements = nbytes = 0
    for s in contents.tensors:
        shape, dtype = s.logical
        count = math.prod(shape)
        elements += count
        nbytes += s.nbytes
        params += count if s.role == "params" else 0
        if table.row_count == _ROWS:
            continue
        table.add_row(
            printable(s.key),
            printable(s.role),
            str(shape),
            dtype,
            human(s.nbytes),
        )
    if len(contents.tensors) > _ROWS:
        table.add_row(f"... {len(contents.tensors) - _ROWS:,} more", "", "", "", "")
    totals = (
        f"{len(contents.tensors):,} arrays, {params:,} parameters "
        f"({elements:,} elements), {nbytes:,} bytes ({human(nbytes)})"
    )
    return table, totals


def _inspect(args: argparse.Namespace, console: Console) -> None:
    with open_checkpoint(args.path) as contents:
        pass  # the header is all inspect shows
    table, totals = inspect_table(contents)
    fw = printable(contents.framework or "framework unknown")
    layout = printable(f"{contents.layout or 'unknown'} layout")
    console.print(
        Text.assemble(
            printable(contents.path), f" ({contents.format}, ", fw, ", ", layout, ")"
        ),
        soft_wrap=True,
    )
    console.print(table)
    console.print(totals, soft_wrap=True)
    for line in _training.summary(contents, human):
        console.print(line, markup=False, soft_wrap=True)
    if contents.version:
        console.print(Text("saved by bridge ") + printable(contents.version))
    for key, value in contents.metadata.items():
        console.print(printable(key) + ": " + printable(value), soft_wrap=True)


def _convert(args: argparse.Namespace, console: Console) -> None:
    dst = Path(args.dst)
    with open_checkpoint(args.src) as contents:
        arrays = read(contents)
    if args.weights_only and contents.training:
        count = len(contents.tensors)
        contents, arrays = model_only(contents, arrays)
        console.print(
            f"left out the training state: {count - len(contents.tensors)} arrays "
            "(optimizer state, extras) and the step",
            markup=False,
        )
    if args.to_layout:
        contents, arrays = relayout(
            contents,
            arrays,
            args.to_layout,
            rename=args.rename,
            batch_norm_mode=args.batch_norm_mode,
        )
    write(dst, contents, arrays)
    console.print(
        f"{contents.path} ({contents.format}) -> {dst} ({format_of(dst).name}): "
        f"{len(contents.tensors):,} arrays",
        soft_wrap=True,
        markup=False,
    )


def _demo(args: argparse.Namespace, console: Console) -> None:
    demo(steps=args.steps, console=console, out=args.out)


def parser() -> argparse.ArgumentParser:
    """The command line parser of `bridge`."""
    top = _Parser(prog="bridge", description=_DESCRIPTION.format(formats=_formats()))
    sub = top.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser(
        "inspect",
        help="list a checkpoint's arrays: path, role, shape, dtype, size, totals",
        description="List a checkpoint's arrays (path, role, shape, dtype, size), the "
        "totals, and the metadata saved with it.",
    )
    p.add_argument("path", help="a checkpoint: " + _formats())
    p.set_defaults(run=_inspect)
    p = sub.add_parser(
        "convert",
        help="convert between safetensors, msgpack and orbax",
        description=_CONVERT_HELP.format(formats=_formats()),
    )
    p.add_argument("src", help="the checkpoint to read")
    p.add_argument("dst", help="the checkpoint to write")
    p.add_argument(
        "--to-layout",
        choices=LAYOUTS,
        help="store the arrays in this framework's layout (through the port "
        "codecs): 'flax' converts an Equinox or PyTorch-layout checkpoint to Flax "
        "names and shapes, 'equinox' a Linen, NNX or PyTorch-layout checkpoint to "
        "the names and shapes bridge.save gives the Equinox model of the same "
        "layers, 'torch' any checkpoint to the names and shapes of PyTorch's "
        "state_dict",
    )
    p.add_argument(
        "--rename",
        action="append",
        default=[],
        metavar="PATTERN=PATH",
        help="with --to-layout equinox or torch: store the layer whose dotted path "
        "fully matches the regex PATTERN under PATH (re.Match.expand), e.g. "
        "'Dense_(\\d+)=layers.\\1' or 'Conv_0=conv' for Linen auto-names, "
        "'layers\\.(\\d+)=\\1' for PyTorch's nn.Sequential; repeatable, the first "
        "matching rule wins",
    )
    p.add_argument(
        "--weights-only",
        action="store_true",
        help="leave a training checkpoint's training state (optimizer state, step, "
        "extras) out and convert the model's weights alone; --to-layout refuses a "
        "training checkpoint without it (bridge.load(path, like=model, "
        "opt_state_like=...) ports the optimizer state with the weights instead)",
    )
    p.add_argument(
        "--batch-norm-mode",
        choices=BATCH_NORM_MODES,
        help="with --to-layout equinox: the mode of each eqx.nn.BatchNorm: 'batch' "
        "(default; the statistics as they are with batch_counter 2**30, so inference "
        "uses them unchanged) or 'ema'",
    )
    p.set_defaults(run=_convert)
    p = sub.add_parser(
        "demo",
        help="train, freeze, port across frameworks, save and reload a small model",
        description="Build a small NNX model, freeze all but its head and train it "
        "on a generated task, port it to Equinox and Linen, check all three agree, "
        "save and reload a checkpoint, and print a summary.",
    )
    p.add_argument("--steps", type=int, default=300, help="training steps (300)")
    p.add_argument(
        "--out",
        type=Path,
        help="directory to keep the checkpoint in (default: a temporary one)",
    )
    p.set_defaults(run=_demo)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `bridge` command; returns the exit code (errors: one line on stderr,
    exit code 1)."""
    args = parser().parse_args(argv)
    console = Console(highlight=False)
    try:
        args.run(args, console)
    except (OSError, ValueError, TypeError) as error:  # PortError is a ValueError
        message = printable(" ".join(str(error).split())).plain
        print(f"bridge {args.command}: error: {message}", file=sys.stderr)
        return 1
    return 0
