"""The LLMService's router fields render as the router's current flags: ``routing`` is
``--picker``, ``prefixWeight`` / ``loadWeight`` are ``--scorer NAME=W`` over the defaults
(the router has no ``--routing`` nor ``--*-weight`` any more: docs/cli.md)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from k8s_helpers import minimal_llmservice

from pdserve.operator.render import render
from pdserve.router.main import add_arguments, build_config


def _router_config(**router: Any) -> Any:
    obj = minimal_llmservice(router=router)
    (dep,) = [
        m
        for m in render(obj)
        if m["kind"] == "Deployment" and m["metadata"]["name"] == "demo-router"
    ]
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--routing" not in cmd and not any(a.endswith("-weight") for a in cmd)
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(cmd[2:])
    args.model = "/m"  # the pod's path; build_config resolves it
    return build_config(args)


@pytest.mark.parametrize(
    ("routing", "picker"), [("prefix", "max-score"), ("round-robin", "round-robin")]
)
def test_routing_is_the_picker(routing: str, picker: str) -> None:
    assert _router_config(routing=routing).picker == picker


def test_weights_are_scorers_over_the_defaults() -> None:
    weights = {(s.name, s.weight) for s in _router_config().prefill_scorers}
    assert ("prefix-match", 2.0) in weights and ("cache-balance", 0.5) in weights
    weights = {
        (s.name, s.weight) for s in _router_config(prefixWeight=0.5, loadWeight=1.5).prefill_scorers
    }
    assert {("prefix-match", 0.5), ("queued-tokens", 1.5), ("running", 1.5)} <= weights
    assert {("cache-balance", 0.5), ("lora-affinity", 1.0)} <= weights  # the rest: defaults
