"""The JAX team's curated NNX models (jax-ml/bonsai, vendored unchanged in
`tests/public/bonsai/`), which name their layers their own way, filled by bridge
from the matching transformers PyTorch model (module and `save_pretrained`
folder) and back, with no rules (`tests/public/bonsai_models.py` builds them;
`tests/public/RESULTS.md` has the table). Every case is exact, or an
`xfail(strict=True)` naming what bridge does not do yet, which flips to a failure
the day it ports exactly (then remove its entry from `NOT_YET`). A case that turns
silently wrong fails, xfail or not.
"""

import functools

import pytest


pytest.importorskip("torch")
pytest.importorskip("transformers")

from .public import (
    bonsai_models,  # noqa: E402
    hf_flax,  # noqa: E402
)
from .public.hf_flax import NotYet, SilentlyWrong  # noqa: E402


NOT_YET: dict[tuple[str, str], str] = {}
WRONG: dict[tuple[str, str], str] = {}
SLOW = {"resnet"}  # bonsai's ResNet has ResNet-50's widths whatever the depth


def _cases():
    for name in bonsai_models.CASES:
        for route in bonsai_models.ROUTES:
            key = (name, route)
            marks = [pytest.mark.slow] if name in SLOW else []
            if key in WRONG:
                marks.append(
                    pytest.mark.xfail(
                        strict=True, raises=SilentlyWrong, reason=WRONG[key]
                    )
                )
            elif key in NOT_YET:
                marks.append(
                    pytest.mark.xfail(strict=True, raises=NotYet, reason=NOT_YET[key])
                )
            yield pytest.param(name, route, id=f"{name}:{route}", marks=marks)


@functools.cache
def _case(name):
    with hf_flax._quiet():
        return bonsai_models.CASES[name]()


@pytest.mark.parametrize(("name", "route"), list(_cases()))
def test_port(name, route):
    outcome = bonsai_models.run_route(_case(name), route)
    if outcome.outcome == "wrong":
        raise SilentlyWrong(f"{name} {route}: {outcome}")
    if outcome.outcome != "exact":
        raise NotYet(f"{name} {route}: {outcome}")
