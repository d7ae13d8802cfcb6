"""Shared test helpers: exact comparisons, and `requires` for newer framework APIs.

**A test that needs a newer API than the oldest flax/equinox in the version matrix**
(`nox -s tests_matrix`) is marked with the feature it needs, so it is skipped where the
feature is missing, with the feature in the reason, and every other test still runs:

    from .helpers import requires

    @requires("NNX")                       # one test
    def test_round_trip(): ...

    pytestmark = requires("NNX")           # every test of a module

    NNX_ONLY = pytest.param("nnx", marks=requires("NNX"))     # one parameter
    @pytest.mark.parametrize("framework", ["linen", NNX_ONLY, "equinox"])

    skip_unless("NNX")                     # inside a test, fixture or model factory

The features are in `FEATURES` (add one there when a test needs a newer API: the
package, the first release that has it, and a check of the API itself, never of the
version number; `tests/test_versions.py` checks the two agree). `tests/models.py`'s
`nnx_*` factories and `equinox_cnn` already call `skip_unless`, so a test built on them
needs no mark; doctests that use NNX are marked by `tests/conftest.py`. A skip reads
`needs <feature> (<package> >= <version>)`: `scripts/matrix_table.py` counts these
skips per feature in the version tables.

To see a new test in the oldest cell (extra arguments: nothing is recorded), run
`nox -s "tests_matrix(flax='0.10.7', equinox='0.11.12', optax='0.2.8')" -- tests/x.py`.
"""

import dataclasses
import gc
import importlib.metadata
import inspect
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
from flax import nnx


# --- features of newer framework releases --------------------------------------------


@dataclasses.dataclass(frozen=True)
class Feature:
    package: str
    version: str
    """The first release of `package` that has the feature."""
    present: Callable[[], bool]
    """Whether the installed `package` has it, checked on the API itself."""


FEATURES = {
    # bridge's NNX adapter: Variable.get_raw_value (0.12.1), nnx.List and nnx.Pytree
    # (0.12.0). Linen and Equinox models work with older flax.
    "NNX": Feature("flax", "0.12.1", lambda: hasattr(nnx.Variable, "get_raw_value")),
    # BatchNorm(mode="batch" | "ema") and its batch_state_index / ema_state_index
    "eqx.nn.BatchNorm(mode=...)": Feature(
        "equinox",
        "0.13.0",
        lambda: "mode" in inspect.signature(eqx.nn.BatchNorm).parameters,
    ),
    # a mesh in context for shardings on an abstract mesh (`jax.sharding.use_mesh`
    # before); jax.make_mesh's `axis_types` is older (keyword-only there)
    "jax.set_mesh": Feature("jax", "0.7.1", lambda: hasattr(jax, "set_mesh")),
    # shard_map as `jax.shard_map` (in jax.experimental before)
    "jax.shard_map": Feature("jax", "0.6.1", lambda: hasattr(jax, "shard_map")),
    # `nnx.eval_shape` gives each abstract array the sharding its Variable's
    # partitioning asks for (flax 0.12.1 shards the value while tracing, and drops it)
    "nnx.eval_shape shardings": Feature("flax", "0.12.4", lambda: _eval_shape_shards()),
    # the reference writer used as an oracle, and the C64, F4, F8_E8M0 and FNUZ codes
    # in safetensors' own reader (bridge reads and writes them with any safetensors)
    "safetensors.TensorSpec": Feature(
        "safetensors", "0.8.0", lambda: hasattr(safetensors, "TensorSpec")
    ),
}


def _eval_shape_shards() -> bool:
    if not (FEATURES["NNX"].present() and FEATURES["jax.set_mesh"].present()):
        return False
    mesh = jax.make_mesh((1,), ("a",), axis_types=(jax.sharding.AxisType.Auto,))
    init = nnx.with_partitioning(nnx.initializers.zeros_init(), (None, "a"))
    with jax.set_mesh(mesh):
        linear = nnx.eval_shape(
            lambda: nnx.Linear(1, 1, kernel_init=init, rngs=nnx.Rngs(0))
        )
    return getattr(linear.kernel.get_raw_value(), "sharding", None) is not None


def missing(*features: str) -> str | None:
    """The skip reason for the `features` the installed packages lack, or None."""
    lacking = [
        f"{name} ({FEATURES[name].package} >= {FEATURES[name].version})"
        for name in features
        if not FEATURES[name].present()
    ]
    return "needs " + " and ".join(lacking) if lacking else None


def requires(*features: str) -> pytest.MarkDecorator:
    """A mark that skips the test unless every one of `features` (keys of `FEATURES`)
    is present: `@requires("NNX")`."""
    reason = missing(*features)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def skip_unless(*features: str) -> None:
    """Skip the running test (or fixture, or model factory) unless every one of
    `features` is present."""
    reason = missing(*features)
    if reason is not None:
        pytest.skip(reason)


def needs_devices(n: int) -> pytest.MarkDecorator:
    """A mark that skips the test unless the default backend has `n` devices: a mesh
    of `jax.devices()`. (On an accelerator machine that is its chips; the eight CPU
    devices of tests/conftest.py are then `jax.devices("cpu")`.)"""
    count = jax.device_count()
    reason = f"needs {n} {jax.default_backend()} devices, jax.device_count() is {count}"
    return pytest.mark.skipif(count < n, reason=reason)


