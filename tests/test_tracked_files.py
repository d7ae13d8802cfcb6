"""No tracked file names a path of the machine it was written on (issue 50): a
results page naming a shared folder, a temporary install folder, a local package
index or a virtualenv, a doc output showing a random temporary folder
(`/tmp/tmp9wcpomv2/net.safetensors`): a reader has none of them. Pages show paths a
reader recognises (`net.safetensors`, written in the current folder)."""

import re
import subprocess
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent

MACHINE = re.compile(
    r"(?<![\w.])("
    r"/work/|/root/|/home/[a-z_][\w-]*/|/Users/\w|/opt/\w|/var/folders/|"
    r"/tmp/tmp[a-z0-9_]{6,}|file:///\w|[A-Z]:\\\\Users\\\\"
    r")"
)
"""Absolute paths that name one machine: its home and work folders, a random
temporary folder (`tempfile.mkdtemp()`'s), a local package index."""


def _tracked() -> list[Path]:
    try:
        names = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [ROOT / n for n in names]


def test_no_tracked_file_names_a_path_of_this_machine():
    found = []
    for path in _tracked():
        if path == Path(__file__).resolve():  # its own examples, below
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):  # a binary file, a submodule
            continue
        for number, line in enumerate(text.splitlines(), 1):
            match = MACHINE.search(line)
            if match:
                where = path.relative_to(ROOT)
                found.append(
                    f"{where}:{number}: {match.group(1)} in {line.strip()[:80]}"
                )
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "  measured with /work/shared/FACTS.md",
        "pip install --index-url file:///opt/pypi/simple --target /tmp/idx",
        "/tmp/tmp9wcpomv2/net.safetensors does not fit the model",
        "transformers 5.25 (`/home/alice/venv`)",
    ],
)
def test_the_pattern_finds_what_it_is_for(line):
    assert MACHINE.search(line)


@pytest.mark.parametrize(
    "line",
    ["net.safetensors does not fit", "a .gitignore's /tmp/", r'_TMP = r"/tmp/tmp\w+/"'],
)
def test_the_pattern_leaves_what_names_no_machine(line):
    assert not MACHINE.search(line)
