"""Every check `bridge` has, one nox session each; `.ci/run` runs some of them.

`pip install nox uv`, then `nox -s tests` (the default), `nox -s demo`, `nox -l` for the
list. Each session installs everything it needs in its own fresh virtualenv (made by uv
when it is installed, by virtualenv otherwise).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import nox


sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import matrix_table  # noqa: E402


nox.options.default_venv_backend = "uv|virtualenv"
# uv installs packages without their bytecode (pip compiles it). Where Python may not
# write it either (PYTHONDONTWRITEBYTECODE, set on this project's CI machines), every
# process compiles jax, flax and their dependencies again from source: 3.5-4 s of CPU
# for each pytest worker and each subprocess the tests start. Compiled at install.
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")
nox.options.sessions = ["tests"]
nox.options.error_on_external_run = True

ROOT = Path(__file__).parent
PYTHONS = ["3.11", "3.12", "3.13"]  # the matrix's; keep pyproject's classifiers in sync


def _interpreter(version: str) -> str | None:
    """The path of a working `python{version}`: the one on PATH, else the newest pyenv
    install of it (pyenv's shims on PATH run only the versions PYENV_VERSION names;
    `.ci/run` names them all), else None."""
    exe = shutil.which(f"python{version}")
    if exe:
        found = subprocess.run(
            [exe, "-c", "import sys; print(sys.executable)"],
            capture_output=True,
            text=True,
        )
        if found.returncode == 0:
            return found.stdout.strip()
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    installs = root.glob(f"versions/{version}.*/bin/python{version}")
    patch = lambda path: int(path.parts[-3].split(".")[2])  # noqa: E731
    return str(max(installs, key=patch, default="")) or None


# The default session's Python: the first of these the machine has. Only 3.12 and 3.13
# get the newest releases from the package index (jax 0.11+ and flax 0.12.9+ need
# Python >= 3.12); 3.11 is the fallback, and the session says so.
NEWEST_PYTHONS = ("3.13", "3.12", "3.11")
NEWEST = next(
    ((v, path) for v in NEWEST_PYTHONS if (path := _interpreter(v))),
    (f"{sys.version_info[0]}.{sys.version_info[1]}", sys.executable),
)
# Test workers (pytest-xdist): one per core, at most 4 (each imports its own jax, about
# 2 GB at its peak); each test file runs in one worker, its module fixtures built once.
WORKERS = ["-n", str(min(os.cpu_count() or 1, 4)), "--dist", "loadfile"]
# The fast suite: the tests and the docstring examples of the package; each line of
# dots ends with the count of tests run so far and the total ([ 240/1534])
PROGRESS = ["-o", "console_output_style=count"]
PYTEST = ["pytest", "-q", *PROGRESS, *WORKERS, "tests", "bridge", "--doctest-modules"]
# XLA's default flags and the sharding tests' eight CPU devices (as tests/conftest.py
# sets them when XLA_FLAGS is unset): `tests_slow` and `tests_torch` run with these.
DEFAULT_XLA = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}

# The oldest versions pyproject.toml claims: keep in sync with pyproject.toml.
FLOOR = [
    "jax==0.6.2",
    "jaxlib==0.6.2",
    "flax==0.10.7",
    "equinox==0.12.2",
    "optax==0.2.5",
    "numpy==2.0.0",
    "safetensors==0.4.3",
    "orbax-checkpoint==0.11.17",
    "rich==13.0.0",
]

# `tests_matrix`, on Python 3.11: the newest release of each flax line, each with a jax
# it runs on (pinned, so the table says what ran), against the newest release of each
# equinox line, with the newest optax; and the newest flax once more with the optax
# floor (`tests_floor` runs it with the oldest of everything). On 3.12 and 3.13: the
# newest releases (flax 0.12.12 and jax 0.11+ need Python >= 3.12) against each
# equinox line, and the oldest releases, which install there too. The installer picks
# the rest (orbax, numpy, chex, ...). flax's metadata asks for less than it needs:
# 0.11 imports `jax._src.core.mutable_array`, gone in jax 0.8.
FLAX = {
    "0.10.7": ["jax==0.6.0", "jaxlib==0.6.0"],  # flax 0.10.7 needs jax >= 0.6.0
    "0.11.2": ["jax==0.7.2", "jaxlib==0.7.2"],  # equinox 0.13 refuses 0.7.0, 0.7.1
    "0.12.1": ["jax==0.8.1", "jaxlib==0.8.1"],  # flax 0.12.1 needs jax >= 0.8.1
    "0.12.8": ["jax==0.10.2", "jaxlib==0.10.2"],  # flax 0.12.8 needs jax >= 0.10.0
    "0.12.12": ["jax==0.12.0.1", "jaxlib==0.12.0.1"],  # needs jax >= 0.11.1
}
# A cell whose equinox does not import on its flax row's jax runs on an older jax
# that both accept, where there is one.
OLDER_JAX = {("0.11.2", "0.11.12"): ["jax==0.6.0", "jaxlib==0.6.0"]}
EQUINOX = ["0.11.12", "0.12.2", "0.13.8"]
OPTAX = ["0.2.8", "0.2.5"]  # newest, floor
CELLS = [("3.11", f, e, OPTAX[0]) for f in FLAX if f != "0.12.12" for e in EQUINOX]
CELLS += [("3.11", "0.12.8", EQUINOX[-1], OPTAX[1])]
for _python in PYTHONS[1:]:
    CELLS += [(_python, "0.10.7", EQUINOX[0], OPTAX[0])]
    CELLS += [(_python, "0.12.12", e, OPTAX[0]) for e in EQUINOX]
# Cells no jax can run: each package's metadata accepts some jax both accept, so the
# resolver installs them, but the equinox does not import on a jax its flax accepts.
# They are skipped with the reason, never dropped. A test that needs a newer API is
# skipped by its `requires(...)` mark instead (tests/helpers.py).
_EQX_011 = (
    "equinox 0.11.12 imports `jaxlib.xla_extension`, which jaxlib 0.6.1 and newer do "
    "not have (ModuleNotFoundError on `import equinox`; and on jax 0.10+, "
    "`batching.NotMapped`: AttributeError)"
)
_EQX_012 = (
    "equinox 0.12.2 uses `jax.interpreters.batching.NotMapped`, which jax 0.10 "
    "removed (AttributeError on `import equinox`)"
)
BROKEN = {
    ("0.12.1", "0.11.12"): f"{_EQX_011}; flax 0.12.1 needs jax >= 0.8.1",
    ("0.12.8", "0.11.12"): f"{_EQX_011}; flax 0.12.8 needs jax >= 0.10.0",
    ("0.12.12", "0.11.12"): f"{_EQX_011}; flax 0.12.12 needs jax >= 0.11.1",
    ("0.12.8", "0.12.2"): f"{_EQX_012}; flax 0.12.8 needs jax >= 0.10.0",
    ("0.12.12", "0.12.2"): f"{_EQX_012}; flax 0.12.12 needs jax >= 0.11.1",
}
# The same reasons in a few words, for the README's footnotes
SHORT = {
    _EQX_011: "equinox 0.11 imports on jaxlib <= 0.6.0 only",
    _EQX_012: "equinox 0.12 imports on jax < 0.10 only",
}

RUFF = "ruff==0.17.6"
# mkdocs-material prints a banner about its future on every build
_QUIET_MKDOCS = {"NO_MKDOCS_2_WARNING": "1"}


def _requirements(*, without: tuple[str, ...] = ()) -> list[str]:
    """pyproject.toml's dependencies and test extra, less the packages in `without`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["test"]
    name = lambda req: re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0]  # noqa: E731
    return [r for r in reqs if name(r) not in without]


