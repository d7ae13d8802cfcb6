"""The `bridge` command never surprises (issue #23, item 4; #22, item 15): every case
through the real command in a subprocess, checking the exit code, the one-line
message and that nothing was written."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import bridge
from bridge._cli import main

from . import models
from .helpers import requires
from .processes import checkout_env


ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.slow  # each starts Python and JAX (test_cli.py: in-process)


def run(*args, cwd=None):
    env = checkout_env()
    env.pop("COLUMNS", None)
    return subprocess.run(
        [sys.executable, "-m", "bridge", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def assert_refused(done, code, *words):
    """The command failed with `code`, one line on stderr naming `words`."""
    assert done.returncode == code, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr and "(2, '" not in done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


@pytest.fixture
def torch_file(tmp_path):
    """A PyTorch-layout file of 12 numbered layers, saved in a scrambled order."""
    arrays = {f"h.{i}.weight": np.full((3, 2), i, "f4") for i in (0, 10, 11, 2, 1)}
    arrays |= {f"h.{i}.weight": np.full((3, 2), i, "f4") for i in range(3, 10)}
    arrays["wte.weight"] = np.ones((5, 2), "f4")
    path = tmp_path / "gpt.safetensors"
    save_file(arrays, path, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("suffix", [".pt", ".bin", ".h5"])
def test_convert_refuses_an_output_no_format_claims(tmp_path, torch_file, suffix):
    out = tmp_path / f"x{suffix}"
    assert_refused(
        run("convert", torch_file, out), 1, f"x{suffix}", "writes no", "orbax directory"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--rename", "a=b"], ["--rename does nothing without --to-layout"]),
        (["--batch-norm-mode", "ema"], ["--batch-norm-mode does nothing without"]),
        (
            ["--to-layout", "torch", "--batch-norm-mode", "ema"],
            ["--batch-norm-mode applies only with --to-layout equinox"],
        ),
    ],
)
def test_flags_that_do_nothing_are_usage_errors(tmp_path, torch_file, flags, words):
    out = tmp_path / "out.safetensors"
    assert_refused(run("convert", torch_file, out, *flags), 2, *words)
    assert not out.exists()


@pytest.mark.parametrize(
    "rule", ["layers\\.0=layers.1.weight", "layers\\.0=a..b", "layers\\.2=0"]
)
def test_rename_to_names_load_refuses_writes_nothing(tmp_path, rule):
    src = tmp_path / "mlp.safetensors"
    bridge.save(src, models.equinox_mlp())
    out = tmp_path / "out.safetensors"
    done = run("convert", src, out, "--to-layout", "torch", "--rename", rule)
    assert done.returncode == 1, done.stdout
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert not out.exists()


def test_missing_file_is_one_line_of_prose(tmp_path):
    done = run("inspect", tmp_path / "nosuch.safetensors")
    assert_refused(done, 1, "nosuch.safetensors: no such file or directory")


def test_version():
    done = run("--version")
    assert (
        done.returncode == 0 and done.stdout.strip() == f"bridge {bridge.__version__}"
    )


@pytest.mark.parametrize(
    "wrong, right",
    [("--to_layout", "--to-layout"), ("--weights_only", "--weights-only")],
)
def test_misspelt_flag_is_named_with_the_right_one(tmp_path, torch_file, wrong, right):
    out = tmp_path / "out.safetensors"
    done = run("convert", torch_file, out, wrong, "flax")
    assert_refused(done, 2, f"{wrong} (did you mean {right}?)")
    assert not out.exists()


@pytest.mark.parametrize(
    "args, words",
    [
        (["--steps", "-3"], ["--steps: -3 is not a positive number"]),
        (["--steps", "0"], ["--steps: 0 is not a positive number"]),
        (["--out", "newdir"], ["--out: 'newdir' is not an existing directory"]),
        (["--out", "a\x1b[2J"], ["--out: 'a\\x1b[2J' is not an existing directory"]),
    ],
)
def test_demo_arguments_checked_before_training(tmp_path, args, words):
    done = run("demo", *args, cwd=tmp_path)
    assert_refused(done, 2, *words)
    assert "training" not in done.stdout and not list(tmp_path.iterdir())


@pytest.mark.parametrize("size", ["\u00b2", "1\u00b2", "\u0661\u0660\u0660"])
def test_a_shard_size_of_non_ascii_digits_is_named(tmp_path, size):
    """`--max-shard-size ²` was `invalid literal for int() with base 10: '²'`;
    Arabic-Indic digits were read as a number."""
    src = tmp_path / "m.safetensors"
    save_file({"fc.weight": np.ones((2, 2), "f4")}, src, metadata={"format": "pt"})
    done = run(
        "convert",
        src,
        tmp_path / "out",
        "--to-layout",
        "torch",
        "--max-shard-size",
        size,
    )
    assert_refused(done, 1, "`max_shard_size` must be a positive number", repr(size))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "out, words",
    [
        ("file", "'file' is not a directory but a file (give a directory)"),
        ("file/sub", "'file/sub' is not an existing directory: 'file' is a file"),
    ],
)
def test_demo_out_a_file_or_under_one_is_one_line(tmp_path, out, words):
    (tmp_path / "file").write_text("mine")
    done = run("demo", "--out", out, cwd=tmp_path)
    assert_refused(done, 2, f"--out: {words}")
    assert "training" not in done.stdout
    assert (tmp_path / "file").read_text() == "mine"


def test_demo_out_never_replaces_a_checkpoint_silently(tmp_path, capsys):
    """`--out DIR` holding a demo.safetensors (the last run's, or a file of the
    user's): refused before any work, naming --overwrite, as convert refuses."""
    (tmp_path / "demo.safetensors").write_text("mine")
    assert main(["demo", "--steps", "1", "--out", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert "training" not in out and "Traceback" not in err
    assert err.count("\n") == 1 and "demo.safetensors exists" in err, err
    assert "--overwrite" in err
    assert (tmp_path / "demo.safetensors").read_text() == "mine"


@pytest.mark.slow
def test_demo_out_with_overwrite_replaces_it(tmp_path, capsys):
    (tmp_path / "demo.safetensors").write_text("mine")
    argv = ["demo", "--steps", "1", "--out", str(tmp_path), "--overwrite"]
    assert main(argv) == 0
    assert "checkpoint demo.safetensors" in capsys.readouterr().out
    loaded = bridge.load(tmp_path / "demo.safetensors")
    assert bridge.roles(loaded).head.kernel == "params"


def test_demo_out_a_directory_it_cannot_write_is_one_line(
    tmp_path, monkeypatch, capsys
):
    """A read-only directory (as root every directory is writable, so the check
    is made to answer as for another user)."""
    real = os.access
    monkeypatch.setattr(
        os,
        "access",
        lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode),
    )
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--out", str(tmp_path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "is a directory this user cannot write into" in err
    assert "chmod u+wx" in err


def test_inspect_natural_order_no_wrapping_when_piped(torch_file):
    done = run("inspect", torch_file)
    assert done.returncode == 0, done.stderr
    names = [
        line.split("│")[1].strip()
        for line in done.stdout.splitlines()
        if line.startswith("│")
    ]
    assert names == [f"h.{i}.weight" for i in range(12)] + ["wte.weight"]


def test_inspect_long_names_are_whole_lines_when_piped(tmp_path):
    name = "model.layers.0.self_attention.query_projection_with_a_long_name.weight"
    path = tmp_path / "long.safetensors"
    save_file({name: np.ones((2, 2), "f4")}, path, metadata={"format": "pt"})
    done = run("inspect", path)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stdout.splitlines() if name in line]


def test_inspect_filter_and_json(torch_file):
    done = run("inspect", torch_file, "--filter", r"^h\.1", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [a["name"] for a in report["arrays"]] == [
        "h.1.weight",
        "h.10.weight",
        "h.11.weight",
    ]
    assert report["arrays"][0] == dict(
        name="h.1.weight",
        role="params",
        shape=[3, 2],
        dtype="float32",
        bytes=24,
        elements=6,
    )
    assert report["totals"] == dict(arrays=3, parameters=18, elements=18, bytes=72)
    assert report["layout"] == "torch" and report["metadata"] == {"format": "pt"}
    text = run("inspect", torch_file, "--filter", "wte")
    assert "wte.weight" in text.stdout and "h.1.weight" not in text.stdout
    assert "1 arrays" in text.stdout and "matches 'wte' (of 13)" in text.stdout


def test_inspect_bad_filter(torch_file):
    assert_refused(
        run("inspect", torch_file, "--filter", "h.(["), 1, "--filter", "regular"
    )


def test_inspect_sharded_folder_has_a_shard_column(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    names = {"model-00001-of-00002.safetensors": ["h.1.w", "h.10.w"]}
    names["model-00002-of-00002.safetensors"] = ["h.2.w", "h.0.w"]
    for shard, keys in names.items():
        save_file({k: np.ones(2, "f4") for k in keys}, folder / shard)
    index = {"weight_map": {k: shard for shard, keys in names.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    done = run("inspect", folder)
    assert done.returncode == 0, done.stderr
    rows = [
        [c.strip() for c in line.split("│")[1:-1]]
        for line in done.stdout.splitlines()
        if line.startswith("│")
    ]
    assert [(r[0], r[-1]) for r in rows] == [
        ("h.0.w", "00002-of-00002"),
        ("h.1.w", "00001-of-00002"),
        ("h.2.w", "00002-of-00002"),
        ("h.10.w", "00001-of-00002"),
    ]
    assert "shard" in done.stdout and "2 shard files" in done.stdout
    report = json.loads(run("inspect", folder, "--json").stdout)
    assert report["arrays"][0]["shard"] == "model-00002-of-00002.safetensors"


def test_strings_from_files_are_escaped(tmp_path):
    path = tmp_path / "e\x1b[31m.safetensors"
    save_file(
        {"a.weight": np.ones(2, "f4")},
        path,
        metadata={"format": "pt", "x\x1b[2J": "v\u202eal\nnext"},
    )
    done = run("inspect", path)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\u202e" not in done.stdout
    assert "\\x1b[2J" in done.stdout and "\\u202e" in done.stdout
    out = tmp_path / "o\u202e.safetensors"
    done = run("convert", path, out)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\u202e" not in done.stdout
    assert done.stdout.count("\n") == 1


@requires("NNX")
def test_training_record_strings_are_escaped(tmp_path):
    model = models.nnx_mlp()
    path = tmp_path / "train.safetensors"
    bridge.save_training(
        path, model, None, step=3, extra={"bad\x1b[2Jname": np.ones(2, "f4")}
    )
    done = run("inspect", path)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\\x1b[2Jname" in done.stdout


@pytest.mark.torch
def test_the_pickle_refusal_command_works_when_pasted(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=50)
    model = transformers.GPT2LMHeadModel(config)  # lm_head tied to wte
    folder = tmp_path / "gpt2"
    folder.mkdir()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    done = run("inspect", folder)
    assert_refused(done, 1, "pytorch_model.bin is a pickle file")
    command = re.search(r'python -c "(.*?)"', done.stderr)
    assert command is not None, done.stderr
    pasted = subprocess.run(
        [sys.executable, "-c", command[1]], capture_output=True, text=True, timeout=300
    )
    assert pasted.returncode == 0, pasted.stderr
    done = run("inspect", folder)
    assert done.returncode == 0, done.stderr
    assert "lm_head.weight" in done.stdout and "transformer.wte.weight" in done.stdout
    assert "model.safetensors" in done.stdout
