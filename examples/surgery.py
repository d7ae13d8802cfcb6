"""Model surgery with `eqx.tree_at` on a `bridge.Tree`, for Flax NNX and Flax Linen.

1. NNX: reinitialise the classifier head with more classes (a leaf of another shape).
2. Linen: replace a hidden layer by a wider one (its kernel, its bias, and the next
   layer's kernel), then run the edited variables with the matching Linen module.

Each step prints the paths that changed; the source model is left as it was.

    python examples/surgery.py
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from flax import nnx

import bridge


def changes(before: bridge.Tree, after: bridge.Tree) -> list[str]:
    """One line per leaf that differs: path, old and new shape."""
    old = {jtu.keystr(p): x for p, x in jtu.tree_leaves_with_path(before)}
    lines = []
    for path, x in jtu.tree_leaves_with_path(after):
        y = old[jtu.keystr(path)]
        if x is not y:
            lines.append(f"  {jtu.keystr(path):<22} {str(y.shape):>8} -> {x.shape}")
    return lines


# --- 1. NNX: a new head with 10 classes instead of 3 ---------------------------------


class Classifier(nnx.Module):
    def __init__(self, classes: int, rngs: nnx.Rngs):
        self.layers = nnx.List(
            [nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, classes, rngs=rngs)]
        )

    def __call__(self, x):
        return self.layers[-1](jax.nn.relu(self.layers[0](x)))


model = Classifier(3, nnx.Rngs(0))
tree = bridge.from_nnx(model)
head = nnx.Linear(16, 10, rngs=nnx.Rngs(1))  # freshly initialised, 10 outputs
new_tree = eqx.tree_at(
    lambda t: (t.layers[-1].kernel, t.layers[-1].bias),
    tree,
    replace=(head.kernel[...], head.bias[...]),
)
new_model = bridge.to_nnx(new_tree)

x = jnp.ones((4, 8))
print("NNX: reinitialise the head")
print("\n".join(changes(tree, new_tree)))
print(f"  outputs: source {model(x).shape}, edited {new_model(x).shape}")
kept = new_model.layers[0].kernel.get_raw_value() is model.layers[0].kernel[...]
print(f"  first layer shared, not copied: {kept}")

# --- 2. Linen: a wider hidden layer ---------------------------------------------------


class MLP(nn.Module):
    widths: tuple[int, ...] = (16, 16)

    @nn.compact
    def __call__(self, x):
        for width in self.widths:
            x = jax.nn.relu(nn.Dense(width)(x))
        return nn.Dense(2)(x)


module = MLP()
variables = module.init(jax.random.key(0), x)
tree = bridge.from_linen(variables, module)
init = nn.initializers.lecun_normal()
k1, k2 = jax.random.split(jax.random.key(2))
new_tree = eqx.tree_at(
    lambda t: (t.Dense_1.kernel, t.Dense_1.bias, t.Dense_2.kernel),
    tree,
    replace=(init(k1, (16, 32)), jnp.zeros(32), init(k2, (32, 2))),
)
new_variables = bridge.to_linen(new_tree)

print("\nLinen: replace Dense_1 by a layer twice as wide")
print("\n".join(changes(tree, new_tree)))
# Linen modules hold their sizes: run the edited variables with a matching module
new_out = MLP(widths=(16, 32)).apply(new_variables, x)
print(f"  outputs: source {module.apply(variables, x).shape}, edited {new_out.shape}")
same = variables["params"]["Dense_1"]["kernel"].shape == (16, 16)
print(f"  source variables unchanged: {same}")
