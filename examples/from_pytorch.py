"""From a PyTorch / Hugging Face checkpoint to NNX and Equinox, and back: no torch.

The checkpoint is made here with numpy, as `save_pretrained(..., max_shard_size=...)`
writes a small BERT-style encoder block: PyTorch names (`encoder.layer.0.attention.
self.query.weight`), PyTorch layouts (`nn.Linear` weight `(out, in)`), two shards and a
`model.safetensors.index.json`. It is loaded into an NNX model and an Equinox model
written with the same names, checked against the PyTorch definitions computed with
numpy, then written back in PyTorch layout, bit for bit.
"""

import json
import tempfile
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import safetensors.numpy
from flax import nnx

import bridge


D, HIDDEN, VOCAB = 8, 16, 20
R = np.random.default_rng(0)


def pytorch_state() -> dict[str, np.ndarray]:
    """What `BertLayer`-like PyTorch modules hold (fused into one small block)."""
    f = lambda *shape: R.normal(size=shape).astype("float32")  # noqa: E731
    return {
        "embeddings.word_embeddings.weight": f(VOCAB, D),
        "embeddings.LayerNorm.weight": 1 + f(D) / 10,
        "embeddings.LayerNorm.bias": f(D) / 10,
        "encoder.layer.0.intermediate.dense.weight": f(HIDDEN, D),  # (out, in)
        "encoder.layer.0.intermediate.dense.bias": f(HIDDEN),
        "encoder.layer.0.output.dense.weight": f(D, HIDDEN),
        "encoder.layer.0.output.dense.bias": f(D),
    }


def save_sharded(state: dict, folder: Path) -> None:
    """Two shards and an index, as Hugging Face's save_pretrained writes them."""
    names = list(state)
    weight_map = {}
    for i, part in enumerate((names[:3], names[3:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        shard = {n: state[n] for n in part}
        safetensors.numpy.save_file(shard, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def reference(state: dict, ids: np.ndarray) -> np.ndarray:
    """PyTorch's definitions, in numpy: Embedding, LayerNorm (eps 1e-12), Linear."""
    x = state["embeddings.word_embeddings.weight"][ids]
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    x = (x - mean) / np.sqrt(var + 1e-12)
    x = x * state["embeddings.LayerNorm.weight"] + state["embeddings.LayerNorm.bias"]
    layer = "encoder.layer.0."
    h = x @ state[layer + "intermediate.dense.weight"].T
    h = np.maximum(h + state[layer + "intermediate.dense.bias"], 0)
    out_weight, out_bias = (
        state[layer + f"output.dense.{e}"] for e in ("weight", "bias")
    )
    return h @ out_weight.T + out_bias


class Node(nnx.Module):
    def __init__(self, **children):
        for name, child in children.items():
            setattr(self, name, child)


def nnx_model() -> Node:
    rngs = nnx.Rngs(0)
    return Node(
        embeddings=Node(
            word_embeddings=nnx.Embed(VOCAB, D, rngs=rngs),
            LayerNorm=nnx.LayerNorm(D, epsilon=1e-12, rngs=rngs),
        ),
        encoder=Node(
            layer=nnx.List(
                [
                    Node(
                        intermediate=Node(dense=nnx.Linear(D, HIDDEN, rngs=rngs)),
                        output=Node(dense=nnx.Linear(HIDDEN, D, rngs=rngs)),
                    )
                ]
            )
        ),
    )


def nnx_forward(m: Node, ids):
    x = m.embeddings.LayerNorm(m.embeddings.word_embeddings(ids))
    layer = m.encoder.layer[0]
    return layer.output.dense(jax.nn.relu(layer.intermediate.dense(x)))


class Embeddings(eqx.Module):
    word_embeddings: eqx.nn.Embedding
    LayerNorm: eqx.nn.LayerNorm


class Dense(eqx.Module):
    dense: eqx.nn.Linear


class Layer(eqx.Module):
    intermediate: Dense
    output: Dense


class Encoder(eqx.Module):
    layer: list


class EqxModel(eqx.Module):
    embeddings: Embeddings
    encoder: Encoder

    def __call__(self, ids):
        e, layer = self.embeddings, self.encoder.layer[0]
        x = jax.vmap(lambda i: e.LayerNorm(e.word_embeddings(i)))(ids)
        h = jax.vmap(lambda v: jax.nn.relu(layer.intermediate.dense(v)))(x)
        return jax.vmap(layer.output.dense)(h)


def eqx_model() -> EqxModel:
    k = iter(jax.random.split(jax.random.key(0), 3))
    return EqxModel(
        Embeddings(
            eqx.nn.Embedding(VOCAB, D, key=next(k)), eqx.nn.LayerNorm(D, eps=1e-12)
        ),
        Encoder(
            [
                Layer(
                    Dense(eqx.nn.Linear(D, HIDDEN, key=next(k))),
                    Dense(eqx.nn.Linear(HIDDEN, D, key=next(k))),
                )
            ]
        ),
    )


def main() -> None:
    state = pytorch_state()
    ids = np.array([1, 7, 3, 19])
    expected = reference(state, ids)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_sharded(state, folder)

        # the plan: PyTorch names and layouts -> the NNX model's
        print(bridge.port_plan(bridge.load(folder), nnx_model()))

        model = bridge.load(folder, like=nnx_model())
        diff = float(np.abs(nnx_forward(model, ids) - expected).max())
        print(f"NNX vs the PyTorch definitions: max |diff| = {diff:.1e}")
        assert diff < 1e-5

        twin = bridge.load(folder, like=eqx_model())
        diff = float(np.abs(twin(ids) - expected).max())
        print(f"Equinox vs the PyTorch definitions: max |diff| = {diff:.1e}")
        assert diff < 1e-5

        # back to PyTorch layout: the names and arrays the checkpoint had
        bridge.save_state_dict(folder / "model.safetensors", twin)
        back = safetensors.numpy.load_file(folder / "model.safetensors")
        assert back.keys() == state.keys()
        assert all(np.array_equal(back[k], state[k]) for k in state)
        print(f"exported {len(back)} arrays in PyTorch layout, bit for bit")


if __name__ == "__main__":
    main()
