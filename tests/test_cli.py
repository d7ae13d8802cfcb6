"""The `bridge` command: run as a subprocess (`python -m bridge`, as the console
script runs `bridge._cli:main`), and in-process through `main` for the many cases."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bridge
from bridge._cli import main

from . import models
from .helpers import child_reads_orbax, requires
from .processes import checkout_env


def run(*args, script=False):
    """Run `python -m bridge`, or the installed console script `bridge`."""
    env = dict(os.environ, COLUMNS="200")
    command = [sys.executable, "-m", "bridge"]
    if script:
        command = [str(Path(sys.executable).parent / "bridge")]
    return subprocess.run(
        [*command, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.fixture
def cnn_file(tmp_path):
    path = tmp_path / "cnn.safetensors"
    bridge.save(path, models.nnx_cnn(), metadata={"step": "100"})
    return path


@requires("NNX")
def test_inspect_subprocess(tmp_path):
    path = tmp_path / "wide.safetensors"
    model = nnx.Linear(40, 30, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    bridge.save(path, model, metadata={"step": "100"})
    done = run("inspect", path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for column in ("path", "role", "shape", "dtype", "size"):
        assert column in out
    assert "kernel" in out and "(40, 30)" in out and "bfloat16" in out
    assert "1,230 parameters" in out and "2,460 bytes" in out
    assert "(safetensors, nnx, flax layout)" in out and "step: 100" in out


# slow (a second process imports jax and converts): test_convert_msgpack_keeps_roles
# runs the same command through `main` by default; test_error_subprocess_is_one_line and
# test_inspect_subprocess run the command as a process.
@pytest.mark.slow
@child_reads_orbax
def test_convert_subprocess_keeps_roles(tmp_path, cnn_file):
    done = run("convert", cnn_file, tmp_path / "ckpt")
    assert done.returncode == 0, done.stderr
    tree = bridge.load(tmp_path / "ckpt")
    assert bridge.roles(tree).bn.mean == "batch_stats"
    np.testing.assert_array_equal(tree.bn.var, bridge.load(cnn_file).bn.var)


def test_error_subprocess_is_one_line(tmp_path):
    if not (Path(sys.executable).parent / "bridge").exists():
        pytest.skip("no `bridge` console script beside Python: pip install -e .")
    done = run("inspect", tmp_path / "missing.safetensors", script=True)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("bridge inspect: error: ")
    assert "missing.safetensors: no such file" in done.stderr


def test_convert_chain_keeps_everything(tmp_path, cnn_file, capsys):
    model = models.nnx_cnn()
    assert main(["convert", str(cnn_file), str(tmp_path / "a")]) == 0
    assert main(["convert", str(tmp_path / "a"), str(tmp_path / "b.safetensors")]) == 0
    assert "b.safetensors (safetensors): 8 arrays" in capsys.readouterr().out
    back = bridge.load(tmp_path / "b.safetensors", like=models.nnx_cnn(1))
    np.testing.assert_array_equal(back.conv.kernel[...], model.conv.kernel[...])
    assert main(["inspect", str(tmp_path / "b.safetensors")]) == 0
    assert "step: 100" in capsys.readouterr().out


class WithKeys(nnx.Module):
    def __init__(self, seed):
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(seed))
        self.lin = nnx.Linear(2, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))


@requires("NNX")
def test_convert_every_pair_of_formats_with_prng_keys(tmp_path):
    bridge.save(tmp_path / "a.safetensors", WithKeys(0))
    chain = ["a.safetensors", "b", "c.safetensors", "d.msgpack", "e"]
    for src, dst in zip(chain, chain[1:]):
        assert main(["convert", str(tmp_path / src), str(tmp_path / dst)]) == 0
    back = bridge.load(tmp_path / "c.safetensors", like=WithKeys(1))
    key = back.drop.rngs.key[...]
    assert jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(
        jax.random.key_data(key), jax.random.key_data(WithKeys(0).drop.rngs.key[...])
    )
    tree = bridge.load(tmp_path / "e")  # msgpack keeps key data, not the key type
    assert bridge.roles(tree).drop.rngs.key == "rngs"
    assert tree.lin.kernel.dtype == jnp.bfloat16


def test_convert_msgpack_keeps_roles(tmp_path, cnn_file):
    assert main(["convert", str(cnn_file), str(tmp_path / "m.msgpack")]) == 0
    variables = bridge.to_native(bridge.load(tmp_path / "m.msgpack"))
    assert sorted(variables) == ["batch_stats", "params"]
    assert main(["convert", str(tmp_path / "m.msgpack"), str(tmp_path / "c")]) == 0
    assert bridge.roles(bridge.load(tmp_path / "c")).bn.mean == "batch_stats"


def test_inspect_orbax_and_msgpack(tmp_path, capsys):
    bridge.save(tmp_path / "ckpt", models.equinox_cnn())
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "(orbax, equinox, equinox layout)" in out and "batch_stats" in out
    assert "94 parameters (103 elements)" in out


def empty_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def text_file(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    return tmp_path / "notes.txt"


def garbage_file(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"\x00" * 20)
    return tmp_path / "x.safetensors"


@pytest.mark.parametrize(
    "make, message",
    [
        (empty_dir, "empty is a directory but not a checkpoint"),
        (text_file, "unknown checkpoint format '.txt'"),
        (garbage_file, "x.safetensors is not a readable safetensors checkpoint"),
    ],
)
def test_errors(tmp_path, capsys, make, message):
    assert main(["inspect", str(make(tmp_path))]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_convert_refuses_to_replace_a_directory(tmp_path, cnn_file, capsys):
    (tmp_path / "photos").mkdir()
    assert main(["convert", str(cnn_file), str(tmp_path / "photos")]) == 1
    assert "photos exists: pass --overwrite" in capsys.readouterr().err
    photos = str(tmp_path / "photos")
    assert main(["convert", str(cnn_file), photos, "--overwrite"]) == 1
    assert "is not a checkpoint directory" in capsys.readouterr().err
    assert os.path.isdir(tmp_path / "photos")


@pytest.mark.parametrize("out", ["other.safetensors", "other.msgpack", "orbax"])
def test_convert_never_replaces_a_checkpoint_without_overwrite(
    tmp_path, cnn_file, capsys, out
):
    """An existing DST is replaced only with --overwrite (issue #40, item 6)."""
    dst = tmp_path / out
    assert main(["convert", str(cnn_file), str(dst)]) == 0
    before = sorted((p.name, p.stat().st_mtime_ns) for p in [dst, *dst.rglob("*")])
    capsys.readouterr()
    assert main(["convert", str(cnn_file), str(dst)]) == 1
    err = capsys.readouterr().err
    assert f"{dst} exists: pass --overwrite to replace it" in err
    assert err.count("\n") == 1
    after = sorted((p.name, p.stat().st_mtime_ns) for p in [dst, *dst.rglob("*")])
    assert after == before  # untouched
    assert main(["convert", str(cnn_file), str(dst), "--overwrite"]) == 0


def test_convert_never_writes_onto_its_own_source(tmp_path, cnn_file, capsys):
    data = cnn_file.read_bytes()
    for flags in ([], ["--overwrite"]):
        assert main(["convert", str(cnn_file), str(cnn_file), *flags]) == 1
        err = capsys.readouterr().err
        assert "would replace the checkpoint being read" in err
        assert cnn_file.read_bytes() == data
    folder = tmp_path / "folder"
    assert main(["convert", str(cnn_file), str(folder)]) == 0
    inner = folder / "again.safetensors"
    assert main(["convert", str(inner), str(folder), "--overwrite"]) == 1
    assert "would replace the checkpoint being read" in capsys.readouterr().err
    hf = tmp_path / "hf"  # a folder read as a checkpoint, and a file in it
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(data)
    inside = hf / "model.safetensors"
    assert main(["convert", str(hf), str(inside), "--overwrite"]) == 1
    assert "would replace the checkpoint being read" in capsys.readouterr().err
    assert inside.read_bytes() == data
    assert main(["convert", str(hf), str(hf / "new.safetensors")]) == 0  # new: fine


@pytest.mark.parametrize(
    "name, words",
    [
        ("out.gguf", ["reads gguf files (.gguf) but writes none", ".safetensors"]),
        ("out.json", ["no .json files (JSON holds no arrays", ".safetensors.index"]),
        ("model.bin", ["no .bin files (a PyTorch pickle", "orbax directory"]),
    ],
)
def test_suffix_errors_say_what_is_writable(tmp_path, cnn_file, capsys, name, words):
    assert main(["convert", str(cnn_file), str(tmp_path / name)]) == 1
    err = capsys.readouterr().err
    for word in [*words, "It writes .msgpack, .safetensors or"]:
        assert word in err, err
    assert "a pickle or another library" not in err and "cannot store" not in err
    assert not (tmp_path / name).exists()


def test_a_rename_that_matches_part_of_a_path_shows_the_capturing_form(
    tmp_path, capsys
):
    from safetensors.numpy import save_file

    names = [f"model.layers.{i}.q_proj.weight" for i in range(2)]
    src = tmp_path / "m.safetensors"
    save_file({n: np.ones((3, 3), "f4") for n in names}, src, metadata={"format": "pt"})
    dst = str(tmp_path / "eqx.safetensors")
    rename = ["--rename", r"model\.layers\.(\d+)=blocks.\1", "--rename", "x=y"]
    assert main(["convert", str(src), dst, "--to-layout", "equinox", *rename]) == 1
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 3, err  # the header, then one line per problem
    assert "must match a layer's whole dotted path (re.fullmatch)" in lines[1]
    fix = r"model\.layers\.(\d+)(.*)=blocks.\1\2"
    assert f"capture the rest and put it back, '{fix}'" in lines[1]
    assert lines[2].startswith("- rename 'x=y': matches no layer")
    assert (
        main(["convert", str(src), dst, "--to-layout", "equinox", "--rename", fix]) == 0
    )
    assert bridge.load(dst).blocks[1].q_proj.weight.shape == (3, 3)


def test_the_static_help_texts_are_the_registry_s():
    """--help answers without JAX, from copies of what the registries say."""
    from bridge import _cli
    from bridge._io import _relayout

    assert _cli.FORMATS == _cli._formats()
    assert _cli.LAYOUTS == _relayout.LAYOUTS
    assert _cli.BATCH_NORM_MODES == _relayout.BATCH_NORM_MODES


def test_arguments_are_parsed_before_jax_is_imported():
    code = (
        "import sys\n"
        "from bridge._cli import main\n"
        "typo = ['convert', 'a', 'b', '--to_layout']\n"
        "for argv in (['--help'], ['--version'], typo):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print([m for m in ('jax', 'flax', 'equinox', 'numpy') if m in sys.modules])"
    )
    env = checkout_env()
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr
    assert "did you mean --to-layout" in done.stderr


@pytest.mark.parametrize("command", [[], ["inspect"], ["convert"], ["demo"]])
def test_help_on_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: {' '.join(['bridge', *command])}" in out
    # argparse joins a help text's lines with spaces: a source line that ends in a
    # hyphen ("PyTorch-" / "layout") would print as "PyTorch- layout"
    assert not re.search(r"[A-Za-z]- ", out), re.search(r"\S+- \S+", out)


def test_usage_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["frobnicate"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'frobnicate'" in err and err.count("\n") == 1


@pytest.mark.parametrize("dst", ["flax.safetensors", "flax_dir", "flax.msgpack"])
def test_convert_to_flax_layout(tmp_path, dst, capsys):
    model, state = models.equinox_cnn(0)
    bridge.save(tmp_path / "eqx.safetensors", (model, state))
    src, out = str(tmp_path / "eqx.safetensors"), str(tmp_path / dst)
    assert main(["convert", src, out, "--to-layout", "flax"]) == 0
    x = models.cnn_input()
    module, variables = models.linen_cnn(1)
    linen = bridge.load(out, like=(module, variables))
    assert linen[1]["params"]["Conv_0"]["kernel"].shape == (3, 3, 2, 4)  # HWIO
    assert bridge.compare((model, state), linen, x) < 1e-5
    assert (
        bridge.compare((model, state), bridge.load(out, like=models.nnx_cnn(1)), x)
        < 1e-5
    )
    capsys.readouterr()
    assert main(["inspect", out]) == 0
    assert "bn.mean" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, code, words",
    [
        (["--to_layout", "flax"], 2, ["--to_layout (did you mean --to-layout?)"]),
        (["--rename", "a=b"], 2, ["--rename does nothing without --to-layout"]),
        (["--to-layout", "torch", "--batch-norm-mode", "ema"], 2, ["equinox"]),
        (["--config", "config.json"], 2, ["--config applies only to a Hugging"]),
        (["--overwrite", "--to-layot", "torch"], 2, ["(did you mean --to-layout?)"]),
    ],
)
def test_convert_usage_checked_first(tmp_path, cnn_file, capsys, argv, code, words):
    out = tmp_path / "out.safetensors"
    with pytest.raises(SystemExit) as exit_:
        main(["convert", str(cnn_file), str(out), *argv])
    assert exit_.value.code == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err
    # the subcommand's name and help, where the option it means is listed (`bridge
    # --help` lists none of convert's)
    assert err.startswith("bridge convert: error: "), err
    assert err.endswith(" (see bridge convert --help)\n"), err
    assert not out.exists()


@pytest.mark.parametrize("name", ["x.pt", "x.bin", "x.h5", "nodir/x.safetensors"])
def test_convert_output_checked_first(tmp_path, cnn_file, capsys, name):
    assert main(["convert", str(cnn_file), str(tmp_path / name)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("writes no" in err or "no such directory" in err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cnn.safetensors"]


def test_version_and_demo_arguments(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"bridge {bridge.__version__}\n"
    for argv in (["--steps", "-3"], ["--out", "no/such/dir"]):
        with pytest.raises(SystemExit) as exit_:
            main(["demo", *argv])
        assert exit_.value.code == 2
        assert "bridge demo: error: argument" in capsys.readouterr().err


def test_two_names_of_one_index_are_a_clear_error(tmp_path, capsys):
    from safetensors.numpy import save_file

    src = tmp_path / "dup.safetensors"
    arrays = {"l.01.weight": np.ones((2, 2), "f4"), "l.1.weight": np.ones((2, 2), "f4")}
    save_file(arrays, src, metadata={"format": "pt"})
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(src), str(out), "--to-layout", "flax"]) == 1
    err = capsys.readouterr().err
    assert "'l.01.weight' and 'l.1.weight' name the same array" in err
    assert err.count("\n") == 1 and not out.exists()


def test_convert_shows_the_share_of_bytes_read(tmp_path):
    """The reading phase's bar counts every array's bytes, once each, up to the
    checkpoint's total (what `convert` shows after a second)."""
    import io

    from rich.console import Console

    from bridge._io._read import open_checkpoint, read
    from bridge._progress import Display, counting

    path = tmp_path / "m.safetensors"
    bridge.save(path, {"params": {"a": jnp.ones((3, 4)), "b": jnp.ones(5, jnp.int8)}})
    with Display(Console(file=io.StringIO())) as slow:
        with open_checkpoint(path) as contents:
            total = sum(s.nbytes for s in contents.tensors)
            counted: list[int] = []
            with slow.phase("reading", total):
                with counting(counted.append):
                    read(contents)
                task = slow.progress.tasks[0]
                assert task.completed == 0  # the inner listener took the counts
                read(contents)
                assert (task.total, task.completed) == (total, total)
    assert sorted(counted) == [5, 48] and sum(counted) == total
