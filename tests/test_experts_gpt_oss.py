"""gpt-oss's packed experts (transformers' `GptOssExperts`: `gate_up_proj` `(E, D, 2F)`
with gate and up columns interleaved, `down_proj` `(E, F, D)`, both with biases) read
per expert from a `save_pretrained` folder of a tiny random `GptOssForCausalLM`
(D == 2F, where the shape alone cannot tell it from Qwen's `(E, 2F, D)`), checked
against the slices and the forward of transformers' own experts; a layer missing one of
the four tensors is refused. Skipped without torch and transformers."""

import numpy as np
import pytest
import safetensors.numpy

import bridge


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

D, F, E, LAYERS = 32, 16, 4, 2  # D == 2F: the ambiguous shape
EXPERTS = "model.layers.{layer}.mlp.experts"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    config = transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=E,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).float().eval()
    with torch.no_grad():  # the biases start at zero: make them count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def test_gpt_oss_folder_read_per_expert(folder):
    path, model = folder
    state = bridge.to_torch(bridge.load(path))
    for layer in range(LAYERS):
        experts = model.model.layers[layer].mlp.experts
        gate_up = experts.gate_up_proj.detach().numpy()
        gate_up_bias = experts.gate_up_proj_bias.detach().numpy()
        down = experts.down_proj.detach().numpy()
        down_bias = experts.down_proj_bias.detach().numpy()
        x = torch.randn(5, D)
        for e in range(E):
            name = f"{EXPERTS.format(layer=layer)}.{e}"
            w = {k: np.asarray(v) for k, v in state.items() if k.startswith(name + ".")}
            # bits: the slices GptOssExperts.forward uses, in (out, in) orientation
            np.testing.assert_array_equal(
                w[f"{name}.gate_proj.weight"], gate_up[e, :, ::2].T
            )
            np.testing.assert_array_equal(
                w[f"{name}.up_proj.weight"], gate_up[e, :, 1::2].T
            )
            np.testing.assert_array_equal(
                w[f"{name}.gate_proj.bias"], gate_up_bias[e, ::2]
            )
            np.testing.assert_array_equal(
                w[f"{name}.up_proj.bias"], gate_up_bias[e, 1::2]
            )
            np.testing.assert_array_equal(w[f"{name}.down_proj.weight"], down[e].T)
            np.testing.assert_array_equal(w[f"{name}.down_proj.bias"], down_bias[e])
            # outputs: transformers' forward with every token routed to expert e
            with torch.no_grad():
                expected = experts(x, torch.full((5, 1), e), torch.ones(5, 1)).numpy()
            t = {k: torch.from_numpy(np.array(v)) for k, v in w.items()}
            lin = torch.nn.functional.linear
            gate = lin(x, t[f"{name}.gate_proj.weight"], t[f"{name}.gate_proj.bias"])
            up = lin(x, t[f"{name}.up_proj.weight"], t[f"{name}.up_proj.bias"])
            gate = gate.clamp(max=experts.limit)
            up = up.clamp(-experts.limit, experts.limit)
            hidden = (up + 1) * gate * torch.sigmoid(gate * experts.alpha)
            got = lin(
                hidden, t[f"{name}.down_proj.weight"], t[f"{name}.down_proj.bias"]
            )
            np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert not any(k.endswith(("gate_up_proj", "gate_up_proj_bias")) for k in state)


def test_gpt_oss_incomplete_layer_refused(folder, tmp_path):
    path, _ = folder
    (shard,) = path.glob("*.safetensors")
    tensors = safetensors.numpy.load_file(shard)
    del tensors[f"{EXPERTS.format(layer=1)}.down_proj_bias"]
    tensors[f"{EXPERTS.format(layer=0)}.down_proj"] = np.zeros((E, D, D), "f4")
    safetensors.numpy.save_file(tensors, tmp_path / "m.safetensors", {"format": "pt"})
    with pytest.raises(ValueError, match="gpt-oss") as info:
        bridge.load(tmp_path / "m.safetensors")
    message = str(info.value)  # both layers' problems, with what was found
    assert f"{EXPERTS.format(layer=0)}: gpt-oss" in message
    assert "down_proj (4, 32, 32)" in message
    assert "down_proj_bias missing" in message
