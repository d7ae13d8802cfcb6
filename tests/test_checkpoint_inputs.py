# ruff: noqa: E501  (one case a line reads best)
"""Bad API inputs (TypeError / ValueError naming the argument), dtypes a format cannot
store, and structures that must save: empty Linen sub-dicts, Equinox dicts of layers."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bridge


FORMATS = ["m.safetensors", "m.msgpack", "ckpt"]
VARIABLES = {"params": {"a": np.ones(2, np.float32)}}


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda p: bridge.save(123, VARIABLES),
            TypeError,
            r"`path` must be a str or os\.PathLike, got int",
        ),
        (
            lambda p: bridge.save(None, VARIABLES),
            TypeError,
            r"`path` must be a str.*NoneType",
        ),
        (
            lambda p: bridge.save("", VARIABLES),
            ValueError,
            r"`path` must name a file or directory, got ''",
        ),
        (
            lambda p: bridge.load(b"x", like=None),
            TypeError,
            r"`path` must be a str.*bytes",
        ),
        (lambda p: bridge.load(3.5), TypeError, r"`path` must be a str.*float"),
        (
            lambda p: bridge.save(p, 3),
            TypeError,
            r"does not know how to convert `obj`, a int",
        ),
        (
            lambda p: bridge.save(p, VARIABLES, metadata=[("a", "b")]),
            TypeError,
            r"`metadata` must be a dict of strings to strings, got a list",
        ),
        (
            lambda p: bridge.save(p, VARIABLES, metadata={"a": 1}),
            TypeError,
            r"`metadata` must map strings to strings.*'a': 1",
        ),
        (
            lambda p: bridge.save(p, VARIABLES, metadata={1: "a"}),
            TypeError,
            r"`metadata` must map strings to strings.*1: 'a'",
        ),
        (
            lambda p: bridge.load(p, like="model"),
            TypeError,
            r"does not know how to convert `like`, a str",
        ),
    ],
)
def test_wrong_inputs_name_the_argument(tmp_path, call, error, match):
    path = tmp_path / "m.safetensors"
    bridge.save(path, VARIABLES)
    with pytest.raises(error, match=match):
        call(path)


@pytest.mark.parametrize(
    "name, dtype, others",
    [
        ("m.safetensors", "complex128", "msgpack, orbax"),
        ("m.safetensors", "int4", "msgpack, orbax"),
        ("ckpt", "float8_e4m3", "msgpack"),
        ("ckpt", "uint4", "msgpack"),
        ("m.msgpack", "<U1", "none"),
        ("ckpt", "object", "none"),
    ],
)
def test_save_refuses_what_it_cannot_load_back(tmp_path, name, dtype, others):
    array = (
        np.zeros(2, dtype)
        if dtype not in ("<U1", "object")
        else np.array(["x", "y"], dtype)
    )
    with pytest.raises(
        ValueError, match=rf"(?s)cannot store x \({dtype}\).*: {others}\."
    ):
        bridge.save(tmp_path / name, {"params": {"x": array}})
    assert list(tmp_path.iterdir()) == []


def test_every_dtype_a_format_accepts_round_trips(tmp_path):
    """The dtype tables are true: each format gives back, bit for bit, every dtype it
    accepts (small valid values for each)."""
    from bridge._io._contents import DTYPE_NAMES
    from bridge._io._format import formats

    for fmt in formats():
        if fmt.dtypes == frozenset():  # read only (GGUF): nothing to round trip
            continue
        name = f"m{fmt.suffixes[0]}" if fmt.suffixes else "ckpt"
        accepted = sorted(DTYPE_NAMES if fmt.dtypes is None else fmt.dtypes)
        variables = {"params": {d: np.arange(4).astype(jnp.dtype(d)) for d in accepted}}
        bridge.save(tmp_path / name, variables)
        back = bridge.load(tmp_path / name, like=variables)["params"]
        for d in accepted:
            got, want = np.asarray(back[d]), variables["params"][d]
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (
                fmt.name,
                d,
            )


def test_linen_keeps_empty_sub_dicts():
    variables = {"params": {"a": {}, "b": jnp.ones(2), "c": {"d": {}}}}
    assert bridge.to_linen(bridge.from_linen(variables)) == variables


@pytest.mark.parametrize("name", FORMATS)
def test_linen_empty_sub_dicts_through_a_file(tmp_path, name):
    variables = {"params": {"a": {}, "b": jnp.ones(2)}}
    bridge.save(tmp_path / name, variables)
    back = bridge.load(tmp_path / name, like=variables)
    assert list(back["params"]) == ["a", "b"] and back["params"]["a"] == {}


class DictOfLayers(eqx.Module):
    layers: dict

    def __init__(self, seed):
        k1, k2 = jax.random.split(jax.random.key(seed))
        self.layers = {
            "b": eqx.nn.Linear(2, 3, key=k1),
            "a": eqx.nn.Linear(3, 2, key=k2),
        }

    def __call__(self, x):
        return self.layers["a"](self.layers["b"](x))


@pytest.mark.parametrize("name", FORMATS)
def test_equinox_model_holding_a_dict_of_layers(tmp_path, name):
    model = DictOfLayers(0)
    bridge.save(tmp_path / name, model)
    back = bridge.load(tmp_path / name, like=DictOfLayers(1))
    x = jnp.ones(2)
    np.testing.assert_array_equal(back(x), model(x))
    tree = bridge.load(tmp_path / name)
    assert tree.layers["a"].weight.shape == (2, 3)


@pytest.mark.parametrize(
    "name, words",
    [
        ("model.pt", "a PyTorch pickle"),
        ("model.bin", "a PyTorch pickle"),
        ("model.pth", "a PyTorch pickle"),
        ("model.ckpt", "a pickle"),
        ("model.npz", "numpy's archive"),
        ("model.h5", "HDF5"),
        ("model.safetensor", "did you mean model.safetensors?"),
        ("model.gguf", "reads gguf files (.gguf) but writes none"),
    ],
)
def test_save_refuses_a_suffix_it_would_write_as_a_directory(tmp_path, name, words):
    """`bridge.save("model.pt", model)` wrote an orbax directory named model.pt, which
    `bridge.load` then refused as a pickle: refused before anything is written, as
    `bridge convert` refuses it, naming what bridge writes."""
    with pytest.raises(
        ValueError,
        match=rf"(?s){name}: bridge .*{re.escape(words)}.*orbax directory for a name without a suffix",
    ):
        bridge.save(tmp_path / name, VARIABLES)
    assert list(tmp_path.iterdir()) == []


def test_save_takes_a_directory_name_with_a_number_after_a_dot(tmp_path):
    """`runs/lr0.001` names a directory, not a kind of file."""
    bridge.save(tmp_path / "lr0.001", VARIABLES)
    assert bridge.load(tmp_path / "lr0.001").a.shape == (2,)


@pytest.mark.parametrize("strict", ["false", 0, None])
def test_load_refuses_a_strict_that_is_not_a_bool(tmp_path, strict):
    """`strict="false"` was taken as True, and the error then said 'pass
    strict=False'."""
    bridge.save(tmp_path / "m.safetensors", VARIABLES)
    with pytest.raises(TypeError, match="`strict` must be True or False"):
        bridge.load(tmp_path / "m.safetensors", like=VARIABLES, strict=strict)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(
    "variables, where",
    [
        ({"params": {"": {}}}, r"'params' \[''\]"),
        ({"params": {"a": {}, "": np.ones(2, np.float32)}}, r"'params' \[''\]"),
        ({"params": {"a": {"": np.ones(2, np.float32)}}}, r"'params' \['a', ''\]"),
        ({"": {"a": np.ones(2, np.float32)}}, r"'' \['a'\]"),
    ],
)
def test_an_empty_key_is_refused_at_save_naming_it(tmp_path, name, variables, where):
    """What `save` writes, `load` reads: a Linen dict with an empty-string key (a
    collection, a module, an array) was saved and then refused by `load` ("a dict
    key '' is not a name"). `save` refuses it, naming the role and path, and
    writes nothing."""
    with pytest.raises(ValueError, match=rf"(?s)these \(role, path\) are not: {where}"):
        bridge.save(tmp_path / name, variables)
    assert list(tmp_path.iterdir()) == []