def _scripts(session: nox.Session, folder: str) -> list[Path]:
    scripts = sorted((ROOT / folder).glob("*.py"))
    if not scripts:
        session.error(f"no {folder}/*.py to run")
    return scripts


@nox.session(python=NEWEST[1])
def tests(session: nox.Session) -> None:
    """The fast suite (`-m "not slow"`) and the doctests, on the newest releases and
    the newest Python found (3.13, else 3.12, else 3.11)."""
    version, path = NEWEST
    session.log(f"Python {version} ({path}): the newest of {', '.join(NEWEST_PYTHONS)}")
    if version != NEWEST_PYTHONS[0]:
        newer = [v for v in NEWEST_PYTHONS if _version(v) > _version(version)]
        session.log(
            f"no Python {' or '.join(newer)} found (on PATH or under pyenv): the "
            f"newest releases Python {version} gets are installed, not the newest ones"
        )
    session.install("--upgrade", "-e", ".[test]")
    _log_versions(session)
    session.run(*PYTEST, "-m", "not slow", *session.posargs)


def _version(version: str) -> tuple[int, ...]:
    return tuple(map(int, version.split(".")))


def _log_versions(session: nox.Session) -> None:
    versions = session.run("python", "-c", _VERSIONS, *REPORTED, silent=True)
    shown = ", ".join(f"{p} {v}" for p, v in json.loads(str(versions)).items())
    session.log(f"Installed: {shown}")


