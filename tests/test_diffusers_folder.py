"""Hugging Face folders of diffusers (issue 54 item 6): a model's `save_pretrained`
folder (`diffusion_pytorch_model.safetensors`, or its shards and
`diffusion_pytorch_model.safetensors.index.json`, beside a `config.json` naming the
class in `_class_name`) is read as a Hugging Face folder; its model is built from
the config (diffusers' own model class, `from_config`, on the `meta` device) to
trace its forward pass, so that it loads by example inputs alone into a JAX model
with names of its own (`tests/diffusers_twins.py`), outputs as diffusers' own
forward pass; and it is written back as diffusers writes it, opened by
`from_pretrained` with the same outputs. A config naming code of its own is never
built. Each failed on the old code ("is a directory but not a checkpoint written by
bridge.save"). Skipped without torch and diffusers."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.processes import checkout_env


torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from flax import nnx  # noqa: E402

import bridge  # noqa: E402
from bridge._adapters._torch_folder import folder_module  # noqa: E402
from tests.diffusers_twins import Autoencoder, UNet  # noqa: E402


UNET = dict(
    sample_size=8,
    layers_per_block=1,
    block_out_channels=(8, 16),
    down_block_types=("DownBlock2D", "AttnDownBlock2D"),
    up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    norm_num_groups=4,
    attention_head_dim=4,
)
VAE = dict(
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    block_out_channels=(8, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=8,
)
X = np.random.default_rng(0).normal(size=(1, 8, 8, 3)).astype(np.float32)
T = np.array([10], np.int32)
WEIGHTS = "diffusion_pytorch_model.safetensors"


def _saved(cls, config, folder, **options):
    """A diffusers model of random weights (not its initialisation: norms of 1
    and biases of 0 would hide a swap), saved by its own `save_pretrained`."""
    torch.manual_seed(0)
    model = cls(**config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, **options)
    return model


def _torch_out(model, *inputs):
    """A diffusers model's output on channel-last inputs, channel last."""
    x, *rest = inputs
    with torch.no_grad():
        out = model(torch.from_numpy(x.transpose(0, 3, 1, 2)), *map(torch.tensor, rest))
    return out.sample.numpy().transpose(0, 2, 3, 1)


