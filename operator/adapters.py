"""``spec.adapters``: LoRA adapters that every worker and the router serve (issue 27).

Each adapter is a PEFT directory on a PVC or in an OCI image (a Kubernetes image volume),
mounted read-only at ``/adapters/<name>`` in every worker and router pod and passed as
``--lora <name>=/adapters/<name>``: the workers load it, the router hashes its files (the
adapter's hash seeds the prefix cache's block hashes on both sides). One volume per PVC or
image, however many adapters it holds; each adapter is a ``subPath`` mount of it.

    spec.adapters:
    - name: sql
      source: {pvc: {claimName: adapters, path: sql-v3}}
    - name: chat
      source: {image: {reference: registry.example/adapters/chat:v1, path: chat}}
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pdserve.operator.spec import AdapterSpec, LLMServiceSpec, SpecError

ADAPTER_MOUNT = "/adapters"
MAX_ADAPTERS = 64
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# A path segment of the pod (no slash, not . or ..) and a model name clients can type.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# Relative, no empty, "." or ".." segment: a subPath never leaves its volume.
_PATH = re.compile(r"^([A-Za-z0-9_][A-Za-z0-9._-]*)(/[A-Za-z0-9_][A-Za-z0-9._-]*)*$")


def parse_adapters(data: Any, served_name: str) -> tuple[AdapterSpec, ...]:
    """``spec.adapters`` (a list, or None) → AdapterSpecs; SpecError naming the field."""
    if data is None:
        return ()
    if not isinstance(data, list):
        raise SpecError("spec.adapters", "must be a list")
    if len(data) > MAX_ADAPTERS:
        raise SpecError("spec.adapters", f"at most {MAX_ADAPTERS} adapters")
    out: list[AdapterSpec] = []
    for i, item in enumerate(data):
        a = _parse_one(item, f"spec.adapters[{i}]")
        if a.name == served_name:
            raise SpecError(f"spec.adapters[{i}].name", f"{a.name!r} is the base model's name")
        if any(b.name == a.name for b in out):
            raise SpecError(f"spec.adapters[{i}].name", f"{a.name!r} is given twice")
        out.append(a)
    return tuple(out)


def _parse_one(item: Any, path: str) -> AdapterSpec:
    if not isinstance(item, Mapping):
        raise SpecError(path, "must be an object")
    name = item.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise SpecError(
            f"{path}.name",
            f"must be 1-63 characters of A-Z a-z 0-9 . _ -, a letter or digit first, got {name!r}",
        )
    source = item.get("source")
    kinds = [k for k in ("pvc", "image") if isinstance(source, Mapping) and k in source]
    if not isinstance(source, Mapping) or len(kinds) != 1 or len(source) != 1:
        raise SpecError(f"{path}.source", "set exactly one of pvc, image")
    kind = kinds[0]
    src, where = source[kind], f"{path}.source.{kind}"
    if not isinstance(src, Mapping):
        raise SpecError(where, "must be an object")
    sub = src.get("path", "")
    if not isinstance(sub, str) or (sub and not _PATH.match(sub)):
        raise SpecError(
            f"{where}.path",
            f"must be a relative path inside the volume (no '..', no leading '/'), got {sub!r}",
        )
    key = "claimName" if kind == "pvc" else "reference"
    value = src.get(key)
    if not isinstance(value, str) or not value:
        raise SpecError(f"{where}.{key}", "is required")
    if kind == "pvc":
        return AdapterSpec(name, kind, claim_name=value, path=sub)
    policy = src.get("pullPolicy", "IfNotPresent")
    if policy not in PULL_POLICIES:
        raise SpecError(f"{where}.pullPolicy", f"must be one of {list(PULL_POLICIES)}")
    return AdapterSpec(name, kind, reference=value, path=sub, pull_policy=policy)


def _volume_names(spec: LLMServiceSpec) -> dict[tuple[str, ...], str]:
    """One volume per PVC and per (image, pull policy), named in order of appearance."""
    names: dict[tuple[str, ...], str] = {}
    for a in spec.adapters:
        key = _key(a)
        if key not in names:
            names[key] = f"adapters-{len(names)}"
    return names


def _key(a: AdapterSpec) -> tuple[str, ...]:
    return ("pvc", a.claim_name) if a.kind == "pvc" else ("image", a.reference, a.pull_policy)


def adapter_volumes(spec: LLMServiceSpec) -> list[dict[str, Any]]:
    out = []
    for key, name in _volume_names(spec).items():
        if key[0] == "pvc":
            out.append(
                {"name": name, "persistentVolumeClaim": {"claimName": key[1], "readOnly": True}}
            )
        else:  # image volumes are read-only by construction
            out.append({"name": name, "image": {"reference": key[1], "pullPolicy": key[2]}})
    return out


def adapter_mounts(spec: LLMServiceSpec) -> list[dict[str, Any]]:
    names = _volume_names(spec)
    out = []
    for a in spec.adapters:
        mount: dict[str, Any] = {
            "name": names[_key(a)],
            "mountPath": adapter_dir(a),
            "readOnly": True,
        }
        if a.path:
            mount["subPath"] = a.path
        out.append(mount)
    return out


def adapter_dir(a: AdapterSpec) -> str:
    return f"{ADAPTER_MOUNT}/{a.name}"


def lora_args(spec: LLMServiceSpec) -> list[str]:
    """``--lora name=/adapters/name`` for every adapter: the same on workers and router."""
    return [arg for a in spec.adapters for arg in ("--lora", f"{a.name}={adapter_dir(a)}")]
