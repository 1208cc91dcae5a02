"""Apply rendered children idempotently: create what is missing, patch what drifted.

A child is patched only when a field the operator renders differs in the live
object (a manual edit, or a spec change) or when a field it rendered last time
is gone from the rendering (the ``pdserve.io/last-applied`` annotation says
which: that field is removed with a JSON merge patch ``null``). Fields the API
server or other controllers add are left alone. The one exception to "the spec
wins" is the replica count of a worker pool while autoscaling is enabled.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.operator import naming as n
from pdserve.operator.kube import KubeClient, KubeError
from pdserve.operator.spec import LLMServiceSpec


@dataclass(frozen=True)
class ApplyResult:
    created: tuple[str, ...]
    patched: tuple[str, ...]
    unchanged: tuple[str, ...]
    pruned: tuple[str, ...] = ()


def key_of(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _quantity_equal(a: Any, b: Any) -> bool:
    from kubernetes.utils import parse_quantity  # the API server canonicalises quantities

    try:
        return bool(parse_quantity(a) == parse_quantity(b))
    except (ValueError, TypeError):
        return False


def contains(live: Any, desired: Any) -> bool:
    """True if every field of ``desired`` is present in ``live`` with the same value."""
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return False
        return all(k in live and contains(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return False
        return all(contains(lv, dv) for lv, dv in zip(live, desired, strict=True))
    if live == desired:
        return True
    if isinstance(desired, (str, int)) and isinstance(live, (str, int)):
        return _quantity_equal(live, desired)
    return False


def removals(previous: Any, desired: Any) -> Any:
    """A merge patch that nulls the dict keys in ``previous`` that ``desired`` dropped."""
    if not isinstance(previous, Mapping) or not isinstance(desired, Mapping):
        return None
    out: dict[str, Any] = {}
    for k, v in previous.items():
        if k not in desired:
            out[k] = None
        else:
            sub = removals(v, desired[k])
            if sub:
                out[k] = sub
    return out


def _merge(base: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    for k, v in patch.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v
    return base


def last_applied(live: Mapping[str, Any]) -> dict[str, Any]:
    raw = live.get("metadata", {}).get("annotations", {}).get(n.ANNOTATION_LAST_APPLIED)
    try:
        return dict(json.loads(raw)) if raw else {}
    except ValueError:
        return {}


def _fingerprint(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What we remember about a rendered child: everything but the replica count."""
    out = copy.deepcopy(dict(obj))
    out.get("spec", {}).pop("replicas", None)
    out.get("metadata", {}).get("annotations", {}).pop(n.ANNOTATION_LAST_APPLIED, None)
    return out


