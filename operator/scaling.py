"""The autoscaler's one write path: set pool replicas and record the decision.

The planner (``pdserve.planner``) decides; a kopf timer (added with the
planner) calls ``scale_pools`` with its decision. Reconciliation keeps these
replica counts while ``spec.autoscaling.enabled`` is true and they lie within
``[minReplicas, maxReplicas]`` (see ``reconcile.keep_autoscaled_replicas``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.operator import naming as n
from pdserve.operator import status as st
from pdserve.operator.kube import KubeClient
from pdserve.operator.spec_parse import parse_llmservice


class ScalingRefused(Exception):
    """The LLMService does not allow autoscaling (disabled, gone, or invalid)."""


@dataclass(frozen=True)
class ScaleResult:
    prefill: int  # replicas after clamping to the pool bounds
    decode: int
    changed: tuple[str, ...]  # Deployments whose replica count was set (their /scale)


async def scale_pools(
    client: KubeClient, namespace: str, name: str, prefill: int, decode: int, reason: str
) -> ScaleResult:
    """Clamp to each pool's bounds, scale only the Deployments whose count differs (through
    their ``/scale`` subresource, as an HPA does: the RBAC verb is ``deployments/scale``), and
    write ``status.autoscaling.lastDecision`` {time, prefillReplicas, decodeReplicas, reason}."""
    obj = await client.get(n.API_VERSION, n.KIND, namespace, name)
    if obj is None:
        raise ScalingRefused(f"LLMService {namespace}/{name} not found")
    svc = parse_llmservice(obj, namespace)
    if not svc.autoscaling.enabled:
        raise ScalingRefused(f"LLMService {namespace}/{name}: spec.autoscaling.enabled is false")
    wanted = {"prefill": svc.prefill.clamp(prefill), "decode": svc.decode.clamp(decode)}
    changed = []
    for role, replicas in wanted.items():
        dep_name = n.deployment_name(name, role)
        live = await client.get("apps/v1", "Deployment", namespace, dep_name)
        if live is None:
            raise ScalingRefused(f"Deployment {namespace}/{dep_name} does not exist yet")
        if live.get("spec", {}).get("replicas") != replicas:
            await client.scale("apps/v1", "Deployment", namespace, dep_name, replicas)
            changed.append(f"Deployment/{dep_name}")
    decision = st.autoscaling_decision(wanted["prefill"], wanted["decode"], reason)
    await client.patch(
        n.API_VERSION, n.KIND, namespace, name, {"status": {"autoscaling": decision}}, status=True
    )
    return ScaleResult(wanted["prefill"], wanted["decode"], tuple(changed))
