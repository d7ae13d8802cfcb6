"""Harness C: public code bases bridge was never tuned on, each an architecture
written in JAX (Flax Linen, Flax NNX or Equinox) with a PyTorch twin (the same
authors' own, or transformers'), installed from the package index, ported with no
rules.

Each code base has a module beside this one (`recurrentgemma_models.py`, ...)
whose `CASES` build both twins tiny; every floating-point array of the source is
perturbed (noise 0.1, variances upwards) so that ones and zeros cannot hide a
misplaced array. Routes, each with `example=` given:

- `torch->jax`: `bridge.port(torch_model, jax_model, example=...)`;
- `folder->jax`: the PyTorch model written as its library writes it
  (`save_pretrained`, or its state dict as a safetensors file), then
  `bridge.load(path, like=jax_model, example=...)`;
- `jax->torch`: `bridge.port(jax_model, torch_model, example=...)`, then
  `torch_model.load_state_dict(state, strict=True)`;
- `jax->folder`: `bridge.save_pretrained(folder, jax_model, like=torch_model,
  example=...)` (or `bridge.save_state_dict` for one file), then opened by the
  library's own loader (`from_pretrained`, or `load_state_dict(strict=True)` of
  the file).

Outputs are compared with the source framework's at float32: `exact` (within the
case's tolerance, relative to the largest magnitude when above 1), `refused` (a
`PortError`/`CheckpointError`: its first line and problems kept), `wrong` (no
error, the outputs differ: silently wrong), `crash` (any other exception).

A case whose twin holds arrays the other side has no counterpart for (ESM's
contact head, which no forward pass of the masked LM runs) names them in
`left_out`: its routes run with `strict=False` and are `exact` only when the
report (or, for a save, the file against `like`'s state dict) leaves out those and
nothing else; `incomplete` when it leaves out more (said, not silent). Every save
is checked so: a file lacking one of `like`'s arrays (a tie apart) is never exact.
`python -m tests.public.code_bases [names]` prints the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib
import importlib.util
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from .hf_flax import (
    Outcome,
    _quiet,
    _refusal,
    command_line,
    first_line,
    perturb_torch,
    perturbed,
    problems,
)


ROUTES = ("torch->jax", "folder->jax", "jax->torch", "jax->folder")
# the modules of the code bases, each with its CASES {name: () -> Case}
CODE_BASES = (
    "recurrentgemma_models",
    "esm2quinox_models",
    "flaxmodels_models",
    "mamba2_jax_models",
    "equimo_models",
    "diffusers_models",
)


@dataclasses.dataclass
class Case:
    """One JAX model and its PyTorch twin, built tiny.

    `make_jax()` builds the JAX model in the form bridge takes (an `nnx.Module`, an
    Equinox model, Linen `(module, variables)`); `make_torch()` the PyTorch one;
    `jax_call(model)` and `torch_call(model)` run each on the same inputs and return
    the output compared (numpy, float64). `example`, `jax_kwargs`, `torch_kwargs`:
    what bridge is given to trace. `write(model, folder)` writes the PyTorch model
    as its library does and returns the path; `read(path)` opens it with the
    library's own loader; `save_kwargs`: what `bridge.save` is given beside
    `like=` (a transformers `config=`)."""

    name: str
    code_base: str  # the package
    framework: str  # "linen", "nnx", "equinox"
    make_jax: Callable[[], Any]
    make_torch: Callable[[], Any]
    jax_call: Callable[[Any], np.ndarray]
    torch_call: Callable[[Any], np.ndarray]
    example: tuple
    jax_kwargs: dict
    torch_kwargs: dict
    write: Callable[[Any, str], str]
    read: Callable[[str], Any]
    save_path: str = "model"  # under the temporary folder: a folder or a file name
    save_kwargs: dict = dataclasses.field(default_factory=dict)
    tolerance: float = 1e-5
    # fragments of the paths the routes may leave out (then run with strict=False)
    left_out: tuple[str, ...] = ()
    # entered around every route: what an older code base needs of today's JAX
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


# --- the sides ------------------------------------------------------------------


def torch_tensors(**arrays) -> dict:
    """numpy arrays as tensors (integers as int64)."""
    import torch

    return {
        k: torch.from_numpy(np.asarray(v)).long()
        if np.asarray(v).dtype.kind == "i"
        else torch.from_numpy(np.asarray(v))
        for k, v in arrays.items()
    }


def to_numpy(x) -> np.ndarray:
    """A torch tensor or a JAX array as float64 numpy."""
    if hasattr(x, "detach"):
        x = x.detach().float().numpy()
    return np.asarray(x, np.float64)


def hf_folder(model, folder: str) -> str:
    """transformers' `save_pretrained` (safetensors)."""
    model.save_pretrained(folder)
    return folder


