"""Hugging Face transformers' own Flax (Linen) model classes against their PyTorch
twins, ported by bridge with no rules, four routes each (`tests/public/hf_flax.py`
builds them; `tests/public/RESULTS.md` has the table): every case is exact, or
refused for a reason the computation cannot settle (its message asserted), or an
`xfail(strict=True)` naming what bridge does not do yet, which flips to a failure
the day it ports exactly (then remove its entry from `NOT_YET`). A model whose
PyTorch side stores a table its Flax side computes (`COMPUTED`) is refused with
`strict=True`, naming it, and exact with `strict=False`, which reports exactly those
tables.

Needs transformers 4.x (the last releases with Flax classes) beside torch: `nox -s
tests_public`. A case that turns silently wrong fails, xfail or not.
"""

import functools

import pytest


pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) >= 5:
    pytest.skip(
        "transformers 5 has no Flax classes: `nox -s tests_public` installs 4.57",
        allow_module_level=True,
    )

from .public import hf_flax  # noqa: E402
from .public.hf_flax import NotYet, SilentlyWrong  # noqa: E402


# (model, route): why it does not port exactly yet
NOT_YET: dict[tuple[str, str], str] = {}
# silently wrong today: the fix is exact
WRONG: dict[tuple[str, str], str] = {}
# refused for a reason the computation cannot settle
REFUSED: dict[tuple[str, str], str] = {}
# the PyTorch side stores a sinusoidal position table (`embed_positions.weight`)
# that the Flax module computes: refused under strict=True ("computed by the
# target/source/model"), exact under strict=False, which reports these tables
_SEQ2SEQ_TABLES = frozenset({"encoder.embed_positions", "decoder.embed_positions"})
COMPUTED = {
    (model, route): tables
    for model, tables in (
        ("roformer", frozenset({"encoder.embed_positions"})),
        ("marian", _SEQ2SEQ_TABLES),
        ("pegasus", _SEQ2SEQ_TABLES),
    )
    for route in hf_flax.ROUTES
}
# transformers' own Flax and PyTorch Electra compute different functions (its own
# converter is off by O(1)): no port can be judged (electra-mlm: bridge's
# torch->flax parameters equal that converter's, bit for bit, on all 44 arrays)
LEFT_OUT = {"electra", "electra-mlm"}


def _cases():
    for arch in hf_flax.ARCHS:
        if arch.id in LEFT_OUT:
            continue
        for route in hf_flax.ROUTES:
            key = (arch.id, route)
            if key in WRONG:
                marks = pytest.mark.xfail(
                    strict=True, raises=SilentlyWrong, reason=WRONG[key]
                )
            elif key in NOT_YET:
                marks = pytest.mark.xfail(
                    strict=True, raises=NotYet, reason=NOT_YET[key]
                )
            else:
                marks = ()
            yield pytest.param(arch, route, id=f"{arch.id}:{route}", marks=marks)


@functools.cache
def _built(model):
    arch = next(arch for arch in hf_flax.ARCHS if arch.id == model)
    with hf_flax._quiet():
        return hf_flax.build(arch)


@pytest.mark.parametrize(("arch", "route"), list(_cases()))
def test_port(arch, route):
    built = _built(arch.id)
    with hf_flax._quiet():
        outcome = hf_flax.run_route(built, route)
    if outcome.outcome == "wrong":
        raise SilentlyWrong(f"{arch.id} {route}: {outcome}")
    tables = COMPUTED.get((arch.id, route))
    if tables is not None:
        assert outcome.outcome == "refused", outcome
        assert len(outcome.problems) == len(tables), outcome.problems
        for problem in outcome.problems:
            assert "embed_positions" in problem and "computed by" in problem, problem
            assert "strict=False" in problem, problem
        with hf_flax._quiet():
            relaxed = hf_flax.run_route(built, route, strict=False)
        assert relaxed.outcome == "exact", relaxed
        named = {n.strip(".").removesuffix(".weight") for n in relaxed.computed}
        assert named == tables and len(relaxed.computed) == len(tables), relaxed
        return
    expected = REFUSED.get((arch.id, route))
    if expected is not None:
        assert outcome.outcome == "refused", outcome
        assert any(expected in p for p in outcome.problems), outcome.problems
    elif outcome.outcome != "exact":
        raise NotYet(f"{arch.id} {route}: {outcome}")
