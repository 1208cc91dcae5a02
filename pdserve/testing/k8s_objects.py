"""Sample Kubernetes objects for the k8s tests and the benches (an LLMService, the pod
policy the tests' operators run under)."""

from __future__ import annotations

from typing import Any

from pdserve.operator.pod_policy import PodPolicy

NS = "default"

# The operator allows minimal_llmservice's hostPath weights only under a directory the
# cluster admin names (--allow-model-host-path): the tests' operators are that admin.
TEST_POD_POLICY = PodPolicy(model_host_paths=("/data/models",))


def minimal_llmservice(name: str = "demo", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": {"source": {"hostPath": {"path": "/data/models/tiny"}}}}
    body.update(spec)
    return {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "namespace": NS},
        "spec": body,
    }
