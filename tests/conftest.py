import os
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

import jax  # noqa: E402


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


def pytest_collection_modifyitems(config, items):
    """Doctests that build NNX modules need bridge's NNX adapter: skip them, naming
    the feature, with a flax that lacks it (tests are marked with `requires`)."""
    from _pytest.doctest import DoctestItem

    from .helpers import requires

    for item in items:
        if isinstance(item, DoctestItem) and any(
            "nnx." in example.source for example in item.dtest.examples
        ):
            item.add_marker(requires("NNX"))
