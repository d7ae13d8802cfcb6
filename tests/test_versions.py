"""Versions: the features `requires` checks match the release numbers it names, the
library refuses a too-old framework with the version it needs, and the version tables
of README.md and docs/versions.md are the ones docs/matrix.json makes."""

import collections
import importlib.util
import json
import re
import tomllib
from pathlib import Path

import equinox as eqx
import pytest
from flax import nnx

import bridge
from bridge._port import _shapes

from . import models
from .helpers import FEATURES, installed, missing


ROOT = Path(__file__).parent.parent
_spec = importlib.util.spec_from_file_location(
    "matrix_table", ROOT / "scripts" / "matrix_table.py"
)
matrix_table = importlib.util.module_from_spec(_spec)  # pyright: ignore
_spec.loader.exec_module(matrix_table)  # pyright: ignore


@pytest.mark.parametrize("name", list(FEATURES))
def test_a_feature_is_present_from_the_release_it_names(name):
    """The API check and the version in the skip reason agree, in every matrix cell."""
    feature = FEATURES[name]
    needed = tuple(int(p) for p in feature.version.split("."))
    assert feature.present() == (installed(feature.package) >= needed)


def test_skip_reasons_are_read_as_features_by_the_table_script():
    for name, feature in FEATURES.items():
        reason = f"needs {name} ({feature.package} >= {feature.version})"
        match = matrix_table.FEATURE_SKIP.match(reason)
        assert match and match["feature"] == name, reason
        assert missing(name) == (None if feature.present() else reason)


def test_nnx_on_an_older_flax_names_the_version_it_needs(monkeypatch):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    monkeypatch.delattr(nnx.Variable, "get_raw_value", raising=False)
    with pytest.raises(
        ImportError, match=r"(?s)needs flax >= 0\.12\.1.*installed flax is"
    ):
        bridge.from_nnx(model)


class OldBatchNorm:
    """The signature of equinox 0.12's BatchNorm: no `mode`."""

    def __init__(self, input_size, axis_name, eps=1e-5, channelwise_affine=True,
                 momentum=0.99, inference=False, dtype=None):  # fmt: skip
        raise AssertionError("only its signature is read")


def test_equinox_batch_norm_on_an_older_equinox_names_the_version(monkeypatch):
    source, target = models.linen_cnn(), models.equinox_cnn()
    monkeypatch.setattr(eqx.nn, "BatchNorm", OldBatchNorm)
    # the codecs' shapes are cached per process (the installed equinox cannot change
    # in one): a port of the same layers by an earlier test would skip the check
    monkeypatch.setattr(_shapes, "_cache", collections.OrderedDict())
    with pytest.raises(bridge.PortError, match=r"needs equinox >= 0\.13\.0"):
        bridge.port(source, target)


# --- the version tables --------------------------------------------------------------


def test_the_version_tables_are_generated_from_the_results_file(capsys):
    """README.md and docs/versions.md hold what `python scripts/matrix_table.py`
    writes from docs/matrix.json (run it after `nox -s tests_matrix`)."""
    assert matrix_table.main(["--check"]) == 0, capsys.readouterr().err


CELL = {"python": "3.11", "flax": "0.11.2", "equinox": "0.13.8", "optax": "0.2.8"}
VERSIONS = {"jax": "0.7.2", "flax": "0.11.2", "equinox": "0.13.8", "optax": "0.2.8"}


