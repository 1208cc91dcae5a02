"""The pod-template escape hatch: ``spec.<pool|router>.podTemplate`` merged over the rendered pod.

For what the spec has no field for (runtimeClassName, priorityClassName, topology spread,
Multus annotations for RoCE / SR-IOV, extra volumes, env, sidecars), as KServe's
``template`` and Dynamo's ``extraPodSpec`` allow. Merge rules, like a strategic merge:
objects merge key by key; lists of named objects (containers, volumes, env, volumeMounts,
ports, initContainers) merge item by item on ``name`` (new names are appended); any other
value replaces the rendered one. The selector labels cannot be overridden: the
Deployment, the Services and the router's discovery select pods by them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from pdserve.operator import naming as n
from pdserve.operator.spec import SpecError

PROTECTED_LABELS = (n.LABEL_SERVICE, n.LABEL_ROLE)


def _named(items: Any) -> bool:
    return isinstance(items, list) and all(isinstance(i, Mapping) and "name" in i for i in items)


def merge(base: Any, override: Any) -> Any:
    """``override`` merged over ``base`` (both left untouched)."""
    if isinstance(base, Mapping) and isinstance(override, Mapping):
        out = dict(copy.deepcopy(base))
        for key, value in override.items():
            out[key] = merge(base.get(key), value) if key in base else copy.deepcopy(value)
        return out
    if _named(base) and _named(override):
        out_list = [copy.deepcopy(i) for i in base]
        index = {item["name"]: i for i, item in enumerate(out_list)}
        for item in override:
            if item["name"] in index:
                out_list[index[item["name"]]] = merge(out_list[index[item["name"]]], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(override)


def check(path: str, template: Mapping[str, Any]) -> None:
    """Refuse a podTemplate that would break the pod contract (names the field)."""
    unknown = sorted(set(template) - {"metadata", "spec"})
    if unknown:
        raise SpecError(f"{path}.{unknown[0]}", "podTemplate takes only metadata and spec")
    labels = (template.get("metadata") or {}).get("labels") or {}
    for key in PROTECTED_LABELS:
        if key in labels:
            raise SpecError(f"{path}.metadata.labels.{key}", "is set by the operator")


def apply(pod_template: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """The rendered ``spec.template`` of a Deployment with ``override`` merged over it."""
    if not override:
        return pod_template
    return dict(merge(pod_template, override))
