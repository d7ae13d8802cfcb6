"""The PyTorch model a Hugging Face folder holds weights for, built from its
`config.json` alone: full size, no weights in memory, so that `trace_module`
(`_torch_trace`) reads the folder's computation before a single weight is loaded.

`folder_module(folder)` builds it on the `meta` device, else inside
`FakeTensorMode`, through the library its config names (one module each, of the
same functions: `_torch_transformers`, `_torch_diffusers`), and relates the
module's names to the folder's keys as that library renames them on load. A
downloaded folder is hostile input: a config naming code of its own is never built
(nothing it names is imported, no question is asked), and a config declaring far
more than its folder holds is refused before it costs minutes and gigabytes
(`_torch_bounds`).

torch and the libraries are imported here only, when called: without them,
`folder_module` says why it built nothing.
"""

from __future__ import annotations

import importlib
import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from .._families._diffusers import CLASS
from .._gc import paused
from .._shown import shown
from . import _torch_diffusers, _torch_transformers
from ._torch_bounds import Bounds, TooBig, declared


class FolderModule(NamedTuple):
    """A Hugging Face model built from a folder's `config.json`, with no weights.

    - `module`: the `torch.nn.Module` (full size, eval mode, its tensors on the
      `meta` device, or fake where it cannot be built there), or None.
    - `reason`: why there is no module (empty when there is one).
    - `keys`: `{state-dict name: the folder's key}` where they differ (transformers
      renames some on load: ViT's `layers.0.attention.q_proj` is the file's
      `vit.encoder.layer.0.attention.attention.query`; a base model's names lack
      the `base_model_prefix` of a head model's file).
    - `unmatched`: the module's names that no key of the folder gives (a weight
      transformers makes from several keys, a key renamed in a way not read here):
      their uses cannot be told by the file's names.
    - `merged`: `{module name: the keys}` of the module's weights transformers
      makes from several of the folder's keys (per-expert weights packed into one
      tensor on load).
    - `twin`: whether the module is a twin of small widths (`_torch_real`), not
      the model at full size.
    """

    module: Any
    reason: str
    keys: dict[str, str]
    unmatched: tuple[str, ...]
    merged: Mapping[str, tuple[str, ...]] = {}
    twin: bool = False


_NO_PACKAGE = (
    "{name} is not installed (pip install {install}): the PyTorch side "
    "cannot be built from config.json"
)


_CUSTOM_CODE = (
    "its config.json names code of its own ({what}), which bridge never imports or "
    "runs: its PyTorch model is not built, so its forward pass is not traced; pass "
    "the torch module itself as the source, or leave example= out to pair by names"
)
# The fields through which a config.json asks transformers (or another library) to
# import a file of the folder or of a hub repository
_CODE_FIELDS = (
    *("auto_map", "trust_remote_code", "custom_pipelines", "custom_pipeline"),
)
_LIBRARIES = (_torch_diffusers, _torch_transformers)
"""The libraries whose folders are built, each a module of the same functions
(`claims`, `prepare`, `context`, `renamed`): the first that claims a config."""
CONFIG = "config.json"


_TOO_BIG = (
    "its config.json declares {what}, but the folder holds {keys} tensors: the "
    "config does not describe these weights (building it would take minutes and "
    "gigabytes); use the config.json the weights were saved with"
)


MOST_JSON = 100 << 20
"""The most bytes of a `config.json`, an index or a safetensors header read here
(safetensors' own bound of a header)."""


class _CustomCode(Exception):
    """A config naming code of its own folder or of a hub repository."""


def _custom_code(raw: Mapping) -> str | None:
    """What in `raw` (or its nested configs) names code to import (`auto_map`,
    `trust_remote_code`, `custom_pipelines`, diffusers' `custom_pipeline` and a
    `_class_name` naming a module and a class), shown shortly; None when nothing
    does. transformers' auto classes import such code, after asking on stdin."""
    todo = [raw]
    while todo:
        node = todo.pop()
        for key, value in node.items():
            if key in _CODE_FIELDS and value not in (None, False, {}, []):
                return f"{key}: {shown(value)}"
            if key == CLASS and isinstance(value, list | tuple):
                return f"{key}: {shown(value)}"
            if isinstance(value, Mapping):
                todo.append(value)
    return None


