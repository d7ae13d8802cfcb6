"""Plans and Trees read at 100 columns (issue #23, item 9): a wide plan folds and
cuts nothing, each row names the transform applied; a Tree's repr counts its arrays
per role."""

import numpy as np
from flax import nnx

import bridge

from .helpers import requires


@requires("NNX")
def test_tree_repr_counts_parameters_and_bytes_per_subtree():
    model = nnx.Sequential(
        nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.BatchNorm(3, rngs=nnx.Rngs(0))
    )
    lines = repr(bridge.from_nnx(model)).splitlines()
    assert lines == [
        "Tree (Sequential)  # params: 15 (60 B), batch_stats: 6 (24 B)",
        "  .layers (List)  # params: 15 (60 B), batch_stats: 6 (24 B)",
        "    [0] (Linear)  kernel float32[2,3], bias float32[3]  # 9",
        "    [1] (BatchNorm)  scale float32[3], bias float32[3]; batch_stats: "
        "mean float32[3], var float32[3]  # 6, batch_stats: 6",
    ]


class Wide(nnx.Module):
    def __init__(self, rngs):
        self.a_rather_long_block_name = nnx.List(
            [nnx.Linear(64, 192, rngs=rngs) for _ in range(2)]
        )


@requires("NNX")
def test_a_wide_plan_folds_at_100_columns_and_names_the_transform(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # str(plan) folds at the terminal's width
    sd = {}
    for i in range(2):
        prefix = f"a_rather_long_block_name.{i}.attn.c_attn"
        sd[f"{prefix}.weight"] = np.zeros((64, 192), "f4")  # Conv1D: (in, out)
        sd[f"{prefix}.bias"] = np.zeros(192, "f4")
    source = bridge.from_torch(sd)
    rules = {r"(.*)\.attn\.c_attn": r"\1"}
    plan = bridge.port_plan(source, Wide(nnx.Rngs(0)), rules=rules)
    text = plan.table(width=100)
    assert max(map(len, text.splitlines())) <= 100
    assert "kernel (64, 192), bias (192,)" in text  # the shapes, whole
    assert "Conv1D (in,out) -> Flax" in text and " or " not in text
    wide = plan.table(width=1000)
    assert len(wide.splitlines()) < len(text.splitlines())
    assert str(plan) == text
