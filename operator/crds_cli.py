"""``pdserve crds apply``: bring the cluster's CRDs up to this release's.

Helm installs ``crds/`` on the first install only and never upgrades it, so a chart
upgrade alone leaves the old LLMService schema (and its defaults) in the cluster. This
command server-side-applies the CRDs packaged with pdserve (the chart's ``crds/`` folder,
shipped as ``pdserve/crds``) with field manager ``pdserve``, and prints what changed per
CRD: ``created``, ``unchanged``, or ``configured`` with the changed fields. ``--dry-run``
asks the API server what would change (``dryRun=All``) and writes nothing. The chart's
opt-in pre-install/pre-upgrade hook (``crdUpgrade.enabled``) runs it as a Job.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import yaml

import pdserve

FIELD_MANAGER = "pdserve"
APPLY = "application/apply-patch+yaml"
PACKAGED = Path(pdserve.__file__).resolve().parent / "crds"
# What the API server changes on every write; not a change of ours.
IGNORED_METADATA = {"resourceVersion", "generation", "managedFields", "uid", "creationTimestamp"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["apply"], help="apply: server-side apply the CRDs")
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would change; write nothing (dryRun=All)"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=PACKAGED,
        help="folder of CRD YAML files (default: pdserve's own)",
    )


def load_crds(folder: Path) -> list[dict[str, Any]]:
    docs = []
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                docs.append(doc)
    if not docs:
        raise SystemExit(f"pdserve crds: no CustomResourceDefinition in {folder}")
    return docs


def changed_fields(before: Any, after: Any, path: str = "", depth: int = 3) -> list[str]:
    """Dotted paths (at most ``depth`` deep) whose values differ; lists compare whole."""
    if before == after:
        return []
    if depth == 0 or not isinstance(before, dict) or not isinstance(after, dict):
        return [path or "."]
    out: list[str] = []
    for key in sorted(set(before) | set(after)):
        if path == "metadata" and key in IGNORED_METADATA:
            continue
        sub = f"{path}.{key}" if path else key
        out += changed_fields(before.get(key), after.get(key), sub, depth - 1)
    return out


def describe(name: str, before: dict[str, Any] | None, after: dict[str, Any]) -> str:
    kind = f"customresourcedefinition.apiextensions.k8s.io/{name}"
    if before is None:
        return f"{kind} created"
    fields = changed_fields(
        {k: before.get(k) for k in ("metadata", "spec")},
        {k: after.get(k) for k in ("metadata", "spec")},
    )
    return f"{kind} configured ({', '.join(fields)})" if fields else f"{kind} unchanged"


def _api() -> Any:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:  # $KUBECONFIG as it is now (the client reads it once, at import)
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        except config.ConfigException as exc:
            raise SystemExit(f"pdserve crds: no cluster to talk to: {exc}") from exc
    return client.ApiextensionsV1Api()


def apply_one(api: Any, crd: dict[str, Any], dry_run: bool) -> str:
    from kubernetes.client.exceptions import ApiException

    name = crd["metadata"]["name"]
    try:
        resp = api.read_custom_resource_definition(name, _preload_content=False)
        before: dict[str, Any] | None = json.loads(resp.data)
    except ApiException as exc:
        if exc.status != 404:
            raise
        before = None
    resp = api.patch_custom_resource_definition(
        name,
        crd,
        field_manager=FIELD_MANAGER,
        force=True,
        dry_run="All" if dry_run else None,
        _content_type=APPLY,
        _preload_content=False,
    )
    return describe(name, before, json.loads(resp.data))


def run(args: argparse.Namespace) -> int:
    from kubernetes.client.exceptions import ApiException

    crds = load_crds(args.dir)
    api = _api()
    suffix = " (dry run)" if args.dry_run else ""
    for crd in crds:
        try:
            print(apply_one(api, crd, args.dry_run) + suffix, flush=True)
        except ApiException as exc:
            name = crd["metadata"]["name"]
            print(f"pdserve crds: applying {name} failed: HTTP {exc.status}: {exc.body or exc}")
            return 1
    return 0
