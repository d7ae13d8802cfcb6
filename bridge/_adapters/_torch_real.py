"""A folder's PyTorch model with real tensors, for what its meta (or fake) build
cannot give: a forward pass that reads values (a `.item()`: transformers'
multimodal models count their image tokens, raising `DataDependentOutputException`
on fake tensors) and the values of its non-persistent buffers (Gemma 3's
`embed_scale`, `sqrt(hidden)`: in no file).

`real_module(folder)` builds the model again on the CPU, its parameters filled with
small deterministic values, where its tensors take at most `MOST_REAL` bytes; a
larger model is replaced by its twin of small widths (`_torch_transformers.narrowed`:
the same layers, names, heads and vocabulary, `hidden_size` 4 a head), whose
forward pass records the same roles and order of use for every parameter, accepted
only if its parameter names are the model's, in the same order, and it fits in
`MOST_REAL`. A twin's buffers are its own (`embed_scale` of its width): only a
model at full size gives constants (`FolderModule.twin`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading
from typing import Any

from .._gc import paused
from ._torch_folder import FolderModule, _built, _file_names, _plan


MOST_REAL = 256 << 20
"""The most bytes of a folder's model built with real tensors (its parameters and
buffers): a 64M-parameter float32 model, or a twin."""

_TOO_LARGE = (
    "its forward pass reads values, which a model of no memory (meta or fake "
    "tensors) cannot give, and {what}; pass the torch module itself as the source "
    "(or leave example= out to pair by names)"
)


@paused()
def real_module(folder: Any, keys: Any = None) -> FolderModule:
    """The model of `folder` (a folder with a `config.json`, or the config as a
    dict; `keys` as `folder_module` takes them) with real tensors on the CPU, or
    its twin of small widths where it would take more than `MOST_REAL` bytes;
    `FolderModule.twin` says which. The module is None, with the reason, where
    neither can be built (a diffusers model past the bound: no twin is made of
    one)."""
    key = json.dumps(folder, sort_keys=True, default=str), repr(keys)
    with _LOCK:
        found = _BUILT.get(key)
    if found is None:
        found = _real(folder, keys)
        with _LOCK:
            _BUILT[key] = found
            while len(_BUILT) > 2:  # a load asks for its trace and its constants
                _BUILT.popitem(last=False)
    return found


_BUILT: collections.OrderedDict[Any, FolderModule] = collections.OrderedDict()
_LOCK = threading.Lock()


def _real(folder: Any, keys: Any) -> FolderModule:
    plan = _plan(folder, keys)
    if isinstance(plan, str):
        return FolderModule(None, plan, {}, ())
    meta = _built(plan, plan.build, (lambda: plan.torch.device("meta"),))
    if isinstance(meta, str):
        return FolderModule(None, meta, {}, ())
    twin, size = False, _nbytes(meta)
    build = plan.build
    if size > MOST_REAL:
        try:
            _, build = plan.library.prepare(
                plan.package, plan.raw, plan.bounds, narrow=True
            )
        except ValueError as e:
            what = f"the model would take {size:,} bytes with real tensors ({e})"
            return FolderModule(None, _TOO_LARGE.format(what=what), {}, ())
        small = _built(plan, build, (lambda: plan.torch.device("meta"),))
        if isinstance(small, str):
            return FolderModule(None, small, {}, ())
        problem = _unlike(meta, small)
        if problem is not None:
            what = f"its twin of small widths {problem}"
            return FolderModule(None, _TOO_LARGE.format(what=what), {}, ())
        twin = True
    module = _built(plan, build, (contextlib.nullcontext,))
    if isinstance(module, str):
        return FolderModule(None, module, {}, ())
    _filled(module, plan.torch)
    names = _file_names(module, plan.keys, plan.library, plan.package)
    return FolderModule(module, "", *names)._replace(twin=twin)


def _nbytes(module: Any) -> int:
    """The bytes of a module's parameters and buffers (on any device)."""
    seen: dict[int, int] = {}
    for t in (*module.parameters(), *module.buffers()):
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _unlike(model: Any, twin: Any) -> str | None:
    """Why `twin` cannot stand for `model`: other parameter names (or order), or
    too many bytes; None when it can."""
    names = list(model.state_dict(keep_vars=True))
    theirs = list(twin.state_dict(keep_vars=True))
    if names != theirs:
        other = sorted(set(names) ^ set(theirs))[:3] or ["the order"]
        return f"has other parameters than the model ({', '.join(other)})"
    size = _nbytes(twin)
    if size > MOST_REAL:
        return f"would take {size:,} bytes (a width under a name not narrowed)"
    return None


def _filled(module: Any, torch: Any) -> None:
    """The module's floating parameters filled with small values of a seeded
    generator: built without initialisation, they hold whatever memory held."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
