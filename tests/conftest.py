import ast
import os
import re
from pathlib import Path


# Eight CPU devices for the sharding tests; must be set before JAX starts a backend.
# XLA's own flags otherwise, as users run (its LLVM backend at optimisation level 0 was
# tried: no gain on the whole fast suite, see README). A user's XLA_FLAGS wins.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Every compiled program in JAX's persistent cache, however small: the tests compile
# thousands of small eager ops (90 ms of CPU each, 16 ms from the cache), which the
# pytest-xdist workers, the subprocesses of the CLI tests (they inherit these
# variables) and the next run share. Delete the folder at any time; set
# JAX_COMPILATION_CACHE_DIR to put it elsewhere.
_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE / "bridge-tests-jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Keras 3 runs on JAX in every test that imports it (bridge reads no other backend)
os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import pytest  # noqa: E402


jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_num_cpu_devices", 8)
# (again: a plugin may have imported jax before the variables were set)
_env = os.environ
jax.config.update("jax_compilation_cache_dir", _env["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(_env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)
jax.config.update(
    "jax_persistent_cache_min_entry_size_bytes",
    int(_env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]),
)
# The processes the tests start (the CLI, pasted pages) run on the CPU: on an
# accelerator machine this process holds the chip, and a second one cannot open it.
# (JAX read JAX_PLATFORMS at its import above: this process keeps the accelerator.)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# (and the TPU runtime's warning at their `import jax` stays off their stderr)
_quiet = "ignore:Transparent hugepages are not enabled:UserWarning"
os.environ["PYTHONWARNINGS"] = ",".join(
    w for w in (os.environ.get("PYTHONWARNINGS"), _quiet) if w
)
# a plan folds at the terminal's width (`Plan.__str__`): the doctests and tests read
# it at bridge's own default, whatever terminal (or none) runs them
os.environ["COLUMNS"] = "100"
if jax.default_backend() != "cpu":
    # The tests compare float32 results with the frameworks' own at a CPU's float32
    # accuracy; an accelerator multiplies float32 matrices in bfloat16 passes by
    # default (about 3 digits), "highest" gives about 7.
    jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    """Doctests that build NNX modules need bridge's NNX adapter: skip them, naming
    the feature, with a flax that lacks it (tests are marked with `requires`).
    Doctests that import an optional framework (Haiku, Keras) are skipped without
    it (`nox -s tests_haiku_keras` runs them)."""
    import importlib.util

    from _pytest.doctest import DoctestItem

    from .helpers import requires

    for item in items:
        if not isinstance(item, DoctestItem):
            continue
        source = "".join(example.source for example in item.dtest.examples)
        if "nnx." in source:
            item.add_marker(requires("NNX"))
        for package in _OPTIONAL_FRAMEWORKS:
            imports = re.search(rf"^\s*(import|from) [^\n]*\b{package}\b", source, re.M)
            if imports and not importlib.util.find_spec(package):
                reason = f"needs {package} (nox -s tests_haiku_keras installs it)"
                item.add_marker(pytest.mark.skip(reason=reason))


# optional frameworks whose docstring examples run only where they are installed
_OPTIONAL_FRAMEWORKS = ("haiku", "keras")


# What only `nox -s tests_torch` installs (its TORCH and QUANT lists, and what they
# bring): a test skipped for lack of one runs in that session or in none
_TORCH_SESSION_ONLY = re.compile(
    r"could not import '(torch|transformers|peft|qwix|gguf|compressed_tensors|"
    r"huggingface_hub)\b"
)


def _torch_session_files() -> set[str]:
    """The test files `nox -s tests_torch`, `nox -s tests_public` and `nox -s
    tests_public_code` run (TORCH_TESTS, PUBLIC_TESTS and PUBLIC_CODE_TESTS in
    noxfile.py)."""
    noxfile = ast.parse((Path(__file__).parents[1] / "noxfile.py").read_text())
    return {
        file
        for node in noxfile.body
        if isinstance(node, ast.Assign)
        and [t.id for t in node.targets if isinstance(t, ast.Name)]
        in (["TORCH_TESTS"], ["PUBLIC_TESTS"], ["PUBLIC_CODE_TESTS"])
        for file in ast.literal_eval(node.value)
    }


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test skipped for lack of torch (or another package only `tests_torch`
    installs) fails unless that session runs it: its file is in TORCH_TESTS, or it is
    marked `torch`. Otherwise it would run in no session at all."""
    report = yield
    if (
        report.skipped
        and call.excinfo is not None
        and _TORCH_SESSION_ONLY.match(str(call.excinfo.value))
        and item.get_closest_marker("torch") is None
        and item.path.relative_to(item.config.rootpath).as_posix()
        not in _torch_session_files()
    ):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} was skipped ({call.excinfo.value}), and no nox session "
            "that has that package runs it: mark it @pytest.mark.torch (`nox -s "
            "tests_torch` runs those) or add its file to TORCH_TESTS in noxfile.py"
        )
    return report
