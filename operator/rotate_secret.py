"""``pdserve rotate-secret NAME``: a new service secret for an LLMService, without a failed call.

Pods read the Secret's ``secret`` (signs and verifies) and ``accepted`` (verifies only) at
start (pdserve/keys.py). Three edits, each rolled out to the router and both pools
before the next, so that pods of adjacent steps always check each other's signatures:

1. ``accepted`` = new          (everyone signs with the old one, accepts both)
2. ``secret`` = new, ``accepted`` = old
3. ``accepted`` removed

The block-hash key (``hash-key``) is left alone: the prefix cache stays valid. A Secret
from before that entry gets it first: the old secret's value, from which its pods derive
the block-hash key now (protocol/hashing.py), so no KV handle or prefix index goes stale.
The operator does not patch it in itself: until the secret rotates the pods derive the
same key without the entry, and the operator's RBAC has no ``patch`` on Secrets. A
rollout is ``kubectl rollout restart``'s annotation on each Deployment, then a wait for
its status; the operator's drift repair keeps annotations it did not render.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from pdserve.operator import kube
from pdserve.operator import naming as n

RESTARTED_AT = "kubectl.kubernetes.io/restartedAt"  # what `kubectl rollout restart` sets
Roll = Callable[[str], Awaitable[None]]


class RotationError(RuntimeError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the LLMService")
    parser.add_argument("-n", "--namespace", default="default")
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds each of the three rollouts may take"
    )


def _b64(value: str) -> str:
    return base64.b64encode(value.encode()).decode()


async def rotate(client: kube.KubeClient, namespace: str, name: str, new: str, roll: Roll) -> None:
    """The three steps, each followed by ``roll`` (restart every pod, wait until rolled)."""
    secret_name = n.service_secret_name(name)
    live = await client.get("v1", "Secret", namespace, secret_name)
    if live is None:
        raise RotationError(f'Secret "{secret_name}" not found in namespace "{namespace}"')
    data = live.get("data") or {}
    if data.get(n.SECRET_ACCEPTED_KEY):
        raise RotationError(
            f"{secret_name} has '{n.SECRET_ACCEPTED_KEY}' set: a rotation is "
            "under way; finish it by hand (docs/security.md)"
        )
    old = base64.b64decode(data[n.SECRET_KEY]).decode()
    if not data.get(n.HASH_KEY_KEY):  # a Secret from before the entry: keep the block hash
        patch = {"data": {n.HASH_KEY_KEY: _b64(old)}}
        await client.patch("v1", "Secret", namespace, secret_name, patch)
    steps: list[dict[str, Any]] = [
        {n.SECRET_ACCEPTED_KEY: _b64(new)},
        {n.SECRET_KEY: _b64(new), n.SECRET_ACCEPTED_KEY: _b64(old)},
        {n.SECRET_ACCEPTED_KEY: None},  # a merge patch's null removes the entry
    ]
    for i, step in enumerate(steps, 1):
        await client.patch("v1", "Secret", namespace, secret_name, {"data": step})
        await roll(f"step {i}/3")


def rolled_out(dep: dict[str, Any]) -> bool:
    status, want = dep.get("status") or {}, (dep.get("spec") or {}).get("replicas", 1)
    generation = (dep.get("metadata") or {}).get("generation", 0)
    return (
        status.get("observedGeneration", 0) >= generation
        and status.get("updatedReplicas", 0) == want
        and status.get("readyReplicas", 0) == want
        and not status.get("unavailableReplicas")
    )


def restarter(
    client: kube.KubeClient, namespace: str, name: str, timeout: float, poll_s: float = 2.0
) -> Roll:
    """A ``Roll`` that restarts the three Deployments and waits until each has rolled."""

    async def roll(label: str) -> None:
        stamp = datetime.now(UTC).isoformat()
        patch = {"spec": {"template": {"metadata": {"annotations": {RESTARTED_AT: stamp}}}}}
        names = [n.deployment_name(name, role) for role in n.ROLES]
        for dep in names:
            await client.patch("apps/v1", "Deployment", namespace, dep, patch)
        deadline = time.monotonic() + timeout
        for dep in names:
            while not rolled_out(await client.get("apps/v1", "Deployment", namespace, dep) or {}):
                if time.monotonic() > deadline:
                    raise RotationError(
                        f"{label}: {dep} did not roll out within {timeout:g}s; "
                        "the Secret is left at this step"
                    )
                await asyncio.sleep(poll_s)
        print(f"{label}: rolled out", file=sys.stderr)

    return roll


async def _main(args: argparse.Namespace) -> None:
    client = kube.KubeClient(kube.login(), login_fn=kube.login)
    try:
        roll = restarter(client, args.namespace, args.name, args.timeout)
        await rotate(client, args.namespace, args.name, secrets.token_urlsafe(32), roll)
    finally:
        await client.close()


def run(args: argparse.Namespace) -> int:
    try:
        asyncio.run(_main(args))
    except (RotationError, kube.KubeError) as e:
        print(f"pdserve rotate-secret: {e}", file=sys.stderr)
        return 1
    print(f"pdserve rotate-secret: {args.namespace}/{args.name} has a new service secret")
    return 0
