"""Field checks the CRD makes on the API server, repeated for ``pdserve render``.

A spec the CRD admits must be one the cluster accepts: quantities that parse,
tolerations and affinity terms with known operators. The CRD refuses these on
admission; ``pdserve render`` never meets the API server, so it refuses them here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pdserve.operator.spec import SpecError

# Kubernetes' resource.Quantity grammar (the pattern controller-gen writes into CRDs).
QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_TOLERATION_OPS = ("Exists", "Equal")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_NODE_OPS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
_LABEL_OPS = ("In", "NotIn", "Exists", "DoesNotExist")


def check_quantity(path: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SpecError(path, f"must be a quantity like 500m or 16Gi, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise SpecError(path, f"must be >= 0, got {value}")
        return
    if not QUANTITY.match(value):
        raise SpecError(path, f"must be a quantity like 500m or 16Gi, got {value!r}")


def check_resources(path: str, resources: Mapping[str, Any]) -> None:
    for section in ("requests", "limits"):
        values = resources.get(section) or {}
        if not isinstance(values, Mapping):
            raise SpecError(f"{path}.{section}", "must be an object")
        for key, value in values.items():
            check_quantity(f"{path}.{section}.{key}", value)


def _enum(path: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value is not None and value not in allowed:
        raise SpecError(path, f"must be one of {list(allowed)}, got {value!r}")


def check_tolerations(path: str, items: tuple[Mapping[str, Any], ...]) -> None:
    for i, t in enumerate(items):
        _enum(f"{path}[{i}].operator", t.get("operator"), _TOLERATION_OPS)
        _enum(f"{path}[{i}].effect", t.get("effect"), _EFFECTS)


def _expressions(path: str, term: Any, ops: tuple[str, ...], keys: tuple[str, ...]) -> None:
    if not isinstance(term, Mapping):
        return
    for key in keys:
        for j, expr in enumerate(term.get(key) or []):
            _enum(f"{path}.{key}[{j}].operator", (expr or {}).get("operator"), ops)


def check_affinity(path: str, affinity: Mapping[str, Any]) -> None:
    node = affinity.get("nodeAffinity") or {}
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    for i, term in enumerate(required.get("nodeSelectorTerms") or []):
        p = f"{path}.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        _expressions(
            f"{p}.nodeSelectorTerms[{i}]", term, _NODE_OPS, ("matchExpressions", "matchFields")
        )
    for i, pref in enumerate(node.get("preferredDuringSchedulingIgnoredDuringExecution") or []):
        p = f"{path}.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[{i}]"
        _expressions(
            f"{p}.preference",
            (pref or {}).get("preference"),
            _NODE_OPS,
            ("matchExpressions", "matchFields"),
        )
    for kind in ("podAffinity", "podAntiAffinity"):
        pod = affinity.get(kind) or {}
        terms = list(pod.get("requiredDuringSchedulingIgnoredDuringExecution") or [])
        weighted = pod.get("preferredDuringSchedulingIgnoredDuringExecution") or []
        terms += [(w or {}).get("podAffinityTerm") or {} for w in weighted]
        for i, term in enumerate(terms):
            if not (term or {}).get("topologyKey"):
                raise SpecError(f"{path}.{kind}[{i}].topologyKey", "is required")
            _expressions(
                f"{path}.{kind}[{i}].labelSelector",
                term.get("labelSelector"),
                _LABEL_OPS,
                ("matchExpressions",),
            )
