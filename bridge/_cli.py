"""The `bridge` command: `inspect`, `convert` and `demo` (also `python -m bridge`)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import re
import sys
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from ._sizes import human as human
from ._version import VERSION


if TYPE_CHECKING:
    from rich.table import Table

    from ._io._contents import Contents


# the formats' one-line summaries (`Format.summary`), here so that `--help` answers
# without importing JAX; tests/test_cli.py checks them against the registry
FORMATS = (
    "*.gguf: a llama.cpp GGUF file, read only, each tensor dequantized when its layer "
    "is converted; *.msgpack: a flax msgpack file of Linen variables ({role: {module: "
    "...}}); any other path: an orbax checkpoint directory (shardings kept); "
    "*.safetensors: one safetensors file (roles in its metadata), read lazily; "
    "*.safetensors.index.json: a sharded Hugging Face checkpoint, read shard by shard "
    "(written as one shard)"
)
# bridge._io._relayout's, here for the same reason (checked by tests/test_cli.py)
LAYOUTS = ("flax", "equinox", "torch")
BATCH_NORM_MODES = ("batch", "ema")

_DESCRIPTION = """\
Inspect and convert checkpoints of Flax (Linen, NNX) and Equinox models and
PyTorch-layout checkpoints (Hugging Face's included), and run the demo. The checkpoint
formats, chosen by each path: {formats}. A directory holding a
model.safetensors.index.json is a sharded checkpoint. Pickle files (*.bin, *.pt) are
refused, never unpickled."""

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
    """The registered formats' summaries (imports JAX): what `FORMATS` says."""
    from ._io._format import formats

    return "; ".join(fmt.summary for fmt in formats())


def _formats_help() -> str:
    """The formats for `--help`: the registry's where it is imported already (a
    program that registered a format of its own calls `main`), else `FORMATS`,
    without importing JAX."""
    return _formats() if "bridge._io._format" in sys.modules else FORMATS


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors on one line, and the closest option proposed for
    a misspelt one (`--to_layout`: did you mean `--to-layout`?)."""

    def error(self, message: str):
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            hints = [
                f"{arg} (did you mean {near}?)"
                for arg in unknown[1].split()
                if (near := _nearest(self, arg.partition("=")[0]))
            ]
            if hints:
                message = "unrecognized arguments: " + ", ".join(hints)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its subcommands."""
    found = set()
    for action in parser._actions:
        found.update(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


def _nearest(parser: argparse.ArgumentParser, arg: str) -> str | None:
    if not arg.startswith("-"):
        return None
    options = sorted(_options(parser))
    spelt = "--" + arg.lstrip("-").replace("_", "-").lower()
    if spelt in options:
        return spelt
    close = difflib.get_close_matches(spelt, options, n=1, cutoff=0.75)
    return close[0] if close else None


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


def _natural(name: str) -> tuple:
    """`h.2.attn` before `h.10.attn`: numbers (ASCII digits) compared as numbers."""
    return tuple(
        (0, int(part), "") if _ascii_number(part) else (1, 0, part)
        for part in name.split(".")
    )


def _ascii_number(text: str) -> bool:
    """Whether `text` is a number written in ASCII digits (not `"²"`, which `int`
    refuses, nor Arabic-Indic `"١"`, which it reads as 1)."""
    return text.isascii() and text.isdecimal()


def _shards(contents: Contents) -> dict[str, str]:
    """`{array name: shard file name}` for a checkpoint of several files (its
    format's `Format.files`), else empty."""
    from ._io._format import format_named

    files = format_named(contents.format).files
    return {} if files is None else dict(files(contents))


def rows(contents: Contents, where: str | None = None) -> list[dict[str, Any]]:
    """The arrays of a checkpoint, in the model's order (a file bridge wrote keeps
    it; the names of any other, PyTorch's or a sharded folder's, in natural order:
    `h.2` before `h.10`), those whose name `where` (a regex) finds only: name, role,
    shape, dtype, bytes and, for a sharded checkpoint, the shard file; for a tensor
    stored in a type of its own (a GGUF file's `Q4_K`), that type (`stored`), its
    bytes as stored and `dtype` the one it is read as."""
    from ._quant._read import stored_types

    tensors = list(contents.tensors)
    shards = _shards(contents)
    types = stored_types(contents)
    if contents.version is None or shards:
        tensors.sort(key=lambda s: _natural(s.key))
    pattern = None if where is None else re.compile(where)
    out = []
    for s in tensors:
        if pattern is not None and not pattern.search(s.key):
            continue
        shape, dtype = s.logical
        row: dict[str, Any] = dict(name=s.key, role=s.role, shape=list(shape))
        row.update(dtype=dtype, bytes=s.nbytes, elements=math.prod(shape))
        if s.key in types:  # stored in a type of its own, read as `dtype`
            row.update(stored=types[s.key][0], bytes=types[s.key][1])
        if shards:
            row["shard"] = shards.get(s.key, "")
        out.append(row)
    return out


def inspect_table(contents: Contents, where: str | None = None) -> tuple[Table, str]:
    """The arrays of a checkpoint as a rich table (the first 1,000), and the line of
    totals (of all those shown)."""
    from rich.table import Table

    found = rows(contents, where)
    sharded = any("shard" in r for r in found)
    table = Table()
    table.add_column("path", overflow="fold")
    table.add_column("role")
    table.add_column("shape")
    table.add_column("dtype")
    table.add_column("size", justify="right")
    if sharded:
        table.add_column("shard", overflow="fold")
    short = _short_shards([r["shard"] for r in found]) if sharded else {}
    for row in found[:_ROWS]:
        cells = [printable(row["name"]), printable(row["role"])]
        dtype = row["dtype"]
        if "stored" in row:
            dtype = f"{row['stored']} (read as {dtype})"
        cells += [str(tuple(row["shape"])), dtype, human(row["bytes"])]
        table.add_row(*cells, *([printable(short[row["shard"]])] if sharded else []))
    if len(found) > _ROWS:
        more = f"... {len(found) - _ROWS:,} more"
        table.add_row(more, *[""] * (len(table.columns) - 1))
    totals = _totals(found)
    line = (
        f"{totals['arrays']:,} arrays, {totals['parameters']:,} parameters "
        f"({totals['elements']:,} elements), {totals['bytes']:,} bytes "
        f"({human(totals['bytes'])})"
    )
    if where is not None:
        line += f" whose name matches {where!r} (of {len(contents.tensors):,})"
    return table, line


def _short_shards(names: list[str]) -> dict[str, str]:
    """Shard file names without what they all share (`model-00001-of-00003.safetensors`
    -> `00001-of-00003`), so the column stays narrow; the title says the rest."""
    unique = sorted(set(names))
    if len(unique) < 2:
        return {n: n for n in unique}
    head = os.path.commonprefix(unique)
    head = head[: head.rfind("-") + 1]
    tail = os.path.commonprefix([n[::-1] for n in unique])[::-1]
    tail = tail[tail.find(".") :] if "." in tail else ""
    return {n: n[len(head) : len(n) - len(tail)] or n for n in unique}


def _totals(found: list[dict[str, Any]]) -> dict[str, int]:
    return dict(
        arrays=len(found),
        parameters=sum(r["elements"] for r in found if r["role"] == "params"),
        elements=sum(r["elements"] for r in found),
        bytes=sum(r["bytes"] for r in found),
    )


def _inspect(args: argparse.Namespace, console: Console) -> None:
    from ._io import _training
    from ._io._read import open_checkpoint
    from ._lora._summary import lora_summary
    from ._quant._read import quantization_summary

    with open_checkpoint(args.path) as contents:
        # the header is all inspect shows, and a quantized weight's dense shape
        quantized = quantization_summary(contents)
        lora = lora_summary(contents)
    if args.json:
        found = rows(contents, args.filter)
        report = dict(
            path=str(contents.path),
            format=contents.format,
            framework=contents.framework,
            layout=contents.layout or None,
            saved_by=contents.version,
            arrays=found,
            totals=_totals(found),
            training=_training.summary(contents, human),
            quantized=quantized,
            lora=lora,
            metadata=contents.metadata,
        )
        print(json.dumps(report, indent=1))
        return
    table, totals = inspect_table(contents, args.filter)
    fw = printable(contents.framework or "framework unknown")
    layout = printable(f"{contents.layout or 'unknown'} layout")
    console.print(
        Text.assemble(
            printable(contents.path), f" ({contents.format}, ", fw, ", ", layout, ")"
        ),
        soft_wrap=True,
    )
    if _shards(contents):
        shards = sorted({r["shard"] for r in rows(contents)})
        console.print(
            printable(f"{len(shards)} shard files: " + ", ".join(shards)),
            soft_wrap=True,
        )
    console.print(table)
    console.print(totals, soft_wrap=True, markup=False)
    for line in quantized + lora:
        console.print(line, markup=False, soft_wrap=True)
    for line in _training.summary(contents, human):
        console.print(printable(line), soft_wrap=True)
    if contents.version:
        console.print(Text("saved by bridge ") + printable(contents.version))
    for key, value in contents.metadata.items():
        console.print(
            printable(key) + ": " + printable(_clipped(value)), soft_wrap=True
        )


_LONGEST = 1000  # characters of a metadata value shown (a GGUF may hold 20 MB)


def _clipped(value: str) -> str:
    if len(value) <= _LONGEST:
        return value
    return f"{value[:_LONGEST]}... ({len(value):,} characters; --json shows all)"


_TABLE_FIX = (
    "a converted file cannot take it from --like: save the model with "
    "bridge.save_pretrained(folder, model, like=REFERENCE, strict=False)"
)
_EXISTS = (
    "{dst} exists: pass --overwrite to replace it (nothing was written; the "
    "replacement is atomic, the old one stays until the new one is complete)"
)
_ONTO_SOURCE = (
    "{dst} would replace the checkpoint being read ({src}), even with --overwrite: "
    "write to another path, then move it"
)

_MSGPACK_LOSES = (
    "{dst}: a msgpack file holds Flax variables and keeps no metadata, so the "
    "PyTorch layout of the arrays would be lost: the file would load into no model "
    "and convert to no layout (nothing was written). Add --to-layout flax to store "
    "Flax's names and shapes, or write {stem}.safetensors or an orbax directory, "
    "which keep the layout (as bridge.save_state_dict refuses a msgpack file)"
)
_ORDER_LOST = (
    "note: {dst}: a {format} file holds no metadata, so the order in which the "
    "model uses its arrays (recorded by save(..., example=), which ports the file "
    "into a model with other names) is not kept; write {stem}.safetensors or an "
    "orbax directory to keep it"
)
_NO_CONFIG = (
    "note: {dst} holds no config.json, which from_pretrained needs to build the "
    "model: convert again with --overwrite --config {config}"
)


def _config_source(src: Path) -> str:
    """What to pass as --config: the folder `src` is or lies in, where it holds a
    config.json (the Hugging Face folder the weights came from), else a placeholder."""
    folder = src if src.is_dir() else src.parent
    if (folder / "config.json").is_file():
        return str(folder)
    return "PATH (the model's config.json, or the folder holding it)"


_DEMO_EXISTS = (
    "{checkpoint} exists: pass --overwrite to replace it, or another --out "
    "(nothing was run)"
)
_NEEDS_LAYOUT = (
    "{flags} {verb} nothing without --to-layout (they choose how layers are "
    "stored in the converted layout): add --to-layout, or leave {them} out"
)
_FOLDER_ONLY = (
    "{flags} {verb} only to a Hugging Face folder: pass --to-layout torch and a "
    "folder DST (no file suffix)"
)
_BN_MODE_EQUINOX = "--batch-norm-mode applies only with --to-layout equinox"
_BAD_NAMES = """\
{dst}: the converted checkpoint would hold names bridge.load refuses ({reason}); \
nothing was written. Check the --rename rules: each PATH is a dotted path of names and \
indices (layers.0), never inside another array's name."""


def _check_inspect(args: argparse.Namespace, usage: argparse.ArgumentParser) -> None:
    if args.filter is not None:
        re.compile(args.filter)


def _check_demo(args: argparse.Namespace, usage: argparse.ArgumentParser) -> None:
    """Refuse, before any work, to replace a checkpoint in --out without --overwrite."""
    checkpoint = None if args.out is None else args.out / "demo.safetensors"
    if checkpoint is not None and checkpoint.exists() and not args.overwrite:
        raise FileExistsError(_DEMO_EXISTS.format(checkpoint=checkpoint))


def _check_convert(args: argparse.Namespace, usage: argparse.ArgumentParser) -> None:
    """Refuse, before any work, what convert would ignore, write wrongly or destroy
    (an existing file without --overwrite, its own source ever)."""
    from ._io._format import format_of
    from ._io._write import check_destination

    flags = [f for f, v in (("--rename", args.rename),) if v]
    flags += ["--batch-norm-mode"] if args.batch_norm_mode else []
    if flags and not args.to_layout:
        them, verb = ("it", "does") if len(flags) == 1 else ("them", "do")
        usage.error(
            _NEEDS_LAYOUT.format(flags=" and ".join(flags), them=them, verb=verb)
        )
    if args.batch_norm_mode and args.to_layout != "equinox":
        usage.error(_BN_MODE_EQUINOX)
    if args.like is not None and args.to_layout != "torch":
        usage.error("--like applies only with --to-layout torch")
    if args.like is not None and not Path(args.like).exists():
        raise FileNotFoundError(f"--like {args.like}: no such file or folder")
    dst = Path(args.dst)
    fmt = format_of(dst)
    folder = [("--max-shard-size", args.max_shard_size), ("--config", args.config)]
    given = [f for f, v in folder if v is not None]
    if given and (args.to_layout != "torch" or fmt.suffixes):
        verb = "applies" if len(given) == 1 else "apply"
        usage.error(_FOLDER_ONLY.format(flags=" and ".join(given), verb=verb))
    check_destination(dst, " (a Hugging Face folder with --to-layout torch)")
    if not dst.parent.is_dir():
        raise FileNotFoundError(f"{dst.parent}: no such directory to write {dst.name}")
    # realpath: a symlink loop is the reader's error to report, not a crash here
    src, out = Path(os.path.realpath(args.src)), Path(os.path.realpath(dst))
    # the files read: SRC, or those of the folder it is or names (a Hugging Face
    # folder, a sharded checkpoint's index and its shards)
    folder = src if src.is_dir() else src.parent if src.name.endswith(".json") else None
    inside = folder is not None and out.exists() and folder in out.parents
    if out == src or out in src.parents or inside:
        raise ValueError(_ONTO_SOURCE.format(dst=dst, src=args.src))
    if dst.exists() and not args.overwrite:
        raise FileExistsError(_EXISTS.format(dst=dst))


def _check_names(dst: Path, contents: Contents) -> None:
    """The names `contents` would be written under are names `load` reads back."""
    from ._io._contents import Malformed, decode, encode

    shapes = {s.key: (s.shape, s.dtype) for s in contents.tensors}
    try:
        decode(dst, contents.format, encode(contents), shapes)
    except Malformed as e:
        raise ValueError(_BAD_NAMES.format(dst=dst, reason=e)) from None


def _convert(args: argparse.Namespace, console: Console) -> None:
    from ._io._format import format_of
    from ._io._hf_folder import write_arrays
    from ._io._read import open_checkpoint, read
    from ._io._reference import check as check_reference, reference_of
    from ._io._relayout import model_only, relayout
    from ._io._write import write
    from ._progress import Display

    dst = Path(args.dst)
    with Display(Console(stderr=True)) as slow:
        with open_checkpoint(args.src) as contents:
            layout = args.to_layout or contents.layout
            if format_of(dst).name == "msgpack" and layout == "torch":
                stem = dst.name.removesuffix(dst.suffix)
                raise ValueError(_MSGPACK_LOSES.format(dst=dst, stem=stem))
            total = sum(s.nbytes for s in contents.tensors)
            name = f"reading {contents.path.name} ({human(total)})"
            with slow.phase(name, total):
                arrays = read(contents)
        if args.weights_only and contents.training:
            count = len(contents.tensors)
            contents, arrays = model_only(contents, arrays)
            console.print(
                f"left out the training state: {count - len(contents.tensors)} "
                "arrays (optimizer state, extras) and the step",
                markup=False,
            )
        if args.to_layout:
            with slow.phase(f"converting to the {args.to_layout} layout"):
                contents, arrays = relayout(
                    contents,
                    arrays,
                    args.to_layout,
                    rename=args.rename,
                    batch_norm_mode=args.batch_norm_mode,
                )
            if args.rename:
                _check_names(dst, contents)
        if args.like is not None:  # before anything is written
            shapes = ((k, tuple(getattr(v, "shape", ()))) for k, v in arrays.items())
            check_reference(shapes, reference_of(args.like, fix=_TABLE_FIX))
        folder = args.to_layout == "torch" and not format_of(dst).suffixes
        if contents.order and not folder and not format_of(dst).order:
            kind = format_of(dst).name
            note = _ORDER_LOST.format(dst=dst, format=kind, stem=dst.stem)
            console.print(printable(note), soft_wrap=True)
            contents = dataclasses.replace(contents, order=())
        with slow.phase(f"writing {dst.name}"):
            if folder:  # a Hugging Face folder: the order in its files' metadata
                size = args.max_shard_size
                size = int(size) if size is not None and _ascii_number(size) else size
                order = {"order": json.dumps(contents.order)} if contents.order else {}
                write_arrays(
                    dst, arrays, max_shard_size=size, config=args.config, metadata=order
                )
            else:
                write(dst, contents, arrays)
    kind = "Hugging Face folder" if folder else format_of(dst).name
    console.print(
        Text.assemble(
            printable(contents.path),
            f" ({contents.format}) -> ",
            printable(dst),
            f" ({kind}): {len(contents.tensors):,} arrays",
        ),
        soft_wrap=True,
    )
    if folder and not (dst / "config.json").is_file():
        note = _NO_CONFIG.format(dst=dst, config=_config_source(Path(args.src)))
        console.print(printable(note), soft_wrap=True)


def _demo(args: argparse.Namespace, console: Console) -> None:
    from ._demo import demo

    demo(steps=args.steps, console=console, out=args.out)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of steps")
    return value


def _directory(text: str) -> Path:
    """`--out`: an existing directory this user can write into, or one line saying
    what `text` is instead and the fix."""
    path = Path(text)
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise argparse.ArgumentTypeError(
                f"{text!r} is a directory this user cannot write into (pick "
                "another, or make it writable: chmod u+wx)"
            )
        return path
    if path.exists():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a directory but a file (give a directory)"
        )
    above = next((p for p in path.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an existing directory: {str(above)!r} is a file "
            "(give a directory)"
        )
    raise argparse.ArgumentTypeError(
        f"{text!r} is not an existing directory (create it first)"
    )


def parser() -> argparse.ArgumentParser:
    """The command line parser of `bridge`."""
    top = _Parser(
        prog="bridge", description=_DESCRIPTION.format(formats=_formats_help())
    )
    top.add_argument("--version", action="version", version=f"bridge {VERSION}")
    sub = top.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser(
        "inspect",
        help="list a checkpoint's arrays: path, role, shape, dtype, size, totals",
        description="List a checkpoint's arrays (path, role, shape, dtype, size), the "
        "totals, and the metadata saved with it.",
    )
    p.add_argument("path", help="a checkpoint: " + _formats_help())
    p.add_argument(
        "--filter",
        metavar="REGEX",
        help="list only the arrays whose name the regular expression finds "
        "(re.search), e.g. 'attn' or '^h\\.0\\.'",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the listing as JSON (name, role, shape, dtype, bytes, elements, "
        "shard per array; totals; metadata) for other programs",
    )
    p.set_defaults(run=_inspect, check=_check_inspect, usage=p)
    p = sub.add_parser(
        "convert",
        help="convert between formats (safetensors, msgpack, orbax, Hugging Face "
        "folders), and to another framework's layout (--to-layout)",
        description=_CONVERT_HELP.format(formats=_formats_help()),
    )
    p.add_argument("src", help="the checkpoint to read")
    p.add_argument(
        "dst",
        help="the checkpoint to write; an existing one is replaced only with "
        "--overwrite, and never the checkpoint being read",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST if it exists (atomically: the old one stays until the new "
        "one is complete)",
    )
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
        "--max-shard-size",
        metavar="SIZE",
        help="with --to-layout torch and a folder DST (no file suffix): a Hugging "
        "Face folder as save_pretrained writes it, shards of at most SIZE (bytes, or "
        "'5GB'; default 50GB) with model.safetensors.index.json",
    )
    p.add_argument(
        "--config",
        metavar="PATH",
        help="with --to-layout torch and a folder DST: the config.json to write "
        "there (a file, or the folder holding it and generation_config.json); "
        "from_pretrained needs it, and the command says when DST has none",
    )
    p.add_argument(
        "--like",
        metavar="REFERENCE",
        help="with --to-layout torch: a PyTorch-layout checkpoint (a safetensors "
        "file or a Hugging Face folder) of the model the result is for; its names "
        "and shapes must be exactly those written, else nothing is written",
    )
    p.add_argument(
        "--batch-norm-mode",
        choices=BATCH_NORM_MODES,
        help="with --to-layout equinox: the mode of each eqx.nn.BatchNorm: 'batch' "
        "(default; the statistics as they are with batch_counter 2**30, so inference "
        "uses them unchanged) or 'ema'",
    )
    p.set_defaults(run=_convert, check=_check_convert, usage=p)
    p = sub.add_parser(
        "demo",
        help="train, freeze, port across frameworks, save and reload a small model",
        description="Build a small NNX model, freeze all but its head and train it "
        "on a generated task, port it to Equinox and Linen, check all three agree, "
        "save and reload a checkpoint, and print a summary.",
    )
    p.add_argument("--steps", type=_positive, default=300, help="training steps (300)")
    p.add_argument(
        "--out",
        type=_directory,
        help="directory to keep the checkpoint in (default: a temporary one); "
        "its demo.safetensors is replaced only with --overwrite",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the demo.safetensors of --out if it exists",
    )
    p.set_defaults(run=_demo, check=_check_demo, usage=p)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `bridge` command; returns the exit code (errors on stderr, exit code
    1: one line, or a line and one line per problem). The arguments are parsed
    before JAX is imported: `--help`, `--version` and usage errors answer at once."""
    top = parser()
    args, unknown = top.parse_known_args(argv)
    if unknown:  # said by the subcommand, whose --help lists the options it means
        args.usage.error("unrecognized arguments: " + " ".join(unknown))
    from . import _load  # now JAX: every adapter, codec and format registered

    _load()
    # piped (not a terminal): lines as long as they are, so `| grep` sees each whole
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=100_000)
    try:
        args.check(args, args.usage)
        args.run(args, console)
    except BrokenPipeError:  # `bridge inspect big | head`: the reader has had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (OSError, ValueError, TypeError, re.error) as error:  # PortError too
        print(f"bridge {args.command}: error: {_lines(error)}", file=sys.stderr)
        return 1
    return 0


def _lines(error: BaseException) -> str:
    """An error's message for the terminal: its control characters escaped, its
    text's line breaks joined, but one line per problem of a list (`- ...`) and
    for what follows the list."""
    out: list[str] = []
    listed = False
    for line in _prose(error).splitlines():
        item = line.lstrip().startswith("- ")
        if not line.strip():
            continue
        if not out or item or (listed and not line[0].isspace()):
            out.append(" ".join(line.split()))
            listed = listed or item
        else:
            out[-1] += " " + " ".join(line.split())
    return "\n".join(printable(line).plain for line in out)


def _prose(error: BaseException) -> str:
    """An exception's message as a sentence: an `OSError` made of `(errno, text)`
    is its text (and the file it names), never the tuple."""
    if isinstance(error, re.error):
        return f"--filter: {error.pattern!r} is not a regular expression ({error})"
    if isinstance(error, OSError):
        code, text = error.errno, error.strerror
        if text is None and len(error.args) == 2 and isinstance(error.args[0], int):
            code, text = error.args  # an OSError subclass that is a ValueError first
        name = error.filename
        if isinstance(code, int) and isinstance(text, str):
            return text if name is None or str(name) in text else f"{name}: {text}"
    return str(error)