# The versions the `tests` session prints before running
REPORTED = [
    "jax",
    "jaxlib",
    "flax",
    "equinox",
    "optax",
    "orbax-checkpoint",
    "safetensors",
    "numpy",
]


# torch beside the Hugging Face libraries of LoRA and quantized checkpoints
TORCH = ["torch==2.13.0", "peft", "gguf", "compressed-tensors", "qwix", "diffusers"]
# qwix: LoRA; diffusers: its folders (tests/test_diffusers_folder.py)
TORCH_TESTS = [
    "tests/test_torch_adapter.py",
    "tests/test_torch_files.py",
    "tests/test_torch_convert.py",
    "tests/test_torch_layers.py",
    "tests/test_torch_hf.py",
    "tests/test_torch_hf_vit.py",
    "tests/test_torch_hf_gpt2.py",
    "tests/test_experts_gpt_oss.py",
    "tests/test_torch_inputs.py",
    "tests/test_torch_llama.py",
    "tests/test_lora_peft.py",
    "tests/test_lora_gpt2.py",
    "tests/test_lora_torch.py",
    "tests/test_lora_qwix.py",
    "tests/test_torch_hf_folder.py",
    "tests/test_torch_stack_export.py",
    "tests/test_torch_export_reference.py",
    "tests/test_torch_hf_moe.py",
    "tests/test_torch_hf_families.py",
    "tests/test_quant_torch.py",
    "tests/test_quant_keep_torch.py",
    "tests/test_quant_gguf.py",
    "tests/test_gguf_files.py",
    "tests/test_opt_state_torch.py",
    "tests/test_torch_trace.py",
    "tests/test_torch_folder_code.py",
    "tests/test_torch_norms.py",
    "tests/test_torch_split.py",
    "tests/test_torch_channels.py",
    "tests/test_torch_folder_bounds.py",
    "tests/test_diffusers_folder.py",
    "tests/test_torch_folder_real.py",
    "tests/test_torch_ties.py",
    "tests/test_torch_port_traced.py",
    "tests/test_torch_weight_norm.py",
    "tests/test_torch_recurrent_layers.py",
    "tests/test_public_bonsai.py",
]
# examples that need torch, transformers, peft or qwix (the `examples` session, which
# has none of them, runs them to their "skipped" line)
TORCH_EXAMPLES = [
    "examples/lora_gpt2.py",
    "examples/lora_llama.py",
    "examples/lora_qwix.py",
    "examples/lora_torch.py",
    "examples/torch_optimizer.py",
]
QUANT = ["gguf", "compressed-tensors"]  # the quantized-checkpoint tests' references


@nox.session(python="3.11", venv_backend="virtualenv")
def tests_torch(session: nox.Session) -> None:
    """The PyTorch-layout tests against real torch modules and transformers models
    (the slow ones too), then the tests of other files marked `torch`, with XLA's
    default flags.

    torch is installed with pip, not uv: pip takes the CPU wheel the machine
    provides (its find-links, for Python 3.11), where uv would download a multi-GB
    CUDA build."""
    session.run("python", "-m", "pip", "install", "--quiet", *TORCH)
    session.run("python", "-m", "pip", "install", "--quiet", "-e", ".[test,torch]")
    session.run("python", "-m", "pip", "install", "--quiet", *QUANT)
    session.run("pytest", "-q", *TORCH_TESTS, *session.posargs, env=DEFAULT_XLA)
    # the tests of other files that need these packages (marked `torch`; the default
    # session fails a test skipped for lack of one that is neither here nor marked)
    session.run(
        "pytest",
        "-q",
        "tests",
        "-m",
        "torch",
        *session.posargs,
        env=DEFAULT_XLA,
        success_codes=[0, 5] if session.posargs else [0],  # 5: -k selected none
    )
    if not session.posargs:  # the examples that `examples` can only skip
        for script in TORCH_EXAMPLES:
            session.log(f"--- {script}")
            session.run("python", script)


