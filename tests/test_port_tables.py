"""Stored sinusoidal position tables that the other side computes (issue #37):
recognised by their values (`bridge._families._sinusoid`), refused with
`strict=True` ("computed by the target/source"), left out (or kept) with
`strict=False` and listed in their own category of the report; a learned table of
the same shape stays an unexpected or missing layer. PyTorch's side (an
`nn.Embedding` holding the table, as transformers' Marian does): the tests marked
`torch`."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy as safetensors_numpy
from flax import linen as nn, nnx

import bridge
from bridge._cli import main
from bridge._families._sinusoid import VARIANTS, sinusoid

from .helpers import export, requires


POSITIONS, DIM = 8, 4
TABLE = VARIANTS["halves"](POSITIONS, DIM).astype(np.float32)
X = np.random.default_rng(0).normal(size=(2, 5, DIM)).astype(np.float32)


# --- recognising a table by its values -----------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_each_variant_is_recognised_in_each_dtype(variant, dtype):
    table = jnp.asarray(VARIANTS[variant](512, 64), dtype)
    assert sinusoid(table) == variant
    assert sinusoid(np.asarray(table)) == variant


def test_transformers_tables_as_they_compute_them():
    """The formulas as transformers 4.57 writes them (Marian's `_init_weight` and
    Flax `create_sinusoidal_positions`: float64 numpy; M2M-100's `get_embedding`:
    float32, padding row zero; DistilBERT's interleaved table)."""
    n, dim = 64, 12
    angles = np.array(
        [
            [p / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)]
            for p in range(n)
        ]
    )
    marian = np.empty((n, dim), np.float32)
    marian[:, : dim // 2] = np.sin(angles[:, 0::2])
    marian[:, dim // 2 :] = np.cos(angles[:, 1::2])
    distil = np.empty((n, dim), np.float32)
    distil[:, 0::2], distil[:, 1::2] = np.sin(angles[:, 0::2]), np.cos(angles[:, 1::2])
    half = dim // 2
    freq = np.exp(np.arange(half, dtype=np.float32) * -np.float32(np.log(1e4) / 5))
    times = np.arange(n, dtype=np.float32)[:, None] * freq[None]
    m2m = np.concatenate([np.sin(times), np.cos(times)], 1).astype(np.float32)
    m2m[1] = 0  # padding_idx
    assert sinusoid(marian) == "halves"
    assert sinusoid(distil) == "interleaved"
    assert sinusoid(m2m) == "tensor2tensor"


def test_other_arrays_are_no_table():
    """A learned table (the sinusoid trained, even slightly; random), two rows of
    zeros, integers, another rank, an abstract array: None."""
    rng = np.random.default_rng(0)
    assert sinusoid(TABLE + np.float32(1e-3) * rng.normal(size=TABLE.shape)) is None
    assert sinusoid(rng.normal(size=TABLE.shape).astype(np.float32)) is None
    two = TABLE.copy()
    two[[1, 2]] = 0
    assert sinusoid(two) is None
    one = TABLE.copy()
    one[1] = 0
    assert sinusoid(one) == "halves"
    assert sinusoid(np.zeros((8, 4), np.float32)) is None
    assert sinusoid(TABLE.astype(np.int32)) is None
    assert sinusoid(TABLE[None]) is None
    assert sinusoid(jax.ShapeDtypeStruct(TABLE.shape, jnp.float32)) is None


def _spoiled(table, how):
    """`table` with NaN everywhere, NaN from row 5 on (past the rows read first),
    one NaN row, or one +inf or -inf row."""
    out = np.array(table)
    if how == "all nan":
        out[:] = np.nan
    elif how == "nan from row 5":
        out[5:] = np.nan
    elif how == "one nan row":
        out[6] = np.nan
    elif how == "one nan":
        out[2, 1] = np.nan
    else:
        out[3] = {"inf row": np.inf, "-inf row": -np.inf}[how]
    return out


SPOILED = ["all nan", "nan from row 5", "one nan row", "one nan", "inf row", "-inf row"]


@pytest.mark.parametrize("how", SPOILED)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nan_or_inf_is_no_table(how, dtype):
    """A comparison with NaN is false: a NaN "missed" no row of the formula and a
    table of NaN was one. Only finite values equal to the formula are a table."""
    table = jnp.asarray(_spoiled(VARIANTS["halves"](64, 16), how), dtype)
    assert sinusoid(table) is None
    assert sinusoid(np.asarray(table)) is None


# --- JAX models: one stores the table, the other computes it -------------------


class Stored(nnx.Module):
    """Stores the table (as Flax Whisper's `embed_positions` does)."""

    def __init__(self, table, rngs):
        self.embed_positions = nnx.Embed(POSITIONS, DIM, rngs=rngs)
        self.embed_positions.embedding[...] = jnp.asarray(table)
        self.proj = nnx.Linear(DIM, 3, rngs=rngs)

    def __call__(self, x):
        return self.proj(x + self.embed_positions.embedding[None, : x.shape[1]])


class Computed(nn.Module):
    """Computes the table (as transformers' Flax Marian does): no array for it."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="proj")(x + jnp.asarray(TABLE)[None, : x.shape[1]])


def _computed():
    module = Computed()
    return module, module.init(jax.random.key(1), X)


@requires("NNX")
def test_a_stored_table_the_target_computes_is_refused_then_left_out(caplog):
    source, target = Stored(TABLE, nnx.Rngs(0)), _computed()
    with pytest.raises(
        bridge.PortError,
        match=r"computed by the target: source layer \.embed_positions \(Embed: "
        r"embedding \(8, 4\)\) is a stored sinusoidal position table \(halves\), "
        r"which the target computes \(it has no array for it\); pass strict=False "
        r"to leave it out\.",
    ):
        bridge.port(source, target)
    with caplog.at_level("INFO", logger="bridge"):
        (module, variables), report = bridge.port(
            source, target, strict=False, report=True
        )
    assert report.computed_by_target == (".embed_positions",)
    assert report.unexpected == () and report.missing == () and report.complete
    assert "Computed by the target (stored sinusoidal position tables, left out): " in (
        caplog.text
    )
    np.testing.assert_allclose(module.apply(variables, X), source(X), atol=1e-6)
    plan = bridge.port_plan(source, target)
    assert plan.computed_by_target == (".embed_positions",) and not plan.unexpected
    assert "computed by the target (stored tables, left out):" in str(plan)


@requires("NNX")
def test_a_target_table_the_source_computes_keeps_its_values():
    source, target = _computed(), Stored(TABLE, nnx.Rngs(2))
    with pytest.raises(
        bridge.PortError,
        match=r"computed by the source: target layer \.embed_positions .* holds a "
        r"sinusoidal position table \(halves\), which the source computes .*; pass "
        r"strict=False to keep its values\.",
    ):
        bridge.port(source, target)
    ported, report = bridge.port(source, target, strict=False, report=True)
    assert report.computed_by_source == (".embed_positions",) and report.complete
    assert report.missing == ()
    np.testing.assert_array_equal(ported.embed_positions.embedding[...], TABLE)
    module, variables = source
    np.testing.assert_allclose(ported(X), module.apply(variables, X), atol=1e-6)


@requires("NNX")
def test_a_learned_table_is_never_dropped_as_computed():
    """The same layers with a learned table (the sinusoid plus what training moved):
    unexpected (refused, or reported as unused), missing on the other side."""
    learned = TABLE + np.float32(0.01) * np.random.default_rng(1).normal(
        size=TABLE.shape
    ).astype(np.float32)
    source = Stored(learned, nnx.Rngs(0))
    with pytest.raises(bridge.PortError, match=r"unexpected: source layer \.embed_p"):
        bridge.port(source, _computed())
    _, report = bridge.port(source, _computed(), strict=False, report=True)
    assert report.unexpected == (".embed_positions",)
    assert report.computed_by_target == () and not report.complete
    with pytest.raises(bridge.PortError, match=r"missing: target layer \.embed_pos"):
        bridge.port(_computed(), Stored(learned, nnx.Rngs(2)))
    _, report = bridge.port(
        _computed(), Stored(learned, nnx.Rngs(2)), strict=False, report=True
    )
    assert report.missing == (".embed_positions",) and report.computed_by_source == ()


@requires("NNX")
@pytest.mark.parametrize("how", SPOILED)
def test_a_nan_table_is_never_dropped_nor_called_computed(how):
    """A stored table of NaN (or inf) where the target computes one: unexpected
    (refused, or reported as unused with `strict=False`), never "computed by the
    target" and left out."""
    source = Stored(_spoiled(TABLE, how), nnx.Rngs(0))
    with pytest.raises(bridge.PortError, match=r"unexpected: source layer \.embed_p"):
        bridge.port(source, _computed())
    _, report = bridge.port(source, _computed(), strict=False, report=True)
    assert report.unexpected == (".embed_positions",)
    assert report.computed_by_target == () and not report.complete


@requires("NNX")
def test_load_strict_false_leaves_a_stored_table_out(tmp_path):
    source = Stored(TABLE, nnx.Rngs(0))
    path = tmp_path / "stored.safetensors"
    bridge.save(path, source)
    with pytest.raises(bridge.PortError, match=r"computed by the target: source lay"):
        bridge.load(path, like=_computed())
    (module, variables), report = bridge.load(
        path, like=_computed(), strict=False, report=True
    )
    assert report.computed_by_target == (".embed_positions",) and report.complete
    np.testing.assert_allclose(module.apply(variables, X), source(X), atol=1e-6)


# --- in a stack of layers (nn.scan): read per slice ------------------------------

LAYERS = 3


class _StoredBlock(nn.Module):
    """Holds a table per layer: a loose array, or an `nn.Embed`'s."""

    table: np.ndarray
    form: str

    @nn.compact
    def __call__(self, x, _):
        init = lambda *_: jnp.asarray(self.table)  # noqa: E731
        if self.form == "loose":
            table = self.param("positions", init)
        else:
            table = nn.Embed(POSITIONS, DIM, embedding_init=init, name="positions")
            table = table.embedding
        return jnp.tanh(nn.Dense(DIM, name="proj")(x + table[None, : x.shape[1]])), None


class _ComputedBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        table = jnp.asarray(TABLE)[None, : x.shape[1]]
        return jnp.tanh(nn.Dense(DIM, name="proj")(x + table)), None


class _Scanned(nn.Module):
    block: Any
    fields: tuple = ()

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(
            self.block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=LAYERS,
        )
        return scan(*self.fields, name="blocks")(x, None)[0]


def _scanned(block, *fields):
    module = _Scanned(block, fields)
    return module, module.init(jax.random.key(3), X)


def _apply(model):
    module, variables = model
    return np.asarray(module.apply(variables, X))


def _stored(form, tables):
    """A scanned model holding `tables[i]` in layer `i`."""
    module, variables = _scanned(_StoredBlock, TABLE, form)
    stacked = jnp.asarray(np.stack(tables))
    blocks = dict(variables["params"]["blocks"])
    blocks["positions"] = stacked if form == "loose" else {"embedding": stacked}
    return module, {"params": {**variables["params"], "blocks": blocks}}


_WHERE = {
    "loose": (".blocks.positions",),
    "embed": tuple(f".blocks[{i}].positions" for i in range(LAYERS)),
}


@pytest.mark.parametrize("form", ["loose", "embed"])
def test_stacked_tables_the_target_computes(form):
    source, target = _stored(form, [TABLE] * LAYERS), _scanned(_ComputedBlock)
    variant = "halves, each of 3 layers" if form == "loose" else "halves"
    with pytest.raises(bridge.PortError) as error:
        bridge.port(source, target)
    message = str(error.value)
    for where in _WHERE[form]:
        assert f"computed by the target: source layer {where} (" in message
    assert f"sinusoidal position table ({variant})" in message
    assert "in no layer bridge knows" not in message  # no wrapper to blame
    ported, report = bridge.port(source, target, strict=False, report=True)
    assert report.computed_by_target == _WHERE[form] and report.complete
    np.testing.assert_allclose(_apply(ported), _apply(source), atol=1e-6)


@pytest.mark.parametrize("form", ["loose", "embed"])
def test_stacked_tables_the_source_computes_keep_their_values(form):
    source, target = _scanned(_ComputedBlock), _stored(form, [TABLE] * LAYERS)
    with pytest.raises(bridge.PortError, match="computed by the source: target lay"):
        bridge.port(source, target)
    ported, report = bridge.port(source, target, strict=False, report=True)
    assert report.computed_by_source == _WHERE[form] and report.complete
    kept = ported[1]["params"]["blocks"]["positions"]
    kept = kept if form == "loose" else kept["embedding"]
    np.testing.assert_array_equal(np.asarray(kept), np.stack([TABLE] * LAYERS))
    np.testing.assert_allclose(_apply(ported), _apply(source), atol=1e-6)


@pytest.mark.parametrize("form", ["loose", "embed"])
def test_a_stacked_table_trained_in_one_layer_is_not_dropped(form):
    trained = TABLE + np.float32(0.01) * np.random.default_rng(1).normal(
        size=TABLE.shape
    ).astype(np.float32)
    source = _stored(form, [TABLE, trained, TABLE])
    _, report = bridge.port(source, _scanned(_ComputedBlock), strict=False, report=True)
    if form == "loose":  # one array: a table only if every slice is
        assert report.unexpected == (".blocks.positions",)
        assert report.computed_by_target == ()
    else:  # a layer per slice: each told apart
        assert report.unexpected == (".blocks[1].positions",)
        assert report.computed_by_target == (
            ".blocks[0].positions",
            ".blocks[2].positions",
        )


# --- PyTorch: an nn.Embedding holding the table ---------------------------------


def _torch_model(table):
    torch = pytest.importorskip("torch")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_positions = torch.nn.Embedding(POSITIONS, DIM)
            self.embed_positions.weight = torch.nn.Parameter(
                torch.tensor(table), requires_grad=False
            )
            self.proj = torch.nn.Linear(DIM, 3)

        def forward(self, x):
            return self.proj(x + self.embed_positions.weight[: x.shape[1]])

    return Model()


def _run_torch(model):
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        return model(torch.from_numpy(X)).numpy()


@pytest.mark.torch
def test_torch_table_into_a_flax_model_that_computes_it():
    torch_model = _torch_model(TABLE)
    with pytest.raises(bridge.PortError, match=r"computed by the target: .*\(halves"):
        bridge.port(torch_model, _computed(), example=(X,))
    (module, variables), report = bridge.port(
        torch_model, _computed(), example=(X,), strict=False, report=True
    )
    assert report.computed_by_target == (".embed_positions",) and report.complete
    np.testing.assert_allclose(
        module.apply(variables, X), _run_torch(torch_model), atol=1e-6
    )


@pytest.mark.torch
def test_flax_into_a_torch_model_keeps_its_table():
    source = _computed()
    target = _torch_model(TABLE)
    with pytest.raises(bridge.PortError, match=r"computed by the source: target la"):
        bridge.port(source, target, example=(X,))
    state, report = bridge.port(source, target, example=(X,), strict=False, report=True)
    assert report.computed_by_source == (".embed_positions",) and report.complete
    target.load_state_dict(state, strict=True)
    module, variables = source
    np.testing.assert_allclose(
        _run_torch(target), module.apply(variables, X), atol=1e-6
    )


@pytest.mark.torch
@pytest.mark.parametrize("into", ["model.safetensors", "folder"])
def test_save_like_a_torch_model_writes_its_table_with_strict_false(tmp_path, into):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / into
    like = _torch_model(TABLE)
    with pytest.raises(
        ValueError,
        match=r"computed by the model: embed_positions\.weight \(8, 4\) is in the "
        r"reference, a stored sinusoidal position table \(halves\), which the model "
        r"computes \(it has no array for it\); pass strict=False to write the "
        r"reference's table",
    ):
        export(path, _computed(), like=like)
    assert not path.exists()
    export(path, _computed(), like=like, strict=False)
    file = path if into != "folder" else path / "model.safetensors"
    restored = _torch_model(np.zeros_like(TABLE))  # PyTorch's own reader and load
    restored.load_state_dict(safetensors_torch.load_file(file), strict=True)
    module, variables = _computed()
    np.testing.assert_allclose(
        _run_torch(restored), module.apply(variables, X), atol=1e-6
    )


@pytest.mark.torch
def test_save_like_a_learned_table_stays_missing(tmp_path, caplog):
    """A learned table is no computed one: with strict=False it is not written from
    the reference, and said to be missing."""
    learned = TABLE + np.float32(0.01)
    path = tmp_path / "m.safetensors"
    with pytest.raises(ValueError, match=r"missing: embed_positions\.weight \(8, 4\)"):
        bridge.save_state_dict(path, _computed(), like=_torch_model(learned))
    bridge.save_state_dict(path, _computed(), like=_torch_model(learned), strict=False)
    assert "Not in the export: 1 array(s)" in caplog.text
    assert "embed_positions.weight (8, 4)" in caplog.text
    assert "embed_positions.weight" not in safetensors_numpy.load_file(path)


# --- exports against a reference file (no torch) -------------------------------


def _reference_file(tmp_path, table):
    """A PyTorch-layout file as the PyTorch model stores it: the table, `proj`."""
    module, variables = _computed()
    kernel = np.asarray(variables["params"]["proj"]["kernel"])
    path = tmp_path / "reference.safetensors"
    safetensors_numpy.save_file(
        {
            "embed_positions.weight": table,
            "proj.weight": np.zeros_like(kernel.T),
            "proj.bias": np.zeros(3, np.float32),
        },
        str(path),
    )
    return path


def test_save_like_a_reference_file_writes_its_table(tmp_path):
    reference = _reference_file(tmp_path, TABLE)
    out = tmp_path / "out.safetensors"
    with pytest.raises(ValueError, match=r"computed by the model: embed_positions"):
        bridge.save_state_dict(out, _computed(), like=reference)
    bridge.save_state_dict(out, _computed(), like=reference, strict=False)
    written = safetensors_numpy.load_file(str(out))
    assert sorted(written) == ["embed_positions.weight", "proj.bias", "proj.weight"]
    np.testing.assert_array_equal(written["embed_positions.weight"], TABLE)
    _, variables = _computed()
    np.testing.assert_array_equal(
        written["proj.weight"], np.asarray(variables["params"]["proj"]["kernel"]).T
    )


def test_convert_like_a_reference_names_the_save_that_writes_the_table(
    tmp_path, capsys
):
    """`bridge convert --like`: a file cannot take the reference's table; the
    refusal says which call can."""
    reference = _reference_file(tmp_path, TABLE)
    source = tmp_path / "computed.safetensors"
    bridge.save(source, _computed())
    out = tmp_path / "out.safetensors"
    args = ["convert", str(source), str(out), "--to-layout", "torch"]
    assert main([*args, "--like", str(reference)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "computed by the model: embed_positions.weight (8, 4)" in err
    assert "save the model with bridge.save_pretrained(folder, model, " in err
    assert "like=REFERENCE, strict=False)" in err
    assert not out.exists()
