"""The launcher of the multi-process tests: one worker script run as the 2 processes
of a `jax.distributed` run on 127.0.0.1 (each process with 4 CPU devices, set by the
worker before it imports jax)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import bridge


def checkout_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python that imports bridge from this
    checkout: the checkout first on PYTHONPATH, the rest of PYTHONPATH kept (an
    accelerator machine finds its JAX there), and JAX_PLATFORMS=cpu (this process
    may hold the chip, which one process at a time can open)."""
    root = str(Path(bridge.__file__).parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu", **extra}


def free_port() -> int:
    """A free TCP port on 127.0.0.1; skips the test where no socket can be opened
    (some sandboxed accelerator machines): jax.distributed cannot run there."""
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    except OSError as e:
        pytest.skip(f"no TCP socket on 127.0.0.1 here ({e}): jax.distributed needs one")


def run_two(script: str | Path, directory: Path, timeout: float) -> list[str]:
    """Run `python script PORT PROCESS_ID DIRECTORY` as processes 0 and 1 (bridge
    from this checkout), wait for both, and return their outputs; fails the test
    with the end of the outputs when either exits with an error."""
    port = free_port()
    root = Path(bridge.__file__).parent.parent
    # JAX_PLATFORMS: on an accelerator machine this process holds the chip
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(port), str(i), str(directory)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)[-3000:]
    return outputs