# Haiku and Keras 3 on JAX, KerasHub without TensorFlow: keras-hub declares
# tensorflow-text (and so tensorflow), which the JAX backend never imports; it is
# installed with --no-deps after bridge's `kerashub` extra (its other dependencies)
KERAS_HUB = "keras-hub==0.32.0"
HAIKU_KERAS_TESTS = [
    "tests/test_haiku_adapter.py",
    "tests/test_keras_adapter.py",
    "tests/test_haiku_port.py",
    "tests/test_keras_port.py",
    "tests/test_haiku_keras_matrix.py",
]
HAIKU_KERAS_DOCTESTS = ["bridge/_adapters/_haiku.py", "bridge/_adapters/_keras.py"]


@nox.session(python="3.11", venv_backend="virtualenv")
def tests_haiku_keras(session: nox.Session) -> None:
    """Haiku and Keras 3 (KerasHub too) as frameworks of bridge: their adapters,
    steps, ports against the other frameworks and transformers twins, on Python
    3.11 with torch from pip (as `tests_torch`), Keras on the JAX backend."""
    session.run("python", "-m", "pip", "install", "--quiet", "torch==2.13.0")
    extras = ".[test,torch,haiku,kerashub]"
    session.run("python", "-m", "pip", "install", "--quiet", "-e", extras)
    session.run("python", "-m", "pip", "install", "--quiet", "--no-deps", KERAS_HUB)
    env = {**DEFAULT_XLA, "KERAS_BACKEND": "jax"}
    session.run(
        "pytest",
        "-q",
        *HAIKU_KERAS_TESTS,
        "tests/test_adapters.py",
        "--doctest-modules",
        *HAIKU_KERAS_DOCTESTS,
        *session.posargs,
        env=env,
    )
    if not session.posargs:  # the example that `examples` can only skip
        session.run("python", "examples/haiku_keras.py", env=env)


# `tests_matrix_haiku_keras`: the Haiku and Keras tests per dm-haiku and keras
# (keras-hub) release, on Python 3.11 with the newest flax row (0.12.8, jax 0.10.2)
# and equinox; keras-hub 0.32 needs keras >= 3.15 (an older keras runs without it:
# its KerasHub tests skip). Results: docs/matrix-haiku-keras.json (the README's
# tables do not show them yet).
HAIKU_KERAS_CELLS = [
    ("0.0.14", "3.10.0", ""),
    ("0.0.17", "3.15.1", "0.32.0"),
]
HAIKU_KERAS_RESULTS = ROOT / "docs" / "matrix-haiku-keras.json"


@nox.session(python="3.11", venv_backend="virtualenv")
@nox.parametrize(("haiku", "keras", "keras_hub"), HAIKU_KERAS_CELLS)
def tests_matrix_haiku_keras(
    session: nox.Session, haiku: str, keras: str, keras_hub: str
) -> None:
    """`tests_haiku_keras`'s tests on one dm-haiku x keras (x keras-hub) cell."""
    start = time.monotonic()
    pip = ("python", "-m", "pip", "install", "--quiet")
    session.run(*pip, "torch==2.13.0")
    session.run(*pip, "-e", ".[test,torch,kerashub]", *FLAX["0.12.8"])
    session.run(*pip, f"dm-haiku=={haiku}", f"keras=={keras}", "flax==0.12.8")
    if keras_hub:
        session.run(*pip, "--no-deps", f"keras-hub=={keras_hub}")
    junit = Path(session.create_tmp()) / "junit.xml"
    env = {**DEFAULT_XLA, "KERAS_BACKEND": "jax"}
    session.run(
        "pytest",
        "-q",
        *HAIKU_KERAS_TESTS,
        "tests/test_adapters.py",
        f"--junitxml={junit}",
        *session.posargs,
        env=env,
        success_codes=[0, 1, 2],
    )
    counts = matrix_table.junit_counts(junit)
    if not session.posargs:
        cell = {"haiku": haiku, "keras": keras, "keras_hub": keras_hub or None}
        key = f"3.11/haiku-{haiku}/keras-{keras}/keras-hub-{keras_hub or 'none'}"
        result = {
            **cell,
            **counts,
            "seconds": round(time.monotonic() - start),
            "date": datetime.date.today().isoformat(),
            "commit": _commit(),
        }
        matrix_table.record(key, result, HAIKU_KERAS_RESULTS)
    if counts["failed"]:
        session.error(f"{counts['failed']} tests failed: {counts['failed_tests']}")


