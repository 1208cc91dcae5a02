"""What an LLMService may put into its pods: an allowlist, so that an LLMService is not a
pod factory.

Whoever may create an LLMService gets the operator's pods for it, and the operator may
create Deployments in every namespace it watches. Without a policy ``podTemplate`` (and a
``hostPath`` model source) would hand that author any pod: the node's filesystem, its
network and PID namespaces, a privileged container, another ServiceAccount's token. So
the fields a template may set are listed here and everything else is refused by name
(the message lands in the ``Degraded`` condition). Allowed: labels and annotations,
scheduling (tolerations, affinity, node selector, topology spread, priority and runtime
class), env, resources, volumes of the kinds below, sidecars with the same container
fields, and securityContext fields that only tighten the rendered one.
A cluster admin may opt out (``--allow-unsafe-pod-fields``, chart value
``operator.allowUnsafePodFields``) where every LLMService author is trusted.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.operator import naming as n
from pdserve.operator.exposure import ExposurePolicy, exposure_violations
from pdserve.operator.spec import LLMServiceSpec, SpecError


@dataclass(frozen=True)
class PodPolicy:
    allow_unsafe: bool = False  # a cluster admin's opt-out: every field passes
    # Host directories a model may be read from (spec.model.source.hostPath); none by default.
    model_host_paths: tuple[str, ...] = ()
    # Service types, Ingress classes, hosts and Gateways the router may be exposed through.
    exposure: ExposurePolicy = field(default_factory=ExposurePolicy)


POD_SPEC_FIELDS = frozenset(
    {
        "containers",
        "initContainers",
        "volumes",
        "tolerations",
        "affinity",
        "nodeSelector",
        "topologySpreadConstraints",
        "priorityClassName",
        "runtimeClassName",
        "securityContext",
        "terminationGracePeriodSeconds",
        "imagePullSecrets",
        "serviceAccountName",
    }
)
CONTAINER_FIELDS = frozenset(
    {
        "name",
        "image",
        "imagePullPolicy",
        "command",
        "args",
        "workingDir",
        "env",
        "envFrom",
        "resources",
        "volumeMounts",
        "ports",
        "securityContext",
        "livenessProbe",
        "readinessProbe",
        "startupProbe",
        "lifecycle",
        "restartPolicy",
        "terminationMessagePath",
        "terminationMessagePolicy",
    }
)
# Volume sources that reach nothing outside the pod's own namespace: no node paths, no
# storage servers named inline (nfs, iscsi, ...), which bypass the cluster's PV admission.
VOLUME_KINDS = frozenset(
    {
        "emptyDir",
        "configMap",
        "secret",
        "downwardAPI",
        "projected",
        "persistentVolumeClaim",
        "ephemeral",
    }
)
# Annotations that switch a container's confinement off (the pre-field forms).
_UNSAFE_ANNOTATION_PREFIXES = (
    "container.apparmor.security.beta.kubernetes.io/",
    "seccomp.security.alpha.kubernetes.io/",
)
_UNCONFINED = ("Unconfined", "unconfined")


def check_service(svc: LLMServiceSpec, policy: PodPolicy) -> None:
    """Raise SpecError naming the first field ``policy`` refuses in ``svc``."""
    if policy.allow_unsafe:
        return
    problem = next(violations(svc, policy), None)
    if problem is not None:
        raise SpecError(*problem)


def violations(svc: LLMServiceSpec, policy: PodPolicy) -> Iterator[tuple[str, str]]:
    """``(field, why)`` for every field of ``svc`` outside the allowlist."""
    src = svc.model.source
    if src.kind == "hostPath" and not _under(src.path, policy.model_host_paths):
        allowed = list(policy.model_host_paths) or "none"
        yield (
            "spec.model.source.hostPath.path",
            f"{src.path!r} is not under a host path the operator allows ({allowed}); "
            "mount the model from a PVC",
        )
    own = {"router": n.router_account_name(svc.name), "prefill": "", "decode": ""}
    templates = {"router": svc.router.pod_template}
    templates.update({p.role: p.pod_template for p in svc.pools})
    for role, template in templates.items():
        yield from template_violations(f"spec.{role}.podTemplate", template, own[role])
        yield from cache_violations(f"spec.{role}.podTemplate.spec", template.get("spec") or {})
    if svc.router.ingress is not None:
        yield from ingress_violations(
            "spec.router.ingress.annotations", svc.router.ingress.annotations
        )
    yield from exposure_violations(svc, policy.exposure)
    yield from merged_violations(svc)


# Ingress annotations: the controllers' per-route settings that configure this route only.
# Snippets (nginx's configuration-snippet, server-snippet, ...) inject raw controller
# configuration: other tenants' routes, the controller's own credentials (CVE-2021-25742).
INGRESS_ANNOTATION_PREFIXES = ("cert-manager.io/", "external-dns.alpha.kubernetes.io/")
INGRESS_ANNOTATIONS = frozenset(
    {
        "kubernetes.io/ingress.class",
        "kubernetes.io/tls-acme",
        *(
            f"nginx.ingress.kubernetes.io/{k}"
            for k in (
                "proxy-body-size",
                "proxy-read-timeout",
                "proxy-send-timeout",
                "proxy-connect-timeout",
                "proxy-buffering",
                "proxy-request-buffering",
                "ssl-redirect",
                "force-ssl-redirect",
                "limit-rps",
                "limit-rpm",
                "limit-connections",
                "whitelist-source-range",
                "allowlist-source-range",
                "enable-cors",
                "cors-allow-origin",
                "backend-protocol",
            )
        ),
        *(f"traefik.ingress.kubernetes.io/{k}" for k in ("router.entrypoints", "router.tls")),
    }
)


def ingress_violations(path: str, annotations: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    for key in sorted(annotations):
        if "snippet" in key:
            yield f"{path}.{key}", "injects raw controller configuration"
        elif key not in INGRESS_ANNOTATIONS and not key.startswith(INGRESS_ANNOTATION_PREFIXES):
            yield f"{path}.{key}", "is not in the Ingress annotation allowlist"


def _under(path: str, roots: tuple[str, ...]) -> bool:
    parts = [p for p in path.split("/") if p]
    if ".." in parts:
        return False
    return any(parts[: len(r)] == r for r in ([p for p in root.split("/") if p] for root in roots))


def template_violations(
    path: str, template: Mapping[str, Any], own_account: str
) -> Iterator[tuple[str, str]]:
    """The refused fields of one podTemplate; ``own_account``: the ServiceAccount the pod
    runs as ("" for none: the namespace's default, which a template may not change)."""
    meta = template.get("metadata") or {}
    for key in sorted(set(meta) - {"labels", "annotations"}):
        yield f"{path}.metadata.{key}", "is not in the podTemplate allowlist (labels, annotations)"
    for key, value in (meta.get("annotations") or {}).items():
        if key.startswith(_UNSAFE_ANNOTATION_PREFIXES) and str(value).startswith(_UNCONFINED):
            yield f"{path}.metadata.annotations.{key}", "would run the pod unconfined"
    pod = template.get("spec") or {}
    p = f"{path}.spec"
    for key in sorted(set(pod) - POD_SPEC_FIELDS):
        yield f"{p}.{key}", _why(key)
    account = pod.get("serviceAccountName")
    if account is not None and account != own_account:
        yield (
            f"{p}.serviceAccountName",
            f"must be the service's own ({own_account or 'none'}), got {account!r}",
        )
    yield from pod_security_violations(f"{p}.securityContext", pod.get("securityContext") or {})
    for i, vol in enumerate(pod.get("volumes") or []):
        kinds = sorted(set(vol) - {"name"} - VOLUME_KINDS)
        if kinds:
            allowed = ", ".join(sorted(VOLUME_KINDS))
            yield f"{p}.volumes[{i}].{kinds[0]}", f"volume kind not allowed (allowed: {allowed})"
    for section in ("containers", "initContainers"):
        for i, container in enumerate(pod.get(section) or []):
            yield from container_violations(f"{p}.{section}[{i}]", container)


def _why(key: str) -> str:
    if key in ("hostPID", "hostNetwork", "hostIPC"):
        return "would share the node's namespaces"
    if key == "hostUsers":
        return "user namespaces are the cluster's choice"
    if key == "nodeName":
        return "bypasses the scheduler; use nodeSelector or affinity"
    return "is not in the podTemplate allowlist"


def container_violations(path: str, c: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    for key in sorted(set(c) - CONTAINER_FIELDS):
        yield f"{path}.{key}", "is not in the container allowlist"
    for j, port in enumerate(c.get("ports") or []):
        for key in ("hostPort", "hostIP"):
            if key in port:
                yield f"{path}.ports[{j}].{key}", "would bind on the node's network"
    for j, mount in enumerate(c.get("volumeMounts") or []):
        if mount.get("mountPropagation") not in (None, "None"):
            yield f"{path}.volumeMounts[{j}].mountPropagation", "must be None"
    yield from container_security_violations(
        f"{path}.securityContext", c.get("securityContext") or {}
    )


def _common_security(path: str, ctx: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    if ctx.get("runAsNonRoot") is False:
        yield f"{path}.runAsNonRoot", "may only be true (the rendered pods run as non-root)"
    for key in ("runAsUser", "runAsGroup"):
        if ctx.get(key) == 0:
            yield f"{path}.{key}", "must not be 0 (root)"
    if "seLinuxOptions" in ctx:
        yield f"{path}.seLinuxOptions", "may set an unconfined SELinux type"
    for key in ("seccompProfile", "appArmorProfile"):
        if (ctx.get(key) or {}).get("type") == "Unconfined":
            yield f"{path}.{key}.type", "must not be Unconfined"
    if "windowsOptions" in ctx:
        yield f"{path}.windowsOptions", "is not in the securityContext allowlist"


def pod_security_violations(path: str, ctx: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    yield from _common_security(path, ctx)
    if "sysctls" in ctx:
        yield f"{path}.sysctls", "are node settings, not the service's"
    if 0 in (ctx.get("supplementalGroups") or []):
        yield f"{path}.supplementalGroups", "must not include 0 (root's group)"


def container_security_violations(path: str, ctx: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    yield from _common_security(path, ctx)
    if ctx.get("privileged"):
        yield f"{path}.privileged", "may only be false"
    if ctx.get("allowPrivilegeEscalation"):
        yield f"{path}.allowPrivilegeEscalation", "may only be false"
    if ctx.get("readOnlyRootFilesystem") is False:
        yield f"{path}.readOnlyRootFilesystem", "may only be true"
    if ctx.get("procMount") not in (None, "Default"):
        yield f"{path}.procMount", "must be Default"
    if (ctx.get("capabilities") or {}).get("add"):
        yield f"{path}.capabilities.add", "adds Linux capabilities (only drop is allowed)"


# What every container of the rendered, merged pod must end up with. The template checks
# above see only what a podTemplate sets; the merge (operator/pod_template.py) replaces
# lists and copies nulls, so ``capabilities: {drop: []}`` or ``runAsNonRoot: null`` in a
# template would unset the rendered hardening while passing them.
HARDENED = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True}


def merged_violations(svc: LLMServiceSpec) -> Iterator[tuple[str, str]]:
    """The hardening of every container in the pods the operator would create for ``svc``
    (its podTemplates merged in), named by the template field that sets it."""
    from pdserve.operator.render import render_spec  # render imports this module

    for child in render_spec(svc):
        if child["kind"] != "Deployment":
            continue
        role = child["metadata"]["labels"].get(n.LABEL_ROLE, "")
        yield from merged_pod_violations(
            f"spec.{role}.podTemplate.spec", child["spec"]["template"]["spec"]
        )


def merged_pod_violations(path: str, pod: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    pod_ctx = pod.get("securityContext")
    if pod_ctx is None:
        yield f"{path}.securityContext", "must not be null (it would unset the rendered one)"
    yield from _nulls(f"{path}.securityContext", pod_ctx)
    pod_non_root = (pod_ctx or {}).get("runAsNonRoot")
    for section in ("initContainers", "containers"):
        for i, c in enumerate(pod.get(section) or []):
            p = f"{path}.{section}[{i}].securityContext"
            ctx = c.get("securityContext")
            if "securityContext" in c and ctx is None:
                yield p, "must not be null (it would unset the rendered one)"
            yield from _nulls(p, ctx)
            ctx = ctx if isinstance(ctx, Mapping) else {}
            where = f"in the merged pod (container {c.get('name')!r})"
            if ctx.get("runAsNonRoot", pod_non_root) is not True:
                yield f"{p}.runAsNonRoot", f"must be true {where}"
            for key, want in HARDENED.items():
                if ctx.get(key) is not want:
                    yield f"{p}.{key}", f"must be {str(want).lower()} {where}"
            drop = (ctx.get("capabilities") or {}).get("drop")
            if not isinstance(drop, list) or "ALL" not in drop:
                yield f"{p}.capabilities.drop", f"must include ALL {where}"
            if ctx.get("privileged") not in (None, False):
                yield f"{p}.privileged", "may only be false"


def _nulls(path: str, value: Any) -> Iterator[tuple[str, str]]:
    """Every null below ``path``: a null in a template unsets what the operator rendered."""
    if value is None:
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if item is None:
                yield f"{path}.{key}", "must not be null (it would unset the rendered value)"
            else:
                yield from _nulls(f"{path}.{key}", item)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if item is None:
                yield f"{path}[{i}]", "must not be null"
            else:
                yield from _nulls(f"{path}[{i}]", item)


# The shared model cache (spec.model.source.huggingFace.cache) holds weights, tokenizers
# and every service's compiled code. Its only writers are the operator's init containers
# (the model's download, the compiled-code folder) and each service's workers in their
# own subPath. A template may not reach it: not the rendered ``model`` volume or a mount
# of it, not the operator's init containers (their command or env would write there),
# and a claim it mounts itself is read-only (it may be another service's cache).
OPERATOR_INIT_CONTAINERS = ("download-model", "compile-cache-dir")


def cache_violations(path: str, pod: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    for i, vol in enumerate(pod.get("volumes") or []):
        if vol.get("name") == "model":
            yield f"{path}.volumes[{i}].name", "'model' is the operator's model volume"
        claim = vol.get("persistentVolumeClaim")
        if isinstance(claim, Mapping) and claim.get("readOnly") is not True:
            yield (
                f"{path}.volumes[{i}].persistentVolumeClaim.readOnly",
                "must be true: the claim may be a shared model cache",
            )
    for section in ("containers", "initContainers"):
        for i, c in enumerate(pod.get(section) or []):
            if section == "initContainers" and c.get("name") in OPERATOR_INIT_CONTAINERS:
                yield f"{path}.{section}[{i}].name", f"{c['name']!r} is the operator's"
            for j, mount in enumerate(c.get("volumeMounts") or []):
                if mount.get("name") == "model":
                    yield (
                        f"{path}.{section}[{i}].volumeMounts[{j}]",
                        "mounts the operator's model volume (the shared cache)",
                    )
