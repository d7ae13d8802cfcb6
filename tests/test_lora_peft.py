"""LoRA against PEFT: for NNX, Linen and Equinox models, the bridge LoRA forward
equals PEFT's on the same base weights and adapters; `save_peft` -> PEFT, PEFT ->
`load_peft`, `merge_lora` against `merge_and_unload`. Skipped without torch and peft
(`nox -s tests_torch` installs them)."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bridge

from .lora_models import LENGTH, OUT, VOCAB, WIDTH, models, run


torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
# minutes of compilation: `nox -s tests_torch` runs them, the fast suite does not
pytestmark = pytest.mark.slow

TARGETS = ["emb", "q", "conv", "head"]
IDS = np.array([[1, 2, 3, 4, 5], [9, 0, 8, 7, 1]])
assert IDS.shape[1] == LENGTH


class Torch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.q = torch.nn.Linear(WIDTH, WIDTH)
        self.conv = torch.nn.Conv1d(WIDTH, WIDTH, 3, padding=1)
        self.head = torch.nn.Linear(WIDTH, OUT, bias=False)

    def forward(self, ids):
        x = torch.relu(self.q(self.emb(ids)))
        return self.head(self.conv(x.transpose(1, 2)).transpose(1, 2))


def _base():
    torch.manual_seed(0)
    return Torch()


def _peft(base, **config):
    config = {"r": 2, "lora_alpha": 4, "target_modules": TARGETS, **config}
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**config))
    with torch.no_grad():  # nonzero adapters, so that they count
        for name, p in model.named_parameters():
            if "lora" in name:
                p.normal_(0.0, 0.3)
    return model


def _torch_out(model):
    with torch.no_grad():
        return model(torch.tensor(IDS)).numpy()


FRAMEWORKS = ["nnx", "linen", "equinox"]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("rslora", [False, True])
def test_load_peft_forward_equals_peft(tmp_path, framework, rslora):
    """(With rslora, also lora_dropout=0.5: PEFT's eval mode drops nothing, and
    load_peft gives the adapters in inference mode, as from_pretrained does.)"""
    base = _base()
    model = _peft(base, use_rslora=rslora, lora_dropout=0.5 if rslora else 0.0).eval()
    model.save_pretrained(tmp_path)
    jax_model = bridge.port(base, models()[framework])
    adapted = bridge.load_peft(tmp_path, jax_model)
    got = np.asarray(run(adapted, jnp.asarray(IDS)))
    np.testing.assert_allclose(got, _torch_out(model), atol=1e-5, rtol=0)
    # the base model's own output differs: the adapters count
    assert np.abs(np.asarray(run(jax_model, jnp.asarray(IDS))) - got).max() > 1e-2


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_save_peft_loads_in_peft(tmp_path, framework):
    base = _base()
    jax_model = bridge.port(base, models()[framework])
    adapted = bridge.lora(jax_model, TARGETS, rank=3, alpha=6, key=jax.random.key(1))
    tree = bridge.to_neutral(adapted)
    tree = jax.tree_util.tree_map_with_path(  # train-like nonzero adapters
        lambda p, x: (
            x + 0.2 * jax.random.normal(jax.random.key(len(p)), x.shape)
            if "lora" in jax.tree_util.keystr(p)
            else x
        ),
        tree,
    )
    bridge.save_peft(tmp_path / "adapter", tree)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter")
    got = np.asarray(run(bridge.to_native(tree), jnp.asarray(IDS)))
    np.testing.assert_allclose(got, _torch_out(loaded), atol=1e-5, rtol=0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_trained_in_torch_then_loaded(tmp_path, framework):
    base = _base()
    model = _peft(base, lora_dropout=0.0)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 1e-2)
    target = torch.randn(IDS.shape + (OUT,))
    for _ in range(3):
        opt.zero_grad()
        loss = ((model(torch.tensor(IDS)) - target) ** 2).mean()
        loss.backward()
        opt.step()
    model.save_pretrained(tmp_path)
    adapted = bridge.load_peft(tmp_path, bridge.port(base, models()[framework]))
    got = np.asarray(run(adapted, jnp.asarray(IDS)))
    np.testing.assert_allclose(got, _torch_out(model), atol=1e-5, rtol=0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_merge_equals_merge_and_unload(tmp_path, framework):
    base = _base()
    model = _peft(base)
    model.save_pretrained(tmp_path)
    adapted = bridge.load_peft(tmp_path, bridge.port(base, models()[framework]))
    merged = bridge.merge_lora(adapted)
    unloaded = model.merge_and_unload()
    back = bridge.port(merged, copy.deepcopy(base))  # a PyTorch state dict
    want = unloaded.state_dict()
    assert set(back) == set(want)
    for name, array in back.items():
        np.testing.assert_allclose(
            np.asarray(array), want[name].numpy(), atol=1e-6, rtol=0, err_msg=name
        )
    got = np.asarray(run(merged, jnp.asarray(IDS)))
    np.testing.assert_allclose(got, _torch_out(model), atol=1e-5, rtol=0)