# transformers' own Flax model classes, which only its 4.x releases have, against
# their PyTorch twins (tests/public/hf_flax.py)
PUBLIC = ["torch==2.13.0", "transformers>=4.57,<5"]
PUBLIC_TESTS = ["tests/test_public_flax_hf.py"]


@nox.session(python="3.11", venv_backend="virtualenv")
def tests_public(session: nox.Session) -> None:
    """Public model code ported with no rules: transformers 4.x's Flax classes and
    their PyTorch twins, four routes each (140 cases: under 3 minutes on a 2-core
    machine at load 11, 81 s of CPU). torch with pip, as in `tests_torch`."""
    session.run("python", "-m", "pip", "install", "--quiet", *PUBLIC)
    session.run("python", "-m", "pip", "install", "--quiet", "-e", ".[test]")
    session.run("pytest", "-q", *PUBLIC_TESTS, *session.posargs)


# Public code bases with a JAX model and a PyTorch twin (issue #54;
# tests/public/code_bases.py), at the versions measured; with their dependencies,
# torch pinned first so that none of them brings another
PUBLIC_CODE = [
    "recurrentgemma==1.0.1",
    "esm2quinox==0.2.0",
    "flaxmodels==0.1.3",
    "mamba2-jax==1.1.2",
    "equimo==1.1.0",
    "diffusers==0.39.0",  # the last release with Flax models
    "transformers>=5",
]
PUBLIC_CODE_TESTS = ["tests/test_public_code_bases.py"]


@nox.session(python="3.11", venv_backend="virtualenv")
def tests_public_code(session: nox.Session) -> None:
    """Public code bases bridge was never tuned on (recurrentgemma, esm2quinox,
    flaxmodels, mamba2-jax, equimo, diffusers' Flax models), each against its
    PyTorch twin on every route, the slow cases too (43 tests: 3.5 minutes, 10 with
    the installs, on 2 shared cores; not in `.ci/run`). torch with pip, as in
    `tests_torch`."""
    session.run("python", "-m", "pip", "install", "--quiet", "torch==2.13.0")
    session.run("python", "-m", "pip", "install", "--quiet", "-e", ".[test]")
    session.run("python", "-m", "pip", "install", "--quiet", *PUBLIC_CODE)
    session.run("pytest", "-q", *PUBLIC_CODE_TESTS, *session.posargs, env=DEFAULT_XLA)


# What the docs' code imports beyond bridge's dependencies: `tests_slow` runs every
# ```python block of the pages (tests/test_docs.py); the quantized guide reads a GGUF
# file with gguf, the Haiku and Keras guides use those
GUIDE_PACKAGES = ["gguf", "dm-haiku", "keras"]


@nox.session(python=NEWEST[1])
def tests_slow(session: nox.Session) -> None:
    """The tests marked `slow`, on the newest releases, with XLA's default flags."""
    session.install("--upgrade", "-e", ".[test]", *GUIDE_PACKAGES)
    session.run(
        "pytest",
        "-q",
        *WORKERS,
        "tests",
        "-m",
        "slow",
        *session.posargs,
        env=DEFAULT_XLA,
    )


@nox.session(python="3.11")
def tests_floor(session: nox.Session) -> None:
    """The fast suite on the oldest versions pyproject.toml claims, on the oldest
    Python (numpy 2.0.0 has no wheel for 3.13)."""
    start = time.monotonic()
    session.install("-e", ".[test]", *FLOOR)
    _run_and_record(session, "floor", {"python": str(session.python)}, start)


