"""`bridge demo`: the main job end to end (slow: it trains for a few hundred steps)."""

import subprocess
import sys

import pytest
from rich.console import Console

from bridge._demo import demo


@pytest.mark.slow
def test_demo(tmp_path):
    console = Console(record=True, width=120)
    result = demo(steps=300, console=console, out=tmp_path)
    assert result.loss_after < result.loss_before / 10
    assert result.frozen_unchanged and result.head_changed
    assert result.diff_equinox < 1e-5
    assert result.diff_linen < 1e-5
    assert result.diff_reloaded < 1e-5
    assert (tmp_path / "demo.safetensors").stat().st_size == result.file_size
    text = console.export_text()
    assert "300/300 steps" in text and "max |NNX - Linen|" in text


@pytest.mark.slow
def test_demo_command(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "bridge", "demo", "--steps", "50", "--out", tmp_path],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "bridge demo" in done.stdout and "NO" not in done.stdout
    assert (tmp_path / "demo.safetensors").exists()