def _too_big(e: TooBig, tensors: int | None) -> str:
    held = "an unknown number of" if tensors is None else tensors
    return _TOO_BIG.format(what=e, keys=held)


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _raw(given: Any, keys: int | None) -> dict:
    """The config of a folder (its `config.json`) or a dict, naming no code of its
    own (`_custom_code`) and declaring no more than a folder of `keys` tensors
    holds (`declared`)."""
    raw = given if isinstance(given, Mapping) else _json_in(Path(given) / CONFIG)
    if not isinstance(raw, Mapping):
        raise ValueError(f"config.json holds a {type(raw).__name__}, not an object")
    code = _custom_code(raw)
    if code is not None:
        raise _CustomCode(_CUSTOM_CODE.format(what=code))
    what = declared(raw, keys)
    if what is not None:
        raise TooBig(what)
    return dict(raw)


@paused()
def folder_module(folder: Any, keys: Any = None) -> FolderModule:
    """Build the PyTorch model a Hugging Face folder holds weights for, from its
    `config.json` alone, at no memory cost: meta (or fake) tensors of full size.

    A diffusers config (`_class_name`: `_torch_diffusers`) builds that diffusers
    model class; any other a transformers model: `config["architectures"][0]`
    (else the class `transformers.AutoModel` maps the config to) under
    transformers' `no_init_weights()`, with `attn_implementation="eager"`,
    `use_cache=False` and float32 parameters, then `tie_weights()`
    (`_torch_transformers`). Built on the `meta` device (else inside
    `torch._subclasses.fake_tensor.FakeTensorMode`), within `_torch_bounds`, in
    `eval()` mode. `trace_module` runs it on meta or fake inputs.

    **Arguments:**

    - `folder`: a folder with a `config.json`, or the config as a dict.
    - `keys`: optional, the folder's tensor names; by default read from its
      `*.safetensors.index.json` or `*.safetensors` headers (none for a dict).

    **Returns:**

    A `FolderModule`: the module or the reason there is none (torch or its
    library missing, an unknown class, a failing constructor), and how the
    module's names relate to the folder's keys.
    """
    plan = _plan(folder, keys)
    if isinstance(plan, str):
        return FolderModule(None, plan, {}, ())
    torch = plan.torch
    fake_tensor = _import("torch._subclasses.fake_tensor")
    if fake_tensor is None:
        return FolderModule(None, "torch has no FakeTensorMode", {}, ())
    module = _built(
        plan,
        plan.build,
        (  # the meta device where it builds, else fake tensors
            lambda: torch.device("meta"),
            lambda: fake_tensor.FakeTensorMode(allow_non_fake_inputs=True),
        ),
    )
    if isinstance(module, str):
        return FolderModule(None, module, {}, ())
    names = _file_names(module, plan.keys, plan.library, plan.package)
    return FolderModule(module, "", *names)


class _Plan(NamedTuple):
    """What a build from a folder's config needs: the config, the folder's keys,
    the bounds of the build, the model's library, torch, the class name and
    `build(torch)` (the library's `prepare`)."""

    raw: dict
    keys: Any
    count: int | None
    bounds: Bounds
    library: Any
    package: Any
    torch: Any
    name: str
    build: Any


def _plan(folder: Any, keys: Any) -> _Plan | str:
    """The plan of a build from `folder`'s config, or why there is none."""
    if keys is None and not isinstance(folder, Mapping):
        keys = _folder_keys(folder)
    count = None if keys is None else len(keys)
    bounds = Bounds(count)
    try:
        raw = _raw(folder, count)
        library = next(lib for lib in _LIBRARIES if lib.claims(raw))
        install = f"torch {library.PACKAGE}"
        torch, package = _import("torch"), _import(library.PACKAGE)
        for name, found in (("torch", torch), (library.PACKAGE, package)):
            if found is None:
                return _NO_PACKAGE.format(name=name, install=install)
        name, build = library.prepare(package, raw, bounds)
    except TooBig as e:
        return _too_big(e, count)
    except _CustomCode as e:
        return str(e)
    except Exception as e:  # not JSON, not an object, no class, refused by its
        # library
        return f"its config.json is not read: {type(e).__name__}: {e}"
    return _Plan(raw, keys, count, bounds, library, package, torch, name, build)