@nox.session
@nox.parametrize(("python", "flax", "equinox", "optax"), CELLS)
def tests_matrix(session: nox.Session, flax: str, equinox: str, optax: str) -> None:
    """The fast suite on each Python x flax x equinox x optax cell; the README table
    records the results (`python scripts/matrix_table.py` rewrites it from
    docs/matrix.json). Python 3.12 and 3.13 must be found: under pyenv, with
    `PYENV_VERSION=3.11.7:3.12.1:3.13.0` (as `.ci/run` sets it)."""
    start = time.monotonic()
    python = str(session.python)
    key = matrix_table.cell_key(python, flax, equinox, optax)
    cell = {"python": python, "flax": flax, "equinox": equinox, "optax": optax}
    reason = BROKEN.get((flax, equinox))
    if reason:
        if not session.posargs:
            short = next(v for k, v in SHORT.items() if reason.startswith(k))
            matrix_table.record(key, {**cell, "declared_skip": reason, "short": short})
        session.skip(reason)
    # Outside pyproject's bounds on purpose: the matrix is how the bounds are found.
    others = _requirements(without=("flax", "equinox", "optax", "jax", "jaxlib"))
    jax = OLDER_JAX.get((flax, equinox), FLAX[flax])
    pins = [f"flax=={flax}", f"equinox=={equinox}", f"optax=={optax}", *jax]
    session.install(*others, *pins)
    session.install("--no-deps", "-e", ".")
    _run_and_record(session, key, cell, start)


def _run_and_record(session: nox.Session, key: str, cell: dict, start: float) -> None:
    """Run the fast suite; without posargs, record the result in docs/matrix.json
    (`seconds` counted from `start`, the install included) and rewrite the version
    tables from it."""
    junit = Path(session.create_tmp()) / "junit.xml"
    # 1: tests failed, 2: a module failed to import; both are recorded as failures
    ok = [0, 1, 2]
    session.run(
        *PYTEST,
        "-m",
        "not slow",
        f"--junitxml={junit}",
        *session.posargs,
        success_codes=ok,
    )
    counts = matrix_table.junit_counts(junit)
    if not session.posargs:
        versions = session.run(
            "python", "-c", _VERSIONS, *matrix_table.PACKAGES, silent=True
        )
        result = {
            **cell,
            "versions": json.loads(versions),
            **counts,
            "seconds": round(time.monotonic() - start),
            "date": datetime.date.today().isoformat(),
            "commit": _commit(),
        }
        matrix_table.record(key, result)
        matrix_table.main([])
    if counts["failed"]:
        session.error(f"{counts['failed']} tests failed: {counts['failed_tests']}")


_VERSIONS = (
    "import importlib.metadata as m, json, sys; "
    "print(json.dumps({p: m.version(p) for p in sys.argv[1:]}))"
)


def _commit() -> str:
    """HEAD's short hash, `+changes` if files other than the results differ from it."""
    git = lambda *args: subprocess.run(  # noqa: E731
        ["git", *args], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    results = [":!docs/matrix.json", ":!README.md", ":!docs/versions.md"]
    changed = git("status", "--porcelain", "--", ".", *results)
    return (git("rev-parse", "--short", "HEAD") or "unknown") + (
        "+changes" if changed else ""
    )


@nox.session
def lint(session: nox.Session) -> None:
    """`ruff format --check` and `ruff check` over the whole repository."""
    session.install(RUFF)
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """pyright on `bridge/`."""
    session.install("-e", ".", "pyright==1.1.414")
    session.run("pyright", "bridge")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the site with `strict: true` (every warning is an error)."""
    # ruff formats the signatures mkdocstrings shows
    session.install(
        "-e", ".", "mkdocs-material>=9.5", "mkdocstrings-python>=1.16", RUFF
    )
    site = str(session.create_tmp())
    session.run("mkdocs", "build", "--strict", "--site-dir", site, env=_QUIET_MKDOCS)


@nox.session
def examples(session: nox.Session) -> None:
    """Run every `examples/*.py`; any error fails the session."""
    session.install("-e", ".")
    for script in _scripts(session, "examples"):
        session.log(f"--- {script.name}")
        session.run("python", str(script))


@nox.session
def bench(session: nox.Session) -> None:
    """One table of every benchmark's ratios against its goals (`benchmarks/table.py`:
    each `benchmarks/*.py` in its quick form, one at a time; not a default session).
    `nox -s bench -- hf_load many_tensors` runs some; `-- --full hf_load` full size."""
    session.install("-e", ".")
    session.run("python", "benchmarks/table.py", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """Install bridge and run `bridge demo`: freeze, train, port, save and load."""
    session.install(".")
    session.run("bridge", "demo", *session.posargs)
