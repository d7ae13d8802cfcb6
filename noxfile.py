"""Every check `bridge` has, one nox session each; `.ci/run` runs some of them.

`pip install nox uv`, then `nox -s tests` (the default), `nox -s demo`, `nox -l` for the
list. Each session installs everything it needs in its own fresh virtualenv (made by uv
when it is installed, by virtualenv otherwise).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import nox


nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests"]
nox.options.error_on_external_run = True

ROOT = Path(__file__).parent
# The fast suite: the tests and the docstring examples of the package.
PYTEST = ["pytest", "-q", "tests", "bridge", "--doctest-modules"]

# The oldest versions pyproject.toml claims: keep in sync with pyproject.toml.
FLOOR = [
    "jax==0.8.1",
    "jaxlib==0.8.1",
    "flax==0.12.1",
    "equinox==0.13.1",
    "optax==0.2.5",
    "numpy==2.0.0",
    "safetensors==0.4.3",
    "orbax-checkpoint==0.11.17",
    "rich==13.0.0",
]

# `tests_matrix`: the newest release of each minor line. Each flax line is paired with
# a jax it runs on (flax 0.11 imports `jax._src.core.mutable_array`, which jax 0.10 no
# longer has: it gets the jax 0.7 of its time; flax 0.12.1, the floor, gets the jax
# 0.8.1 it needs; flax 0.12.8 requires jax >= 0.10); the installer picks the rest.
FLAX = {"0.11.2": "jax<0.8", "0.12.1": "jaxlib==0.8.1", "0.12.8": "jax>=0.10"}
EQUINOX = ["0.12.2", "0.13.8"]
# Combinations that cannot work, with the reason (they are skipped, never dropped).
_NO_LIST = (
    "flax 0.11 has no nnx.List (new in 0.12), which NNX models with layer lists need"
)
BROKEN = {
    ("0.11.2", "0.12.2"): _NO_LIST,
    ("0.11.2", "0.13.8"): _NO_LIST,
    ("0.12.1", "0.12.2"): (
        "equinox 0.12's BatchNorm has no `mode` argument (batch/ema, new in 0.13), "
        "which the BatchNorm codec and State tests need (run: 51 failed, 342 passed); "
        "it also imports jax.interpreters.batching.NotMapped, deprecated in jax 0.8"
    ),
    ("0.12.8", "0.12.2"): (
        "flax 0.12.8 needs jax >= 0.10, which removed "
        "jax.interpreters.batching.NotMapped, used by equinox 0.12.2 at import"
    ),
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


@nox.session
def tests(session: nox.Session) -> None:
    """The fast suite (`-m "not slow"`) and the doctests, on the newest releases."""
    session.install("--upgrade", "-e", ".[test]")
    session.run(*PYTEST, "-m", "not slow", *session.posargs)


@nox.session
def tests_slow(session: nox.Session) -> None:
    """The tests marked `slow`, on the newest releases."""
    session.install("--upgrade", "-e", ".[test]")
    session.run("pytest", "-q", "tests", "-m", "slow", *session.posargs)


@nox.session
def tests_floor(session: nox.Session) -> None:
    """The fast suite on the oldest versions pyproject.toml claims."""
    session.install("-e", ".[test]", *FLOOR)
    session.run(*PYTEST, "-m", "not slow", *session.posargs)


@nox.session
@nox.parametrize("flax", list(FLAX))
@nox.parametrize("equinox", EQUINOX)
def tests_matrix(session: nox.Session, flax: str, equinox: str) -> None:
    """The fast suite on each flax x equinox pair; the README table records results."""
    reason = BROKEN.get((flax, equinox))
    if reason:
        session.skip(reason)
    # Outside pyproject's bounds on purpose: the matrix is how the bounds are found.
    others = _requirements(without=("flax", "equinox"))
    session.install(*others, f"flax=={flax}", f"equinox=={equinox}", FLAX[flax])
    session.install("--no-deps", "-e", ".")
    session.run(
        "python", "-c", "import jax, optax; print(jax.__version__, optax.__version__)"
    )
    session.run(*PYTEST, "-m", "not slow", *session.posargs)


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
    """Run every `benchmarks/*.py` with `--quick`; each prints its timing ratios."""
    session.install("-e", ".")
    for script in _scripts(session, "benchmarks"):
        session.log(f"--- {script.name}")
        session.run("python", str(script), "--quick")


@nox.session
def demo(session: nox.Session) -> None:
    """Install bridge and run `bridge demo`: freeze, train, port, save and load."""
    session.install(".")
    session.run("bridge", "demo", *session.posargs)
