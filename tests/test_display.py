"""How a Tree, a port plan and a report look (issue 52, "Look, don't read"): one
line per layer in a terminal, repeated blocks folded, as HTML in Jupyter
(`_repr_html_`) and in treescope (`__treescope_repr__`), never reading an array's
values. The HTML was checked in headless Chromium by hand; here it is parsed."""

import html.parser
import re
import time

import jax
import numpy as np
import pytest
import treescope
from flax import nnx

import bridge

from .helpers import requires


# treescope reads numpy's public names on first use: numpy 2.5 deprecates one
pytestmark = pytest.mark.filterwarnings(
    "ignore:The chararray class is deprecated:DeprecationWarning"
)


class Reads:
    """An array-like leaf that counts every read of its values."""

    count = 0

    def __init__(self, shape):
        self.shape = shape
        self.dtype = np.dtype("float32")

    def __array__(self, *args, **kwargs):
        Reads.count += 1
        return np.zeros(self.shape, self.dtype)

    def __jax_array__(self):
        Reads.count += 1
        return jax.numpy.zeros(self.shape, self.dtype)


def _thousand(leaf):
    """A Linen model of 500 Dense layers: 1,000 leaves."""
    layers = {
        f"Dense_{i}": {"kernel": leaf((4, 4)), "bias": leaf((4,))} for i in range(500)
    }
    return bridge.from_linen({"params": layers})


class _Balanced(html.parser.HTMLParser):
    """Every tag closed in order (the HTML Jupyter shows is well formed)."""

    VOID = {"br", "hr", "img", "meta"}

    def __init__(self):
        super().__init__()
        self.open: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_endtag(self, tag):
        assert self.open and self.open.pop() == tag, (tag, self.open[-3:])


def _balanced(text: str) -> None:
    parser = _Balanced()
    parser.feed(text)
    parser.close()
    assert parser.open == []


@pytest.mark.parametrize("leaf", [Reads, lambda s: jax.ShapeDtypeStruct(s, "f4")])
def test_a_thousand_leaves_render_at_once_without_reading_a_value(leaf):
    """Text, HTML and treescope of 1,000 leaves (counted reads, and abstract
    leaves, which hold none); one folded line in a terminal."""
    Reads.count = 0
    tree = _thousand(leaf)
    start = time.perf_counter()
    text, page = repr(tree), tree._repr_html_()
    shown = treescope.render_to_text(tree)
    seconds = time.perf_counter() - start
    assert Reads.count == 0
    assert text.splitlines() == [
        "Tree  # params: 10,000 (39.1 KiB)",
        "  .Dense_0..499: 500 ×  kernel float32[4,4], bias float32[4]  # each: 20",
    ]
    assert "500 ×" in page and "500 ×" in shown
    _balanced(page)
    assert seconds < 5  # about 0.05 s on a quiet machine: generous


def test_a_pytorch_layout_tree_keeps_each_line_whole():
    """`print(tree)` of a state dict's Tree cut the `# params:` comments, more the
    deeper the line (`[0..1]: 2 × rams: 7,504`, `.attention: ms: 4,288`)."""
    f = np.zeros
    state = {
        f"encoder.layer.{i}.attention.self.{n}.{w}": f((8, 8) if w == "weight" else 8)
        for i in range(2)
        for n in ("query", "key")
        for w in ("weight", "bias")
    }
    state["pooler.dense.weight"] = f((8, 8))
    lines = repr(bridge.from_torch(state)).splitlines()
    assert lines == [
        "Tree  # params: 352 (2.8 KiB)",
        "  .encoder.layer  # params: 288 (2.2 KiB)",
        "    [0..1].attention.self: 2 ×  # each: params: 144 (1.1 KiB)",
        "      .query  weight float64[8,8], bias float64[8]  # 72",
        "      .key  weight float64[8,8], bias float64[8]  # 72",
        "  .pooler.dense  weight float64[8,8]  # 64",
    ]


@requires("NNX")
def test_layers_show_their_kind_and_non_params_roles():
    """A run of equal blocks is one line over the first block's, closed in HTML."""
    block = lambda: nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))  # noqa: E731
    model = nnx.Sequential(
        *[block() for _ in range(3)], nnx.BatchNorm(4, rngs=nnx.Rngs(0))
    )
    lines = repr(bridge.from_nnx(model)).splitlines()
    assert lines[2:6] == [
        "    [0..2]: 3 × (Sequential)  # each: params: 20 (80 B)",
        "      .layers (List)  # params: 20 (80 B)",
        "        [0] (Linear)  kernel float32[4,4], bias float32[4]  # 20",
        "    [3] (BatchNorm)  scale float32[4], bias float32[4]; batch_stats: "
        "mean float32[4], var float32[4]  # 8, batch_stats: 8",
    ]
    page = bridge.from_nnx(model)._repr_html_()
    _balanced(page)
    assert re.search(r"<details><summary[^>]*><span[^>]*>\[0\.\.2\]", page)


@requires("NNX")
def test_a_plan_and_a_report_as_html_and_in_treescope():
    """The plan a table, a run of numbered layers one row with its pairs in a
    fold, how each pair was decided; what is left highlighted."""

    class Blocks(nnx.Module):
        def __init__(self, rngs, n):
            self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(n)])

    source, target = Blocks(nnx.Rngs(0), 3), Blocks(nnx.Rngs(1), 4)
    with pytest.raises(bridge.PortError):
        bridge.port(source, target)
    plan = bridge.port_plan(source, target)
    page = plan._repr_html_()
    _balanced(page)
    assert "3 × .blocks[0..2]" in page and "missing: kept as they are (1)" in page
    text = treescope.render_to_text(plan)
    assert text.startswith("Plan: 3 layers paired (3 by path): 1 missing")
    _, report = bridge.port(source, target, strict=False, report=True)
    page = report._repr_html_()
    _balanced(page)
    assert "Report (incomplete)" in page and ".blocks[3]" in page
    assert treescope.render_to_text(report).startswith("Report (incomplete)")
