"""What `bridge inspect` says about the LoRA adapters in a checkpoint, from its header
alone: a model saved with its adapters (`lora_a`/`lora_b` under their layers), or a
PEFT `adapter_model.safetensors` (`<layer>.lora_A.weight`, ...; rank and alpha from
the `adapter_config.json` beside it)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from ._peft import CONFIG, MODEL, WEIGHTS, _pattern, _wrong_types, read_config
from ._settings import A, B


_PEFT_KEY = re.compile(r"^(.*)\.(lora_A\.weight|lora_B\.weight|lora_embedding_[AB])$")


def _layers(contents: Any) -> tuple[dict[str, dict[str, tuple]], bool]:
    """`{layer name: {"a": shape, "b": shape}}`, and whether the names are PEFT's."""
    layers: dict[str, dict[str, tuple]] = {}
    peft = False
    for s in contents.tensors:
        found = _PEFT_KEY.match(s.key)
        if found:
            peft = True
            name = found.group(1).removeprefix(MODEL)
            side = (
                "a" if found.group(2) in ("lora_A.weight", "lora_embedding_A") else "b"
            )
        elif s.path and s.path[-1] in (A, B):
            name = ".".join(str(k) for k in s.path[:-1])
            side = "a" if s.path[-1] == A else "b"
        else:
            continue
        layers.setdefault(name, {})[side] = tuple(s.shape)
    return layers, peft


def _rank(shapes: dict[str, tuple], peft: bool, layout: str) -> int | None:
    a, b = shapes.get("a"), shapes.get("b")
    if a is None or b is None:
        return None
    if peft:  # lora_A (r, in, ...); an embedding's lora_embedding_B (dim, r)
        return b[1] if len(b) >= 2 else None
    # Linen/NNX: lora_a (..., r); Equinox and PyTorch orientation: lora_b (..., r)
    return a[-1] if layout == "flax" else b[-1]


def lora_summary(contents: Any) -> list[str]:
    """Lines describing the checkpoint's LoRA adapters (none: `[]`)."""
    layers, peft = _layers(contents)
    if not layers:
        return []
    ranks = {n: _rank(s, peft, contents.layout) for n, s in layers.items()}
    known = sorted({r for r in ranks.values() if r is not None})
    targets = sorted({n.rsplit(".", 1)[-1] for n in layers})
    lines = [f"LoRA adapters on {len(layers)} layer(s), targets {', '.join(targets)}"]
    rank = (
        f"rank {known[0]}"
        if len(known) == 1
        else f"ranks {known[0]} to {known[-1]}"
        if known
        else "rank unknown"
    )
    config, wrong = _config(contents.path) if peft else (None, [])
    if config is not None:
        r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
        alphas = {
            float(_pattern(n, config.get("alpha_pattern") or {}, alpha)) for n in layers
        }
        shown = ", ".join(f"{a:g}" for a in sorted(alphas))
        rank += f", alpha {shown} (config r {r}"
        rank += ", rslora)" if config.get("use_rslora") else ")"
    lines.append(rank)
    lines += [f"{w}: its rank and alpha are not read" for w in wrong]
    lora = sum(math.prod(s) for shapes in layers.values() for s in shapes.values())
    total = sum(math.prod(s.shape) for s in contents.tensors if s.role == "params")
    if peft:
        lines.append(
            f"{lora:,} adapter parameters (the base model is not in this file)"
        )
    else:
        share = lora / total if total else 0.0
        lines.append(
            f"{lora:,} adapter parameters, {share:.2%} of the {total:,} in this file"
        )
    return lines


def _config(path: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """The `adapter_config.json` beside a PEFT weights file (None if absent or
    unreadable: inspect shows what the header says), and its values of other types
    than PEFT's, each naming the field, its value escaped (`_peft._wrong_types`;
    the config is None then)."""
    file = Path(path).parent / CONFIG
    if Path(path).name != WEIGHTS or not file.exists():
        return None, []
    try:
        config = read_config(file)
    except (ValueError, OSError):
        return None, []
    wrong = _wrong_types(config)
    return (None, wrong) if wrong else (config, [])