CASES = {  # the class, its config, the JAX twin, the example inputs
    "UNet2DModel": (diffusers.UNet2DModel, UNET, UNet, (X, T)),
    "AutoencoderKL": (diffusers.AutoencoderKL, VAE, Autoencoder, (X,)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_diffusers_folder_loads_by_example_and_saves_back(tmp_path, name):
    cls, config, twin, inputs = CASES[name]
    folder = tmp_path / "theirs"
    model = _saved(cls, config, folder)
    want = _torch_out(model, *inputs)
    mine = bridge.load(folder, like=twin(rngs=nnx.Rngs(1)), example=inputs)
    got = np.asarray(mine(*inputs))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for out, options, files in [
        (tmp_path / "one", {}, {WEIGHTS}),
        (tmp_path / "shards", {"max_shard_size": 20_000}, set()),
    ]:
        bridge.save_pretrained(
            out, mine, like=folder, config=folder, example=inputs, **options
        )
        written = {p.name for p in out.iterdir()}
        assert (out / "config.json").read_text() == (folder / "config.json").read_text()
        if files:
            assert written == files | {"config.json"}
        else:  # shards as diffusers names them
            index = json.loads((out / (WEIGHTS + ".index.json")).read_text())
            shards = set(index["weight_map"].values())
            assert len(shards) > 1
            shard = re.compile(r"diffusion_pytorch_model-\d{5}-of-\d{5}\.safetensors")
            assert all(shard.fullmatch(s) for s in shards), shards
            assert written == shards | {WEIGHTS + ".index.json", "config.json"}
        back = cls.from_pretrained(out).eval()
        np.testing.assert_allclose(_torch_out(back, *inputs), got, rtol=1e-5, atol=1e-5)


def test_a_model_saved_for_a_diffusers_module_in_memory_opens_in_diffusers(tmp_path):
    """`config=unet.config, like=unet` (no folder): diffusers adds `_class_name`
    to a model's config only as it writes it, so the module's own JSON is written
    (the class named, the weights files named as diffusers names them); was
    transformers' `model.safetensors`, which `from_pretrained` does not look for."""
    cls, config, twin, inputs = CASES["UNet2DModel"]
    torch.manual_seed(0)
    like = cls(**config).eval()
    assert "_class_name" not in like.config
    mine = twin(rngs=nnx.Rngs(3))
    out = tmp_path / "out"
    bridge.save_pretrained(out, mine, config=like.config, like=like, example=inputs)
    assert {p.name for p in out.iterdir()} == {WEIGHTS, "config.json"}
    assert json.loads((out / "config.json").read_text())["_class_name"] == cls.__name__
    back = cls.from_pretrained(out).eval()
    np.testing.assert_allclose(
        _torch_out(back, *inputs), np.asarray(mine(*inputs)), rtol=1e-5, atol=1e-5
    )


def test_a_sharded_diffusers_folder_is_read(tmp_path):
    """diffusers' own sharded save (its index and shards) loads as its one-file
    save does."""
    one, shards = tmp_path / "one", tmp_path / "shards"
    _saved(diffusers.AutoencoderKL, VAE, one)
    _saved(diffusers.AutoencoderKL, VAE, shards, max_shard_size="20KB")
    assert (shards / (WEIGHTS + ".index.json")).is_file()
    a, b = _arrays(one), _arrays(shards)
    assert a.keys() == b.keys() and len(a) == 124  # every tensor
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_the_folders_weights_are_found_by_their_names(tmp_path):
    """The one `*.safetensors` beside a config.json (a variant's only where there
    is no other); two are refused naming both; without a config.json (a PEFT
    adapter's folder) none is taken."""
    folder = tmp_path / "vae"
    _saved(diffusers.AutoencoderKL, VAE, folder)
    names = _names(folder)
    assert "encoder.conv_in.weight" in names
    (folder / "diffusion_pytorch_model.fp16.safetensors").write_bytes(
        (folder / WEIGHTS).read_bytes()
    )
    assert _names(folder) == names  # the variant is not read
    (folder / "other.safetensors").write_bytes((folder / WEIGHTS).read_bytes())
    with pytest.raises(bridge.CheckpointError, match="holds several safetensors") as e:
        bridge.load(folder)
    assert "diffusion_pytorch_model.safetensors, other.safetensors" in str(e.value)
    (folder / "config.json").unlink()
    with pytest.raises(bridge.CheckpointError, match="is a directory but not"):
        bridge.load(folder)


def _names(folder):
    return set(_arrays(folder))


def _arrays(folder):
    from bridge._io._read import open_checkpoint, read

    with open_checkpoint(folder) as contents:
        return {k: np.asarray(v) for k, v in read(contents).items()}


# what evil.py does when imported: a file beside it, the proof it ran
EVIL = """
import pathlib
pathlib.Path(__file__).with_name("IMPORTED").write_text("the folder's code ran")
import diffusers
class Evil(diffusers.AutoencoderKL):
    pass
"""
HOSTILE = {  # a change to the folder's config.json: the start of the refusal
    "a module and a class": (
        {"_class_name": ["evil", "Evil"]},
        "its config.json names code of its own (_class_name: ['evil', 'Evil'])",
    ),
    "auto_map": (
        {"auto_map": {"AutoModel": "evil.Evil"}},
        "its config.json names code of its own (auto_map",
    ),
    "custom_pipeline": (
        {"custom_pipeline": "evil"},
        "its config.json names code of its own (custom_pipeline: 'evil')",
    ),
    "AutoModel": ({"_class_name": "AutoModel"}, "its config.json is not read"),
    "a pipeline": ({"_class_name": "DiffusionPipeline"}, "its config.json is not"),
    "not a name": ({"_class_name": "evil.Evil"}, "its config.json is not read"),
}
LOAD = """
import sys
import numpy as np
from flax import nnx
import bridge
from tests.diffusers_twins import Autoencoder
try:
    x = np.zeros((1, 8, 8, 3), np.float32)
    bridge.load(sys.argv[1], like=Autoencoder(rngs=nnx.Rngs(0)), example=(x,))
except bridge.PortError as e:
    print(e)
"""


def _download(tmp_path, change):
    folder = tmp_path / "download"
    _saved(diffusers.AutoencoderKL, VAE, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    (folder / "evil.py").write_text(EVIL)
    return folder


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_diffusers_config_naming_code_is_not_built(tmp_path, case):
    """Nothing a config names outside diffusers' own model classes is imported or
    built: the refusal says why in one line."""
    change, reason = HOSTILE[case]
    folder = _download(tmp_path, change)
    built = folder_module(folder)
    assert built.module is None
    assert built.reason.startswith(reason), built.reason
    assert "\n" not in built.reason
    assert not (folder / "IMPORTED").exists()


def test_a_load_of_such_a_folder_never_asks_nor_imports(tmp_path):
    """The load by example, in a child Python whose stdin says "y", asks nothing,
    imports nothing and says why the folder's model was not built."""
    change, reason = HOSTILE["a module and a class"]
    folder = _download(tmp_path, change)
    done = subprocess.run(
        [sys.executable, "-c", LOAD, str(folder)],
        input="y\n",
        capture_output=True,
        text=True,
        timeout=300,
        env=checkout_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert reason in done.stdout, done.stdout[-2000:]
    assert not (folder / "IMPORTED").exists()
