"""Status computation from Deployments (pure): conditions, summaries, Degraded ownership."""

from __future__ import annotations

from typing import Any

from k8s_helpers import minimal_llmservice

from pdserve.operator.spec_parse import parse_llmservice
from pdserve.operator.status import REASON_INVALID_SPEC, condition, observed_status

SPEC = parse_llmservice(minimal_llmservice())


def dep(
    replicas: int,
    ready: int,
    conditions: list[dict[str, Any]] | None = None,
    updated: int | None = None,
    total: int | None = None,
) -> dict[str, Any]:
    status = {
        "updatedReplicas": replicas if updated is None else updated,
        "readyReplicas": ready,
        "replicas": replicas if total is None else total,
        "conditions": conditions or [],
    }
    return {"spec": {"replicas": replicas}, "status": status}


def conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_ready_when_all_pools_ready() -> None:
    s = observed_status(
        SPEC, 1, {"router": dep(1, 1), "prefill": dep(2, 2), "decode": dep(1, 1)}, []
    )
    assert conds(s)["Ready"] == ("True", "Serving")
    assert conds(s)["Progressing"] == ("False", "Stable")
    assert conds(s)["Degraded"] == ("False", "AsExpected")
    assert s["prefill"]["summary"] == "2/2" and s["decode"]["summary"] == "1/1"


def test_ready_means_serving_not_all_replicas() -> None:
    """A scale-up (1 of 2 ready) or a surge rollout keeps Ready and sets Progressing."""
    scaling = {"router": dep(1, 1), "prefill": dep(2, 1), "decode": dep(1, 1)}
    s = observed_status(SPEC, 1, scaling, [])
    assert conds(s)["Ready"] == ("True", "Serving")
    progressing = next(c for c in s["conditions"] if c["type"] == "Progressing")
    assert progressing["status"] == "True" and "prefill 1/2" in progressing["message"]
    rolling = {"router": dep(1, 1), "prefill": dep(1, 1), "decode": dep(1, 1, updated=1, total=2)}
    assert conds(observed_status(SPEC, 1, rolling, [])) == {
        "Ready": ("True", "Serving"),
        "Progressing": ("True", "RollingOut"),
        "Degraded": ("False", "AsExpected"),
    }


def test_colocated_prefill_at_zero_still_serves() -> None:
    deps = {"router": dep(1, 1), "prefill": dep(0, 0), "decode": dep(2, 2)}
    assert conds(observed_status(SPEC, 1, deps, []))["Ready"] == ("True", "Serving")
    deps["decode"] = dep(2, 0)
    assert conds(observed_status(SPEC, 1, deps, []))["Ready"] == ("False", "NotServing")


def test_not_ready_names_the_pool() -> None:
    s = observed_status(SPEC, 1, {"router": dep(1, 1), "prefill": dep(2, 1), "decode": None}, [])
    assert conds(s)["Ready"] == ("False", "ChildrenMissing")
    s = observed_status(
        SPEC, 1, {"router": dep(1, 1), "prefill": dep(2, 1), "decode": dep(1, 0)}, []
    )
    ready = next(c for c in s["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "NotServing" and ready["message"] == "no ready replica in: decode"
    assert conds(s)["Progressing"] == ("True", "RollingOut")


def test_deployment_failure_is_degraded_but_invalid_spec_wins() -> None:
    stuck = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}]
    deps = {"router": dep(1, 1), "prefill": dep(1, 0, stuck), "decode": dep(1, 1)}
    s = observed_status(SPEC, 2, deps, [])
    degraded = next(c for c in s["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "DeploymentFailed"
    assert "Deployment demo-prefill: ProgressDeadlineExceeded" in degraded["message"]
    invalid = condition("Degraded", True, REASON_INVALID_SPEC, "spec.x: bad", 2)
    s = observed_status(SPEC, 2, deps, [invalid])
    assert conds(s)["Degraded"] == ("True", REASON_INVALID_SPEC)  # the timer does not clear it


def test_transition_time_kept_while_status_unchanged() -> None:
    deps = {"router": dep(1, 1), "prefill": dep(1, 1), "decode": dep(1, 1)}
    first = observed_status(SPEC, 1, deps, [])
    old = [{**c, "lastTransitionTime": "2020-01-01T00:00:00Z"} for c in first["conditions"]]
    again = observed_status(SPEC, 1, deps, old)
    assert all(c["lastTransitionTime"] == "2020-01-01T00:00:00Z" for c in again["conditions"])
