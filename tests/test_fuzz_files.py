"""A few cases of `scripts/fuzz_files.py` (damaged safetensors headers, sharded
indexes and GGUF files, each loaded and inspected in a fresh process under a memory
cap and a timeout): each loads or is refused with a `bridge.CheckpointError`, none
crashes or hangs. The full run (300 files of each kind) is the script's."""

import importlib
import pathlib

import pytest


SCRIPTS = pathlib.Path(__file__).resolve().parent.parent / "scripts"


def _check(monkeypatch, kinds, files) -> list[str]:
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the processes import it by name
    fuzz = importlib.import_module("fuzz_files")
    outcomes = fuzz.run(fuzz.cases(kinds, files), timeout=120)
    assert len(outcomes) == len(kinds) * files
    bad = [o for o in outcomes if o.result not in ("loaded", "refused")]
    assert not bad, "\n".join(f"{o.result}: {o.case}: {o.detail}" for o in bad)
    return [o.detail for o in outcomes if o.result == "refused"]


def _in_bridges_words(refused: list[str]) -> bool:
    """Some files refused, each as a `CheckpointError`."""
    return bool(refused) and all("CheckpointError" in d for d in refused)


def test_damaged_safetensors_and_sharded_files_are_refused_or_loaded(monkeypatch):
    assert _in_bridges_words(_check(monkeypatch, ["safetensors", "sharded"], 6))


@pytest.mark.torch
def test_damaged_gguf_files_are_refused_or_loaded(monkeypatch):
    pytest.importorskip("gguf")
    assert _in_bridges_words(_check(monkeypatch, ["gguf"], 6))