def state_dict_file(model, path: str) -> str:
    """The model's state dict as one safetensors file (`safetensors.torch`), as
    code bases without a folder format of their own publish it; tied tensors once."""
    from safetensors.torch import save_model

    save_model(model, path)
    return path


def read_state_dict_file(make: Callable[[], Any]) -> Callable[[str], Any]:
    """The loader of `state_dict_file`: a fresh model, `load_state_dict(...,
    strict=True)` of the file (`safetensors.torch.load_model`, which re-ties)."""

    def read(path: str):
        from safetensors.torch import load_model

        model = make()
        load_model(model, path, strict=True)
        return model.eval()

    return read


def perturb_jax(model: Any, framework: str, seed: int) -> Any:
    """`model` with every floating-point array perturbed (noise 0.1; BatchNorm
    variances upwards). NNX in place (its attribute order kept); Linen
    `(module, variables)` and Equinox models as new ones."""
    if framework == "nnx":
        from .bonsai_models import perturb_nnx

        return perturb_nnx(model, seed)
    if framework == "linen":
        module, variables = model
        return module, perturbed(variables, seed)
    import equinox as eqx

    arrays, static = eqx.partition(model, eqx.is_inexact_array)
    return eqx.combine(perturbed(arrays, seed), static)


# --- routes ---------------------------------------------------------------------


class _Incomplete(Exception):
    """A `left_out` case's route left out more than the case allows."""


def _check_left_out(case: Case, names) -> None:
    extra = [n for n in names if not any(f in n for f in case.left_out)]
    if extra:
        raise _Incomplete(f"left out beyond {case.left_out}: {extra}")


def _reported(case: Case, report) -> None:
    _check_left_out(case, [*report.missing, *report.unexpected, *report.mismatched])


def _lenient(case: Case) -> dict:
    """`port`'s and `load`'s arguments for the case's strictness."""
    return {"strict": False, "report": True} if case.left_out else {}


def _filled(case: Case, result):
    """The filled model, the report checked when the case leaves arrays out."""
    if not case.left_out:
        return result
    filled, report = result
    _reported(case, report)
    return filled


def _torch_to_jax(case: Case):
    import bridge

    source = perturb_torch(case.make_torch(), 1)
    want = case.torch_call(source)
    ported = bridge.port(
        source,
        case.make_jax(),
        example=case.example,
        example_kwargs=(case.torch_kwargs, case.jax_kwargs),
        **_lenient(case),
    )
    return case.jax_call(_filled(case, ported)), want


def _folder_to_jax(case: Case):
    import bridge

    source = perturb_torch(case.make_torch(), 2)
    want = case.torch_call(source)
    with tempfile.TemporaryDirectory() as tmp:
        path = case.write(source, os.path.join(tmp, case.save_path))
        ported = bridge.load(
            path,
            like=case.make_jax(),
            example=case.example,
            example_kwargs=case.jax_kwargs,
            **_lenient(case),
        )
    return case.jax_call(_filled(case, ported)), want


def _jax_to_torch(case: Case):
    import bridge

    source = perturb_jax(case.make_jax(), case.framework, 3)
    want = case.jax_call(source)
    target = case.make_torch().eval()
    state = bridge.port(
        source,
        target,
        example=case.example,
        example_kwargs=(case.jax_kwargs, case.torch_kwargs),
        **_lenient(case),
    )
    target.load_state_dict(_filled(case, state), strict=True)
    return case.torch_call(target), want


