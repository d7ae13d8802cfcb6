"""Reading only a process's part of a layer (bridge/_port/_ranges.py), in one process:
the 8 CPU devices' shardings are made to look as if they spanned other processes, so
that the reads by element runs are taken; the 2-process test
(tests/test_hf_folder_processes.py) counts the bytes each process reads. A conversion
that is not an element move is read whole (None here)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from jax.sharding import NamedSharding, PartitionSpec as P

from bridge._io import _read
from bridge._port._ranges import converted_by_ranges

from .helpers import needs_devices


pytestmark = needs_devices(8)  # every test cuts a layer over an 8-device mesh


@pytest.fixture
def spanning(monkeypatch):
    """NamedShardings on this process's devices, as if they spanned others."""
    monkeypatch.setattr(
        NamedSharding, "is_fully_addressable", property(lambda s: False)
    )


def _lazy(tmp_path):
    weight = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 7  # (out, in)
    bias = np.arange(16, dtype=np.float32) - 3
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"weight": weight, "bias": bias}, path)
    lazy = _read.lazy(_read.open_checkpoint(path))
    assert lazy is not None
    return lazy, weight, bias


def _target(spec, shape):
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))


def _same(array, expected):
    return all(
        np.array_equal(s.data, expected[s.index]) for s in array.addressable_shards
    )


@pytest.mark.parametrize("spec", [P("fsdp", None), P(None, "fsdp")])
def test_a_transposed_layer_from_element_runs(tmp_path, spanning, spec):
    lazy, weight, bias = _lazy(tmp_path)

    def convert(leaves):  # Dense: kernel (in, out), bias as is
        return {"kernel": jnp.transpose(leaves["weight"]), "bias": leaves["bias"]}

    targets = {"kernel": _target(spec, (8, 16)), "bias": _target(P("fsdp"), (16,))}
    sources = {"weight": lazy["weight"], "bias": lazy["bias"]}
    out = converted_by_ranges(sources, convert, targets, str)
    assert out is not None
    assert _same(out["kernel"], weight.T) and _same(out["bias"], bias)
    assert out["kernel"].sharding.spec == spec


@pytest.mark.parametrize(
    "convert",
    [
        lambda leaves: {"kernel": leaves["weight"].T * 2},  # computes
        lambda leaves: {"kernel": leaves["weight"].T - leaves["weight"].T},  # zeros
        lambda leaves: {
            "kernel": jnp.concatenate(
                [leaves["weight"].T[:3], jnp.ones((5, 16), jnp.int32)]
            )
        },
    ],
    ids=["scaled", "computed", "filled"],
)
def test_a_conversion_that_is_no_move_is_read_whole(tmp_path, spanning, convert):
    lazy, _, _ = _lazy(tmp_path)
    targets = {"kernel": _target(P("fsdp", None), (8, 16))}
    assert (
        converted_by_ranges({"weight": lazy["weight"]}, convert, targets, str) is None
    )


def test_only_across_processes(tmp_path):
    """In one process (every device addressable) the layer is read whole."""
    lazy, _, _ = _lazy(tmp_path)
    targets = {"kernel": _target(P("fsdp", None), (8, 16))}
    convert = lambda leaves: {"kernel": leaves["weight"].T}  # noqa: E731
    assert (
        converted_by_ranges({"weight": lazy["weight"]}, convert, targets, str) is None
    )