def with_last_applied(desired: Mapping[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(dict(desired))
    fingerprint = json.dumps(_fingerprint(desired), sort_keys=True, separators=(",", ":"))
    obj["metadata"].setdefault("annotations", {})[n.ANNOTATION_LAST_APPLIED] = fingerprint
    return obj


def plan_patch(live: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that brings ``live`` to ``desired``, or None if nothing to do."""
    previous = last_applied(live)
    gone = removals(previous, _fingerprint(desired)) or {}
    if contains(live, desired) and not gone and previous == _fingerprint(desired):
        return None
    patch = with_last_applied(desired)
    return _merge(patch, gone) if gone else patch


def keep_autoscaled_replicas(
    spec: LLMServiceSpec, desired: dict[str, Any], live: Mapping[str, Any] | None
) -> dict[str, Any]:
    """While autoscaling is on, a pool keeps the autoscaler's replica count (clamped to bounds).

    A count within bounds is left out of the desired object, so a drift repair never writes
    back the count it read: a scale (by the autoscaler or a person) that lands between our
    read and our patch would otherwise be lost.
    """
    if desired["kind"] != "Deployment":
        return desired
    role = desired["metadata"]["labels"].get(n.LABEL_ROLE)
    pool = {"prefill": spec.prefill, "decode": spec.decode}.get(role or "")
    if pool is None or not (spec.autoscaling.enabled or pool.external_scaling):
        return desired
    current = (live or {}).get("spec", {}).get("replicas")
    out = copy.deepcopy(desired)
    if isinstance(current, int) and pool.clamp(current) == current:
        out["spec"].pop("replicas", None)
        return out
    out["spec"]["replicas"] = pool.clamp(current) if isinstance(current, int) else pool.replicas
    return out


class ForeignChild(Exception):
    """A child's name is taken by an object this LLMService does not control."""

    def __init__(self, key: str, live: Mapping[str, Any]) -> None:
        owners = [
            f"{o.get('kind')}/{o.get('name')}"
            for o in live.get("metadata", {}).get("ownerReferences") or []
        ]
        by = f"owned by {', '.join(owners)}" if owners else "not owned by any LLMService"
        super().__init__(f"{key} already exists and is {by}; delete or rename it")
        self.key = key


class ChildRejected(Exception):
    """The API server refused a rendered child (HTTP 422): only a spec edit can fix it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key} refused by the API server: {message}")
        self.key = key


Lookup = Callable[[Mapping[str, Any]], Awaitable[Mapping[str, Any] | None]]


def controlled_by(live: Mapping[str, Any], owner_uid: str) -> bool:
    refs = live.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == owner_uid and r.get("controller") for r in refs)


async def _get(client: KubeClient, child: Mapping[str, Any]) -> dict[str, Any] | None:
    meta = child["metadata"]
    return await client.get(child["apiVersion"], child["kind"], meta["namespace"], meta["name"])


async def _write(
    client: KubeClient,
    child: Mapping[str, Any],
    live: Mapping[str, Any] | None,
    patch: dict[str, Any] | None,
) -> None:
    meta = child["metadata"]
    try:
        if live is None:
            await client.create(patch or {})
        elif patch is not None:
            await client.patch(
                child["apiVersion"], child["kind"], meta["namespace"], meta["name"], patch
            )
    except KubeError as e:
        if e.status == 422:
            raise ChildRejected(key_of(child), e.server_message) from e
        raise


async def apply_children(
    client: KubeClient,
    spec: LLMServiceSpec,
    children: list[dict[str, Any]],
    lookup: Lookup | None = None,
) -> ApplyResult:
    """Create or patch each child in order; children must already carry owner references.

    ``lookup`` gives the live object (the watch cache); by default it is a GET. A create
    that finds the name taken (409: the cache lagged) reads the object and patches it.
    Raises ``ForeignChild`` for a name held by an object we do not control (never taken
    over, as controller-runtime does) and ``ChildRejected`` for a 422.
    """
    created: list[str] = []
    patched: list[str] = []
    unchanged: list[str] = []
    for child in children:
        owner_uid = child["metadata"]["ownerReferences"][0]["uid"]
        live = await (lookup or (lambda c: _get(client, c)))(child)
        for _attempt in range(2):
            if live is not None and not controlled_by(live, owner_uid):
                raise ForeignChild(key_of(child), live)
            desired = keep_autoscaled_replicas(spec, child, live)
            patch = with_last_applied(desired) if live is None else plan_patch(live, desired)
            try:
                await _write(client, child, live, patch)
                break
            except KubeError as e:
                if e.status != 409 or live is not None:
                    raise
                live = await _get(client, child)  # created meanwhile, or not ours
        if live is None:
            created.append(key_of(child))
        elif patch is None:
            unchanged.append(key_of(child))
        else:
            patched.append(key_of(child))
    return ApplyResult(tuple(created), tuple(patched), tuple(unchanged))


async def prune_children(
    client: KubeClient,
    namespace: str,
    owner_uid: str,
    optional: list[tuple[str, str, str]],
    keep: set[str],
) -> tuple[str, ...]:
    """Delete optional children (e.g. an Ingress) the spec no longer renders, if we own them."""
    pruned: list[str] = []
    for api_version, kind, name in optional:
        if f"{kind}/{name}" in keep:
            continue
        live = await client.get(api_version, kind, namespace, name)
        owners = (live or {}).get("metadata", {}).get("ownerReferences", [])
        if any(o.get("uid") == owner_uid for o in owners):
            await client.delete(api_version, kind, namespace, name)
            pruned.append(f"{kind}/{name}")
    return tuple(pruned)