def test_a_table_says_what_each_cell_found():
    nnx_skip = "needs NNX (flax >= 0.12.1)"
    both = (
        "needs NNX (flax >= 0.12.1) and eqx.nn.BatchNorm(mode=...) (equinox >= 0.13.0)"
    )
    skipped = {nnx_skip: 150, both: 2, "torch is not installed": 3}
    older = {**VERSIONS, "jax": "0.6.0"}
    results = {
        "a": {**CELL, "versions": VERSIONS, "passed": 200, "failed": 0,
              "failed_tests": [], "skipped": skipped},
        "b": {**CELL, "equinox": "0.11.12", "declared_skip": "imports jaxlib.foo",
              "short": "needs jaxlib.foo"},
        "c": {**CELL, "optax": "0.2.5", "versions": VERSIONS, "passed": 3, "failed": 1,
              "failed_tests": ["tests/test_x.py::test_y"], "skipped": {}},
        "d": {**CELL, "python": "3.13", "equinox": "0.11.12", "versions": older,
              "passed": 3, "failed": 0, "failed_tests": [], "skipped": {}},
        "e": {**CELL, "python": "3.13", "declared_skip": "imports jaxlib.foo",
              "short": "needs jaxlib.foo"},
        "f": {**CELL, "python": "3.13", "equinox": "0.12.2", "declared_skip": "x.y",
              "short": "needs x.y"},
        "g": {**CELL, "python": "3.13", "equinox": "0.12.2", "versions": older,
              "passed": 3, "failed": 0, "failed_tests": [], "skipped": {}},
    }  # fmt: skip
    del results["g"]  # one row of 3.13 has no cell run on the row's own jax
    short = matrix_table.matrix_table(results, short=True)
    header, _, row, row313, _, footnotes = short.splitlines()
    assert header == (
        "| Python | flax (jax) | equinox 0.11.12 | equinox 0.12.2 | equinox 0.13.8 "
        "| equinox 0.13.8, optax 0.2.5 |"
    )
    assert row == "| 3.11 | 0.11.2 (jax 0.7.2) | ✗¹ |  | ✅ | **✗ 1** |"
    assert row313 == "| 3.13 | 0.11.2 (jax 0.6.0) | ✅ | ✗² | ✗¹ |  |"
    because = "✗ cannot run, or fails, because: ¹ needs jaxlib.foo, ² needs x.y;"
    assert because in footnotes
    assert "optax 0.2.8 where no other is named" in footnotes
    long = matrix_table.matrix_table(results, short=False)
    assert "150 `NNX` (flax >= 0.12.1)" in long and "`tests/test_x.py::test_y`" in long
    assert "cannot run: imports jaxlib.foo" in long
    assert (
        "2 `NNX` (flax >= 0.12.1) + `eqx.nn.BatchNorm(mode=...)` (equinox >= 0.13.0)"
        in long
    )


def test_a_cell_on_another_jax_than_its_row_names_it():
    results = {
        key: {**CELL, "equinox": e, "versions": {**VERSIONS, "jax": jax}, "passed": 1,
              "failed": 0, "failed_tests": [], "skipped": {}}
        for key, e, jax in [("a", "0.11.12", "0.6.0"), ("b", "0.12.2", "0.7.2"),
                            ("c", "0.13.8", "0.7.2")]
    }  # fmt: skip
    row = matrix_table.matrix_table(results, short=True).splitlines()[2]
    assert row == "| 3.11 | 0.11.2 (jax 0.7.2) | ✅ (jax 0.6.0) | ✅ | ✅ |"


def test_the_python_classifiers_are_the_pythons_the_matrix_passes_on():
    """pyproject.toml claims a Python where a matrix cell passed on it, and
    requires-python starts at the oldest of them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    python = re.compile(r"Programming Language :: Python :: (3\.\d+)$")
    claimed = {m[1] for c in project["classifiers"] if (m := python.match(c))}
    results = json.loads((ROOT / "docs" / "matrix.json").read_text())
    passed = {
        cell["python"]
        for key, cell in results.items()
        if key != "floor" and "versions" in cell and not cell["failed"]
    }
    assert claimed == passed
    oldest = min(passed, key=lambda v: tuple(map(int, v.split("."))))
    assert project["requires-python"] == f">={oldest}"


def test_results_are_read_from_a_junit_report_and_merged(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_ok" />'
        '<testcase classname="tests.test_a" name="test_nnx">'
        '<skipped type="pytest.skip" message="needs NNX (flax &gt;= 0.12.1)" />'
        "</testcase>"
        '<testcase classname="tests.test_a" name="test_bad"><failure message="x" />'
        "</testcase></testsuite></testsuites>"
    )
    counts = matrix_table.junit_counts(report)
    assert counts == {
        "passed": 1,
        "skipped": {"needs NNX (flax >= 0.12.1)": 1},
        "failed": 1,
        "failed_tests": ["tests.test_a::test_bad"],
    }
    results = tmp_path / "matrix.json"
    matrix_table.record("one", {"passed": 1}, results)
    matrix_table.record("two", {"passed": 2}, results)
    assert json.loads(results.read_text()) == {
        "one": {"passed": 1},
        "two": {"passed": 2},
    }


def test_a_page_without_the_markers_is_an_error():
    with pytest.raises(ValueError, match="no `<!-- matrix: begin -->`"):
        matrix_table.rewrite("no table here", {"matrix": "| a |"})