def _built(plan: _Plan, build: Any, devices: tuple) -> Any:
    """The module `build` makes within the plan's bounds, in the first of
    `devices` (contexts) where it builds, in `eval()` mode; else why not."""
    failed = ""
    torch = plan.torch
    for device in devices:
        try:
            with plan.bounds.counting(torch), device():
                with plan.library.context(plan.package), plan.bounds.stopping():
                    module = build(torch)
        except TooBig as e:
            return _too_big(e, plan.count)
        except Exception as e:  # the model's own code: report, do not crash the port
            failed = (
                failed or f"{plan.name} could not be built: {type(e).__name__}: {e}"
            )
            continue
        return module.eval()
    return failed


def module_from_folder(folder: Any) -> Any:
    """`folder_module(folder).module`: the fake-tensor model, or None."""
    return folder_module(folder).module


def _folder_keys(folder: Any) -> list[str] | None:
    """The tensor names of a folder's safetensors files: its index's
    (`*.safetensors.index.json`), else the files' headers; None where they cannot
    be read."""
    folder = Path(folder)
    try:
        indexes = sorted(folder.glob("*.safetensors.index.json"))
        if len(indexes) == 1:
            return list(_json_in(indexes[0]).get("weight_map", {}))
        names: list[str] = []
        for path in sorted(folder.glob("*.safetensors")):
            size = int.from_bytes(_bytes_in(path, 0, 8), "little")
            header = _json_in(path, 8, size)
            names += [k for k in header if k != "__metadata__"]
    except (OSError, ValueError, RecursionError, AttributeError):
        return None
    return names or None


def _json_in(path: Path, start: int = 0, size: int | None = None) -> Any:
    """The JSON at `start` (`size` bytes, by default to the end) of the regular
    file at `path`, of at most `MOST_JSON` bytes."""
    return json.loads(_bytes_in(path, start, size))


def _bytes_in(path: Path, start: int, size: int | None) -> bytes:
    """`size` bytes (by default to the end) at `start` of the regular file at
    `path`, opened without blocking (a FIFO is refused, never waited on), at most
    `MOST_JSON`; `ValueError` naming the file otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        size = st.st_size - start if size is None else size
        if size > MOST_JSON or start + size > st.st_size:
            raise ValueError(f"{path.name} does not hold {size} bytes at {start}")
        return os.pread(fd, size, start)
    finally:
        os.close(fd)


def _file_names(
    module: Any, keys: Any, library: Any, package: Any
) -> tuple[dict[str, str], tuple[str, ...], dict[str, tuple[str, ...]]]:
    """`{module name: file key}` where they differ, the module names no key
    gives, and `{module name: its keys}` of those several keys give, renaming the
    keys as the model's library does on load (`library.renamed`: transformers'
    conversion mapping and `base_model_prefix`, diffusers' older attention
    names)."""
    state = module.state_dict(keep_vars=True)
    names = list(state)
    if keys is None:
        return {}, (), {}
    given: dict[str, list[str]] = {}
    for key, name in library.renamed(module, package, names, list(keys)).items():
        given.setdefault(name, []).append(key)
    by_tensor: dict[int, str] = {}  # a tied name: the key of the name the file has
    for name in names:
        if len(given.get(name, ())) == 1:
            by_tensor.setdefault(id(state[name]), given[name][0])
    found: dict[str, str] = {}
    unmatched = []
    for name in names:
        sources = given.get(name, [])
        key = sources[0] if len(sources) == 1 else by_tensor.get(id(state[name]))
        if key is None:
            unmatched.append(name)
        elif key != name:
            found[name] = key
    merged = {n: tuple(k) for n, k in given.items() if n in state and len(k) > 1}
    return found, tuple(unmatched), merged
