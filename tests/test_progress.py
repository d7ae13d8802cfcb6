"""The progress display of long loads and saves (`bridge._progress`): every array's
bytes counted once, shard after shard, by every reader and writer; drawn on a
terminal only; `progress=True` of `bridge.load` and `bridge.save` is that display,
the one `bridge convert` shows."""

import io
import json

import jax.numpy as jnp
import pytest
from rich.console import Console

import bridge
from bridge import _progress
from bridge._progress import Display, counting

from .helpers import requires


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _model():
    from flax import nnx

    class Three(nnx.Module):  # arrays of distinct sizes: a count names its array
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 8, rngs=rngs)
            self.b = nnx.Linear(8, 16, rngs=rngs)
            self.c = nnx.Linear(16, 2, rngs=rngs)

    return Three


@requires("NNX")
def test_a_sharded_load_counts_each_array_once_shard_after_shard(tmp_path):
    from flax import nnx

    Three = _model()
    folder = tmp_path / "hf"
    seen: list[int] = []
    with counting(seen.append):
        bridge.save_pretrained(folder, Three(nnx.Rngs(0)), max_shard_size=200)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard_of = index["weight_map"]
    assert len(set(shard_of.values())) == 3  # one layer a shard
    sizes = {"a": (128, 32), "b": (512, 64), "c": (128, 8)}  # weight, bias bytes
    assert sorted(seen) == sorted(n for pair in sizes.values() for n in pair)

    seen.clear()
    with counting(seen.append):
        bridge.load(folder, like=Three(nnx.Rngs(1)))
    # read as the port converts each layer, one shard after the other
    assert seen in ([32, 128, 64, 512, 8, 128], [128, 32, 512, 64, 128, 8])
    assert sum(seen) == index["metadata"]["total_size"]

    seen.clear()
    with counting(seen.append):
        bridge.load(folder)  # no `like`: every array read now
    assert sorted(seen) == sorted(n for pair in sizes.values() for n in pair)


@requires("NNX")
def test_a_load_of_its_own_framework_counts_every_array(tmp_path):
    from flax import nnx

    Three = _model()
    path = tmp_path / "m.safetensors"
    bridge.save(path, Three(nnx.Rngs(0)))
    seen: list[int] = []
    with counting(seen.append):
        bridge.load(path, like=Three(nnx.Rngs(1)))
    assert sorted(seen) == [8, 32, 64, 128, 128, 512]


def test_counting_ends_with_its_block():
    seen: list[int] = []
    with counting(seen.append):
        _progress.advance(3)
    _progress.advance(5)  # nobody listens: nothing called, nothing raised
    assert seen == [3]


def test_the_display_draws_on_a_terminal_only(monkeypatch):
    monkeypatch.setattr(_progress, "DELAY", 0.0)
    screen, log = _Terminal(), io.StringIO()
    for file in (screen, log):
        with Display(Console(file=file, width=80)) as display:
            with display.phase("loading m.safetensors (1.0 KiB)", 1024) as step:
                step(512)
                _progress.advance(512)  # what the readers call
                task = display.progress.tasks[0]
                assert task.completed == 1024
        assert display.started is (file is screen)
    assert "loading m.safetensors" in screen.getvalue()
    assert log.getvalue() == ""  # a log or a pipe: no redrawn lines


def test_a_quick_operation_draws_nothing(monkeypatch):
    monkeypatch.setattr(_progress, "DELAY", 10.0)
    screen = _Terminal()
    with Display(Console(file=screen)) as display:
        with display.phase("saving", 10) as step:
            step(10)
    assert not display.started and screen.getvalue() == ""


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_true_shows_the_load_and_the_save(
    tmp_path, monkeypatch, capsys, terminal
):
    monkeypatch.setattr(_progress, "DELAY", 0.0)
    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    path = tmp_path / "m.safetensors"
    tree = {"params": {"w": jnp.ones((4, 8))}}
    bridge.save(path, tree, progress=True)
    loaded = bridge.load(path, progress=True)
    assert bool(jnp.all(loaded.w == 1))
    shown = stderr.getvalue()
    if terminal:
        assert "saving m.safetensors (128 B)" in shown
        assert "loading m.safetensors (128 B)" in shown
    else:
        assert shown == ""
    assert capsys.readouterr().out == ""  # never on stdout


def test_progress_must_be_a_bool(tmp_path):
    path = tmp_path / "m.safetensors"
    with pytest.raises(TypeError, match="progress"):
        bridge.save(path, {"params": {"w": jnp.ones(2)}}, progress="yes")
    bridge.save(path, {"params": {"w": jnp.ones(2)}})
    with pytest.raises(TypeError, match="progress"):
        bridge.load(path, progress=1)


class _Handle:
    def __init__(self, shown):
        self.shown = shown

    def update(self, obj):
        self.shown.append(obj.data)


def _notebook(monkeypatch):
    """A Jupyter kernel, as `bridge._progress` sees one: IPython with a kernel, and
    `IPython.display` recording what is shown (each update of the one output)."""
    import types

    shown: list[str] = []
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: types.SimpleNamespace(kernel=object())
    display = types.ModuleType("IPython.display")
    display.HTML = lambda data: types.SimpleNamespace(data=data)

    def show(obj, display_id=False):
        assert display_id is True  # updated in place, never a new output each time
        shown.append(obj.data)
        return _Handle(shown)

    display.display = show
    monkeypatch.setitem(__import__("sys").modules, "IPython", ipython)
    monkeypatch.setitem(__import__("sys").modules, "IPython.display", display)
    return shown


def test_a_notebook_gets_an_html_bar_updated_in_place(monkeypatch):
    """In Jupyter the display was drawn nowhere (stderr is no terminal there)."""
    shown = _notebook(monkeypatch)
    assert _progress.in_notebook()
    now = [0.0]
    bar = _progress.Notebook(clock=lambda: now[0])
    with bar.phase("loading model.safetensors (1.0 KiB)", 1000) as step:
        step(100)  # before DELAY: nothing shown
        assert shown == []
        now[0] = 1.5
        step(400)  # shown
        now[0] = 1.6
        step(100)  # within a quarter second of the last draw: not redrawn
        now[0] = 2.0
        step(400)
    assert len(shown) == 3
    assert '<progress value="500" max="1000"' in shown[0] and "50%" in shown[0]
    assert '<progress value="1000" max="1000"' in shown[1] and "100%" in shown[1]
    assert "done 2.0 s" in shown[2]  # marked done in place


def test_a_quick_operation_in_a_notebook_shows_nothing(monkeypatch):
    shown = _notebook(monkeypatch)
    with _progress.shown(True, "saving m.safetensors (8 B)", 8):
        _progress.advance(8)
    assert shown == []
