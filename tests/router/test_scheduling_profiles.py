"""Filters, scorers and pickers are registry entries composed per pool profile from the
configuration (router/scheduling/registry.py, profile.py): names checked, order kept,
``none`` honoured, unknown names refused by name (table-driven, no server)."""

from __future__ import annotations

import argparse
import random

import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.main import add_arguments, build_config
from pdserve.router.scheduling import registry
from pdserve.router.scheduling.filters import fits_kv, knows_lora
from pdserve.router.scheduling.route_request import RouteRequest
from pdserve.router.scheduling.snapshot import WorkerStats, WorkerView

pytestmark = pytest.mark.unit


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--model", "/m", *argv])


def _decode(name: str, free: int) -> WorkerView:
    stats = WorkerStats(worker_id=name, kv_blocks_free=free, kv_blocks_total=100)
    return WorkerView(f"http://{name}", "decode", True, stats)


def test_the_default_profiles_name_the_built_in_filters_in_order() -> None:
    cfg = RouterConfig(model_dir="/m")
    assert cfg.prefill_profile.filters == (knows_lora,)
    assert cfg.decode_profile.filters == (knows_lora, fits_kv)
    assert cfg.decode_profile.picker is registry.PICKERS["max-score"]


@pytest.mark.parametrize(
    ("argv", "prefill", "decode"),
    [
        (("--decode-filter", "none"), (knows_lora,), ()),
        (
            ("--prefill-filter", "fits-kv", "--prefill-filter", "knows-lora"),
            (fits_kv, knows_lora),
            (knows_lora, fits_kv),
        ),
        (("--decode-filter", "fits-kv"), (knows_lora,), (fits_kv,)),
    ],
)
def test_filters_come_from_the_flags(argv: tuple[str, ...], prefill: tuple, decode: tuple) -> None:
    cfg = build_config(_parse(*argv))
    assert (cfg.prefill_profile.filters, cfg.decode_profile.filters) == (prefill, decode)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "decode_filters",
            ("fits-kv", "typo"),
            r"unknown filter 'typo'; valid: \['fits-kv', 'knows-lora'\]",
        ),
        ("picker", "best", r"unknown picker 'best'; valid: \['max-score', 'round-robin'\]"),
        ("decode_scorer_weights", (("nope", 1.0),), r"unknown scorer 'nope'"),
    ],
)
def test_an_unknown_plugin_is_refused_by_name(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(model_dir="/m", **{field: value})  # type: ignore[arg-type]


def test_round_robin_rotates_the_workers_a_filter_keeps_first() -> None:
    """The round-robin picker honours the profile's filters: a worker without room for the
    prompt comes after those with room, whatever the rotation."""
    cfg = RouterConfig(model_dir="/m", picker="round-robin")
    workers = [_decode("a", 100), _decode("b", 1), _decode("c", 100)]
    req = RouteRequest(640)  # 40 blocks: b has no room
    orders = [
        [w.worker_id for w in cfg.decode_profile.order(workers, req, random.Random(0), n)]
        for n in range(3)
    ]
    assert orders == [["a", "c", "b"], ["c", "a", "b"], ["a", "c", "b"]]
    cfg = RouterConfig(model_dir="/m", picker="round-robin", decode_filters=())
    order = cfg.decode_profile.order(workers, req, random.Random(0), 1)
    assert [w.worker_id for w in order] == ["b", "c", "a"]
