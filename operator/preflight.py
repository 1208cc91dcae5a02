"""Checks a schema-valid spec must pass before any child is created or changed.

Each problem names the field, e.g. ``spec.model.source.pvc.claimName:
PersistentVolumeClaim "weights" not found in namespace "ml"``. A missing object may appear later
(``retryable``); a spec that fights the operator can only be fixed by editing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.operator.kube import KubeClient
from pdserve.operator.spec import LLMServiceSpec

# Flags the operator sets itself; passing them again in extraArgs would break the pod contract.
MANAGED_FLAGS = (
    "--model",
    "--host",
    "--port",
    "--side-channel-port",
    "--kv-events-port",
    "--worker-id",
    "--kv-transport",
    "--discovery",
    "--service",
    "--namespace",
    "--api-key",
    "--api-key-file",
    "--served-model-name",
    "--admin-port",
)


@dataclass(frozen=True)
class Problem:
    field: str
    message: str
    retryable: bool  # True: a referenced object is missing and may still be created

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def check_extra_args(spec: LLMServiceSpec) -> list[Problem]:
    problems = []
    sections = {"prefill": spec.prefill.extra_args, "decode": spec.decode.extra_args}
    sections["router"] = spec.router.extra_args
    for section, args in sections.items():
        for i, arg in enumerate(args):
            flag = arg.split("=", 1)[0]
            if flag in MANAGED_FLAGS:
                msg = f"{flag} is set by the operator; remove it (use the spec field instead)"
                problems.append(Problem(f"spec.{section}.extraArgs[{i}]", msg, retryable=False))
    return problems


async def check_references(client: KubeClient, spec: LLMServiceSpec) -> list[Problem]:
    ns = spec.namespace
    problems: list[Problem] = []
    # Secrets it names (apiKeySecret, tokenSecret, ...) are not looked at: the operator
    # reads no Secret (issue 44 item 12). A missing one stops the pods that mount it,
    # with the kubelet's Event naming it (CreateContainerConfigError / FailedMount).
    src = spec.model.source
    cache = src.cache_claim if src.kind == "huggingFace" else ""
    if cache and await client.get("v1", "PersistentVolumeClaim", ns, cache) is None:
        msg = f'PersistentVolumeClaim "{cache}" not found in namespace "{ns}"'
        problems.append(Problem("spec.model.source.huggingFace.cache.claimName", msg, True))
    if (
        src.kind == "pvc"
        and await client.get("v1", "PersistentVolumeClaim", ns, src.claim_name) is None
    ):
        msg = f'PersistentVolumeClaim "{src.claim_name}" not found in namespace "{ns}"'
        problems.append(Problem("spec.model.source.pvc.claimName", msg, retryable=True))
    return problems


async def preflight(client: KubeClient, spec: LLMServiceSpec) -> list[Problem]:
    return check_extra_args(spec) + await check_references(client, spec)
