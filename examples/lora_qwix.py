"""qwix's LoRA into bridge, to PEFT, and to Flax's own `nnx.LoRALinear`.

1. An NNX model adapted by qwix (`qwix.apply_lora_to_model`, rank and alpha in the
   provider's rules), trained 5 SGD steps the qwix way (`nnx.LoRAParam` alone).
2. `bridge.from_qwix_lora(model, rules=provider)`: bridge adapters, the model's own
   class again, the same output as qwix's; `bridge.save_peft` writes them for PEFT.
3. `bridge.to_nnx_lora`: the same adapters as Flax's `nnx.LoRALinear` layers (the
   scaling folded into `lora_b`), the same output again.

Needs `qwix`; without it the example says so and stops.

    python examples/lora_qwix.py
"""

import importlib.util
import json
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import bridge


class Model(nnx.Module):
    def __init__(self, rngs):
        self.q_proj = nnx.Linear(16, 16, rngs=rngs)
        self.v_proj = nnx.Linear(16, 16, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.q_proj(x) + self.v_proj(x)))


def main() -> None:
    if importlib.util.find_spec("qwix") is None:
        print("lora_qwix.py needs qwix: skipped")
        return
    import qwix

    warnings.filterwarnings("ignore", category=DeprecationWarning)  # qwix on flax 0.12
    x = jax.random.normal(jax.random.key(0), (8, 16))
    y = jax.random.normal(jax.random.key(1), (8, 4))

    # 1. qwix's LoRA on q_proj and v_proj, trained the Flax way
    provider = qwix.LoraProvider(module_path="q_proj|v_proj", rank=4, alpha=8.0)
    model = qwix.apply_lora_to_model(Model(nnx.Rngs(0)), provider, x, rngs=nnx.Rngs(1))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.LoRAParam)

    def loss_fn(m):
        return jnp.mean((m(x) - y) ** 2)

    for _ in range(5):
        loss, grads = nnx.value_and_grad(
            loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam)
        )(model)
        opt.update(model, grads)
    print(f"qwix loss after 5 steps: {float(loss):.4f}")
    want = model(x)

    # 2. bridge adapters: no qwix needed to run them any more
    read = bridge.from_qwix_lora(model, rules=provider)
    gap = float(jnp.abs(read(x) - want).max())
    print(f"{type(read).__name__} without qwix: output within {gap:.1e} of qwix's")
    assert gap < 1e-6
    work = Path(tempfile.mkdtemp())
    bridge.save_peft(work / "adapter", read)
    config = json.loads((work / "adapter/adapter_config.json").read_text())
    print("PEFT config:", {k: config[k] for k in ("r", "lora_alpha", "target_modules")})

    # 3. Flax's own LoRA modules
    flax_lora = bridge.to_nnx_lora(read)
    gap = float(jnp.abs(flax_lora(x) - want).max())
    kinds = sorted({type(m).__name__ for _, m in nnx.iter_modules(flax_lora)})
    print(f"layers {kinds}: output within {gap:.1e} of qwix's")
    assert gap < 1e-5 and np.isfinite(gap)


if __name__ == "__main__":
    main()