def _jax_to_folder(case: Case):
    import bridge

    source = perturb_jax(case.make_jax(), case.framework, 4)
    want = case.jax_call(source)
    like = case.make_torch().eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, case.save_path)
        folder = not path.endswith(".safetensors")
        save = bridge.save_pretrained if folder else bridge.save_state_dict
        save(
            path,
            source,
            like=like,
            example=case.example,
            example_kwargs=case.jax_kwargs,
            strict=not case.left_out,
            **case.save_kwargs,
        )
        _check_left_out(case, not_written(path, like))
        got = case.torch_call(case.read(path))
    return got, want


def not_written(path: str, like) -> list[str]:
    """The names of `like`'s state dict that the safetensors file at `path` (or
    the files of the folder) lacks, a name tied to a written one apart."""
    from safetensors import safe_open

    files = (
        [path] if path.endswith(".safetensors") else glob.glob(f"{path}/*.safetensors")
    )
    written: set[str] = set()
    for file in files:
        with safe_open(file, "np") as f:
            written |= set(f.keys())
    state = like.state_dict()
    held = {(t.data_ptr(), t.shape) for n, t in state.items() if n in written}
    return [
        n
        for n, t in state.items()
        if n not in written and (t.data_ptr(), t.shape) not in held
    ]


RUNNERS = {
    "torch->jax": _torch_to_jax,
    "folder->jax": _folder_to_jax,
    "jax->torch": _jax_to_torch,
    "jax->folder": _jax_to_folder,
}


def run_route(case: Case, route: str) -> Outcome:
    """One route's outcome (`hf_flax.Outcome`): exact with the largest relative
    difference, refused with the error's first line and problems, wrong, or a
    crash with where it was raised."""
    try:
        with _quiet(), case.context():
            got, want = RUNNERS[route](case)
    except Exception as error:  # noqa: BLE001 - a crash is an outcome here
        if _refusal(error):
            return Outcome("refused", first_line(error), problems(error))
        if isinstance(error, _Incomplete):
            return Outcome("incomplete", str(error))
        detail = first_line(error)
        tb = traceback.extract_tb(error.__traceback__)
        if tb:
            detail += f" [{tb[-1].filename.split('/')[-1]}:{tb[-1].lineno}]"
        return Outcome("crash", detail)
    if got.shape != want.shape:
        return Outcome("wrong", f"shape {got.shape} vs {want.shape}")
    scale = max(1.0, float(np.max(np.abs(want))))
    worst = float(np.max(np.abs(got - want))) / scale
    if worst <= case.tolerance:
        return Outcome("exact", f"{worst:.1e}")
    return Outcome("wrong", f"max difference {worst:.3g}")


def cases() -> dict[str, tuple[str, Callable[[], Case]]]:
    """Every code base's cases, `{name: (the package it needs, builder)}`; the
    modules import their packages only when a case is built."""
    found = {}
    for module in CODE_BASES:
        models = importlib.import_module(f"{__package__}.{module}")
        found |= {name: (models.PACKAGE, make) for name, make in models.CASES.items()}
    return found


def installed(package: str) -> bool:
    """Whether `package` (a dotted module name: a package, or the module of it that
    a case needs) can be imported."""
    try:
        return importlib.util.find_spec(package) is not None
    except ImportError:  # a parent package missing
        return False


def main(names=None) -> dict:
    results = {}
    for name, (package, make) in cases().items():
        if (names and name not in names) or not installed(package):
            continue
        try:
            with _quiet():
                case = make()
        except Exception as error:  # noqa: BLE001
            results[name] = {
                r: Outcome("crash", "build: " + first_line(error)) for r in ROUTES
            }
            print(name, results[name], flush=True)
            continue
        results[name] = {}
        print(name, flush=True)
        for route in ROUTES:
            outcome = results[name][route] = run_route(case, route)
            print(f"    {route:12s} {outcome}", flush=True)
            for p in outcome.problems[:6]:
                print(f"        - {p[:300]}", flush=True)
    return results


if __name__ == "__main__":
    command_line(main)
