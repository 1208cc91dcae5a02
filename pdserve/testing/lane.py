"""The router's compiled lane as its tests load it (tests/router/test_fast_lane.py,
test_lane_plan.py): ``None`` where it is not built, so those tests skip, except under
``make test`` (``PDSERVE_REQUIRE_LANE=1`` where cargo is), where a lane not built or built
from an older tree fails collection instead."""

from __future__ import annotations

import os
from typing import Any

import pytest

from pdserve.env import REQUIRE_LANE
from pdserve.router import fast_lane

lane_mod: Any = fast_lane.load()
if lane_mod is None and os.environ.get(REQUIRE_LANE):
    raise RuntimeError(f"{REQUIRE_LANE} is set but the compiled lane is not built or out of date")
needs_lane = pytest.mark.skipif(lane_mod is None, reason="the compiled lane is not built")
