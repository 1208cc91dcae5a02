"""The core zygote's imports (worker/core/zygote.py ``preload``): run with the collector
off, their objects frozen for the forks, and the collector on again whatever happened
(a zygote left without it would leave every core it forks without it)."""

from __future__ import annotations

import gc

import pytest

from pdserve.worker.core.zygote import preload

pytestmark = pytest.mark.unit


def test_preload_freezes_its_imports_and_leaves_the_collector_on() -> None:
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with pytest.raises(ModuleNotFoundError):
            preload(("json", "pdserve_no_such_module"))
        assert gc.isenabled()
        assert gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()  # this test process is no zygote
