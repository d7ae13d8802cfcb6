"""A downloaded folder never runs its own code nor asks a question: a `config.json`
naming code of its own (`auto_map`, `trust_remote_code`, `custom_pipelines`), or an
`architectures` entry that is not one of transformers' model classes, is not built
(`_torch_folder.folder_module`), and the load that would trace it goes on without the
trace, saying why in one line. transformers' auto classes would print "Do you wish to
run the custom code? [y/N]", read stdin and, on "y", import the folder's Python file.
Each load runs in a child Python whose stdin says "y": the folder's file must not be
imported and nothing asked. Skipped without torch and transformers."""

import json
import subprocess
import sys

import pytest

from tests.processes import checkout_env


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bridge._adapters._torch_folder import folder_module  # noqa: E402


SMALL = dict(
    hidden_size=16,
    intermediate_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    num_hidden_layers=1,
    vocab_size=32,
)
# what evil.py does when imported: a file beside it, the proof it ran
EVIL = """
import pathlib
pathlib.Path(__file__).with_name("IMPORTED").write_text("the folder's code ran")
import transformers
class Evil(transformers.LlamaForCausalLM):
    pass
class EvilConfig(transformers.LlamaConfig):
    model_type = "evil"
"""
# each a change to a Llama folder's config.json, as found on the hub or written to harm
HOSTILE = {
    # the auto class named in architectures: transformers asked on stdin
    "auto class": {
        "architectures": ["AutoModelForSeq2SeqLM"],
        "auto_map": {"AutoModelForSeq2SeqLM": "evil.Evil"},
    },
    "auto_map": {"auto_map": {"AutoModelForCausalLM": "evil.Evil"}},
    "custom model type": {
        "model_type": "evil",
        "architectures": ["Evil"],
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.Evil"},
    },
    "trust_remote_code": {"trust_remote_code": True},
    "nested": {"text_config": {"auto_map": {"AutoModel": "evil.Evil"}}},
}
LOAD = """
import sys
import jax.numpy as jnp
from flax import nnx
import bridge

class Mine(nnx.Module):  # names of its own: the load needs the folder's trace
    def __init__(self):
        self.emb = nnx.Embed(32, 16, rngs=nnx.Rngs(0))
        self.q = nnx.Linear(16, 16, use_bias=False, rngs=nnx.Rngs(1))
    def __call__(self, ids):
        return self.q(self.emb(ids))

try:
    bridge.load(sys.argv[1], like=Mine(), example=(jnp.zeros((1, 4), jnp.int32),))
except bridge.PortError as e:
    print(e)
"""


def _folder(tmp_path, change):
    folder = tmp_path / "download"
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(change, _name_or_path=str(folder))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(EVIL)
    return folder


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_folder_naming_its_own_code_is_not_built(tmp_path, case):
    folder = _folder(tmp_path, HOSTILE[case])
    built = folder_module(folder)
    assert built.module is None
    assert built.reason.startswith("its config.json names code of its own ("), built
    assert "never imports or runs" in built.reason
    assert "\n" not in built.reason
    assert not (folder / "IMPORTED").exists()


@pytest.mark.parametrize("stdin", ["y\n", None])
def test_a_load_with_example_inputs_never_asks_nor_imports(tmp_path, stdin):
    """stdin says "y" (or is closed): the load ends, asks nothing, imports nothing,
    and its refusal names the folder's code."""
    folder = _folder(tmp_path, HOSTILE["auto class"])
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(folder)],
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        env=checkout_env(),
    )
    shown = done.stdout + done.stderr
    assert done.returncode == 0, shown[-3000:]
    assert not (folder / "IMPORTED").exists()
    assert "[y/N]" not in shown and "custom code" not in shown
    assert "names code of its own (auto_map: {'AutoModelForSeq2SeqLM'" in shown


def test_architectures_other_than_a_model_class_are_not_built():
    """`architectures` naming something of transformers that is not a model class
    (a function, an auto class, a dunder) builds the base model of `model_type`
    instead, never calls what it names."""
    for name in ["pipeline", "AutoModelForSeq2SeqLM", "__class__", "a.b", 3]:
        config = {"model_type": "llama", **SMALL, "architectures": [name]}
        built = folder_module(config)
        assert type(built.module).__name__ == "LlamaModel", (name, built.reason)
