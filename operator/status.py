"""Status of an LLMService: conditions, per-pool replicas, endpoint, autoscaling decision.

Handlers own ``Degraded`` (the spec could not be applied); the status timer
owns ``Ready``/``Progressing`` and the replica counts, from the Deployments.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.operator import naming as n
from pdserve.operator.spec import LLMServiceSpec

REASON_INVALID_SPEC = "InvalidSpec"  # set by handlers; only a spec change or fix clears it
REASON_FOREIGN_CHILD = "ForeignChild"  # a child's name is held by an object we do not own
REASON_CHILD_REJECTED = "ChildRejected"  # the API server refused a child (422)
# Degraded reasons the change handlers own: the status sync never clears them.
HANDLER_REASONS = (REASON_INVALID_SPEC, REASON_FOREIGN_CHILD, REASON_CHILD_REJECTED)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(
    type_: str, ok: bool, reason: str, message: str, generation: int | None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "lastTransitionTime": now(),
    }
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def merge_conditions(
    old: list[Mapping[str, Any]], new: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Replace conditions by type; keep lastTransitionTime when the status did not flip."""
    by_type = {c["type"]: dict(c) for c in old}
    for c in new:
        prev = by_type.get(c["type"])
        if prev is not None and prev.get("status") == c["status"]:
            c = {**c, "lastTransitionTime": prev.get("lastTransitionTime", c["lastTransitionTime"])}
        by_type[c["type"]] = c
    return [by_type[t] for t in ("Ready", "Progressing", "Degraded") if t in by_type]


@dataclass(frozen=True)
class PoolState:
    desired: int
    replicas: int  # updated to the current template
    ready: int
    total: int = 0  # all pods, old and new (above desired while a rollout surges)
    failed_reason: str = ""  # e.g. ProgressDeadlineExceeded

    @property
    def is_serving(self) -> bool:
        return self.ready >= 1

    @property
    def is_settled(self) -> bool:
        return self.ready >= self.desired and self.replicas == self.desired >= self.total

    def as_status(self) -> dict[str, Any]:
        return {
            "desiredReplicas": self.desired,
            "replicas": self.replicas,
            "readyReplicas": self.ready,
            "summary": f"{self.ready}/{self.desired}",
        }


def pool_state(deployment: Mapping[str, Any] | None) -> PoolState | None:
    if deployment is None:
        return None
    st = deployment.get("status") or {}
    failed = ""
    for c in st.get("conditions") or []:
        if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded":
            failed = "ProgressDeadlineExceeded"
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
            failed = c.get("reason") or "ReplicaFailure"
    return PoolState(
        desired=int(deployment.get("spec", {}).get("replicas", 1)),
        replicas=int(st.get("updatedReplicas") or 0),
        ready=int(st.get("readyReplicas") or 0),
        total=int(st.get("replicas") or 0),
        failed_reason=failed,
    )


def _ready_conditions(
    states: Mapping[str, PoolState | None], gen: int | None
) -> list[dict[str, Any]]:
    """Ready = the service answers: the router and at least one replica of each pool serve.

    A scale-up or a rolling update leaves Ready alone (it only sets Progressing): a
    client that waits for Ready must not see it flip while capacity is being added.
    """
    missing = [role for role, s in states.items() if s is None]
    # A prefill pool scaled to 0 (the planner colocates: decode workers prefill locally)
    # does not stop the service from serving.
    idle = [
        role
        for role, s in states.items()
        if s and not s.is_serving and not (role == "prefill" and s.desired == 0)
    ]
    moving = [
        f"{role} {s.ready}/{s.desired}" for role, s in states.items() if s and not s.is_settled
    ]
    if missing:
        msg = f"Deployments not created: {', '.join(missing)}"
        ready = condition("Ready", False, "ChildrenMissing", msg, gen)
    elif idle:
        msg = f"no ready replica in: {', '.join(idle)}"
        ready = condition("Ready", False, "NotServing", msg, gen)
    else:
        msg = "the router and every pool have a ready replica"
        ready = condition("Ready", True, "Serving", msg, gen)
    busy = bool(missing or moving)
    why = f"rolling out or scaling: {', '.join(moving)}" if moving else ""
    progressing = condition("Progressing", busy, "RollingOut" if busy else "Stable", why, gen)
    return [ready, progressing]


def _degraded_condition(
    name: str, states: Mapping[str, PoolState | None], gen: int | None
) -> dict[str, Any]:
    failed = {role: s.failed_reason for role, s in states.items() if s and s.failed_reason}
    msg = "; ".join(f"Deployment {n.deployment_name(name, r)}: {why}" for r, why in failed.items())
    return condition(
        "Degraded", bool(failed), "DeploymentFailed" if failed else "AsExpected", msg, gen
    )


def observed_status(
    spec: LLMServiceSpec,
    generation: int | None,
    deployments: Mapping[str, Mapping[str, Any] | None],
    old_conditions: list[Mapping[str, Any]],
) -> dict[str, Any]:
    """The status patch computed from the live Deployments (role -> object or None)."""
    states = {role: pool_state(deployments.get(role)) for role in n.ROLES}
    conds = _ready_conditions(states, generation)
    degraded_by_spec = any(
        c.get("type") == "Degraded"
        and c.get("reason") in HANDLER_REASONS
        and c.get("status") == "True"
        for c in old_conditions
    )
    if not degraded_by_spec:  # the handlers own an InvalidSpec Degraded; only a good spec clears it
        conds.append(_degraded_condition(spec.name, states, generation))
    ing = spec.router.ingress
    host, tls = (ing.host, bool(ing.tls_secret_name)) if ing else ("", False)
    out: dict[str, Any] = {
        "conditions": merge_conditions(list(old_conditions), conds),
        "endpoint": n.endpoint_url(spec.name, spec.namespace, host, tls),
    }
    out.update({role: s.as_status() for role, s in states.items() if s is not None})
    return out


def autoscaling_decision(prefill: int, decode: int, reason: str) -> dict[str, Any]:
    """The ``status.autoscaling.lastDecision`` record the autoscaler writes with each scaling."""
    return {
        "lastDecision": {
            "time": now(),
            "prefillReplicas": prefill,
            "decodeReplicas": decode,
            "reason": reason,
        }
    }
