"""The walk of `bridge.port`'s `source` through the code (`scripts/walk_layers.py`,
issue 50): a reader following the model through a port stays in at most 30 rooms in
a row and climbs back up the import layers at most 5 times, traced or not, and
`port_plan` likewise. The walk of 8963ebd (before the port was five steps): 41 stays
and 8 climbs for a traced port, 36 and 7 for its plan."""

from pathlib import Path

import pytest

from .helpers import script


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "name",
    [
        "port (NNX -> Equinox)",
        "port, traced (example=)",
        "port_plan, traced (example=)",
    ],
)
def test_the_walk_of_a_port_stays_under_30_and_climbs_at_most_5_times(name, tmp_path):
    walk_layers = script("walk_layers")
    layer = walk_layers._layers(ROOT / "tests" / "test_imports.py")
    run, source = walk_layers.scenarios(tmp_path)[name]
    run()  # compiled and cached: the walk reads the calls, not their first costs
    walked = walk_layers.walk(run, source, layer)
    assert "bridge._port._planning" in walked.rooms  # the walk sees the port
    assert len(walked.stays) <= 30, walked.stays
    assert len(walked.climbs) <= 5, walked.climbs