# Properties of host memory (a read that becomes the JAX array without a copy): an
# accelerator's arrays are in its own memory
on_the_cpu = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason=f"about host memory: the default backend is {jax.default_backend()}",
)


# A child process runs on the CPU (tests/conftest.py); orbax refuses a checkpoint saved
# on another topology, whichever side saved it
child_reads_orbax = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="orbax refuses a checkpoint saved on another topology: the command "
    f"runs on the CPU, this process on {jax.default_backend()}",
)


def installed(package: str) -> tuple[int, ...]:
    """The installed version of `package`, as numbers: `(0, 12, 8)`."""
    version = importlib.metadata.version(package)
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


# --- threads -------------------------------------------------------------------------


def in_threads(work: Callable[[int], Any], n: int = 8) -> list[Any]:
    """`[work(0), ..., work(n-1)]`, each run in its own thread, all started at once
    (a barrier); an exception raised in a thread is raised here."""
    start = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            start.wait()
            results[k] = work(k)
        except BaseException as error:  # collected, raised by the calling thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


# --- comparisons ---------------------------------------------------------------------


def check_collector_paused(
    call: Callable[[], Any], during: list, failing: Callable[[], Any], error: type
) -> None:
    """`call()` runs with Python's cyclic garbage collector off (`during`: what a
    function patched inside it saw, `gc.isenabled()` per call) and leaves the
    caller's setting as it was: on, off, and after `failing()` raised `error`."""
    assert gc.isenabled()
    try:
        call()
        assert during == [False] and gc.isenabled()
        gc.disable()  # a caller's choice stays
        call()
        assert not gc.isenabled()
        gc.enable()
        with pytest.raises(error):  # also after an error
            failing()
        assert gc.isenabled()
    finally:
        gc.enable()


def tree_equal_bits(a, b) -> bool:
    """Same structure, same dtypes, same bits (NaNs included)."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb or len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return False
    return True


def fresh(tree):
    """A copy of every array of `tree`: a donating step consumes the copy, and the
    test keeps the arrays it shares with the native model (the oracle's start)."""
    return jax.tree_util.tree_map(jnp.copy, tree)


def tree_allclose(a, b, rtol=1e-5, atol=1e-6) -> bool:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return ta == tb and all(
        np.allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
        for x, y in zip(la, lb)
    )


# --- adapters: zero copy, no mutation, nothing shared --------------------------------

# One array of every dtype the adapters must carry exactly (typed PRNG keys aside).
DTYPES = ("float32", "bfloat16", "float16", "int8", "uint32", "complex64")


def array_of(dtype: str, shape=(2, 3)) -> jax.Array:
    """Distinct, non-trivial bits for `dtype` (NaN-free)."""
    values = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) + 1.5
    if dtype == "complex64":
        return (values + 1j * values).astype(jnp.complex64)
    return values.astype(dtype)


def leaf_objects(obj, is_leaf=None) -> list:
    """The leaves of a pytree, for identity checks (`is`)."""
    return jax.tree_util.tree_leaves(obj, is_leaf=is_leaf)


def same_objects(a: list, b: list) -> bool:
    """Element by element the very same objects (zero copy)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def snapshot(obj):
    """What a pytree is made of: its structure and its leaf objects. Compare two
    snapshots with `==` to see that nothing was replaced or mutated in place."""
    leaves, treedef = jax.tree_util.tree_flatten(obj)
    return treedef, tuple(map(id, leaves)), tuple(_bits(x) for x in leaves)


def _bits(x) -> bytes:
    if not hasattr(x, "dtype"):  # a function, a python number: its identity
        return repr((type(x), id(x))).encode()
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).tobytes()


def key_orders(obj, path=()) -> list:
    """`(path, keys)` of every mapping in a nested structure, keys in their order
    (JAX's treedefs do not see insertion order; a user reading the dict does)."""
    if not isinstance(obj, Mapping):
        return []
    out = [(path, tuple(obj))]
    for key, child in obj.items():
        out += key_orders(child, path + (key,))
    return out


def run_markdown(path) -> str:
    """Run every ```python block of a Markdown page, in order, as one script.

    Returns the code, so a test can check that the page shows what it should.
    """
    path = Path(path)
    code = "\n".join(re.findall(r"```python\n(.*?)```", path.read_text(), re.S))
    exec(compile(code, str(path), "exec"), {"__name__": "page"})
    return code


def randomized(module, seed: int):
    """`module` (a torch module) with every parameter drawn from a normal
    distribution (seeded), in evaluation mode: a port of it cannot be right by
    chance."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    return module.eval()


def load_strict(module, state) -> None:
    """`module.load_state_dict(state, strict=True)` for a state of arrays (a
    port's or export's, NumPy or JAX): every key taken, none left over."""
    import torch

    module.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}, strict=True
    )


def export(path, model, **kwargs):
    """`model` in PyTorch layout at `path` by the call a user picks from its name:
    `bridge.save_state_dict` for a `*.safetensors` file, `bridge.save_pretrained`
    for a folder (tests that refuse or write both alike)."""
    import bridge

    if str(path).endswith(".safetensors"):
        return bridge.save_state_dict(path, model, **kwargs)
    return bridge.save_pretrained(path, model, **kwargs)


def script(name: str) -> Any:
    """The module of `scripts/<name>.py` (the scripts are no package), imported
    once."""
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module
