"""The name clash with Flax's `flax.nnx.bridge` (issue #40, item 3): whichever of the
two a later import binds to `bridge`, the AttributeError of the hidden one's names
says what happened and gives the two-line fix. In a fresh process: bridge imported
before Flax is the case to check (the guard is put on Flax's module when it loads)."""

import subprocess
import sys

from .processes import checkout_env


CODE = """
def error(get):
    try:
        get()
    except AttributeError as e:
        return str(e)

import bridge
from flax.nnx import bridge  # Flax's bound last
print(error(lambda: bridge.port))
print(error(lambda: bridge.nothing_here))
import bridge  # this package bound last
print(error(lambda: bridge.ToNNX))
print(error(lambda: bridge.nothing_here))
"""


def test_the_hidden_module_s_names_say_what_happened():
    done = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, env=checkout_env()
    )
    flax_port, flax_other, ours_flax, ours_other = done.stdout.splitlines()
    fix = "from flax.nnx import bridge as nnx_bridge"
    assert flax_port.startswith("module 'flax.nnx.bridge' has no attribute 'port'. ")
    assert "is a name of the bridge package" in flax_port and fix in flax_port
    assert flax_other == "module 'flax.nnx.bridge' has no attribute 'nothing_here'"
    assert ours_flax.startswith("module 'bridge' has no attribute 'ToNNX'. ")
    assert "This `bridge` is the bridge package" in ours_flax and fix in ours_flax
    assert ours_other == "module 'bridge' has no attribute 'nothing_here'"
