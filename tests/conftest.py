import os


# Eight CPU devices for the sharding tests; must be set before JAX starts a backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402


jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_num_cpu_devices", 8)


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
