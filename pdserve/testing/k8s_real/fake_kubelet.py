"""Fake nodes and a fake kubelet for the real control plane (what kwok does, in ~100 lines).

There is no scheduler and no container runtime here. One watch on every pod (a single long
request, so the API server's request count stays the operator's) drives each pod as a
kubelet would: bind it to a fake node (the Binding subresource, as kube-scheduler does),
report it Running and Ready with a pod IP (the status subresource), and on a graceful delete
confirm it (``gracePeriodSeconds=0``, as the kubelet does once the containers stopped).
Namespaces in ``hold`` get bound but stay not Ready until ``release``.
"""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import json
import threading
from typing import Any

import httpx

NODES = ("fake-node-0", "fake-node-1")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def create_nodes(api: httpx.Client) -> None:
    for name in NODES:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        }
        r = api.post("/api/v1/nodes", json=node)
        assert r.status_code in (201, 409), r.text
        status = {
            "status": {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "FakeKubelet",
                        "lastHeartbeatTime": _now(),
                        "lastTransitionTime": _now(),
                    }
                ],
                "capacity": {"cpu": "64", "memory": "512Gi", "pods": "200"},
                "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "200"},
                "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
            }
        }
        r = api.patch(
            f"/api/v1/nodes/{name}/status",
            content=json.dumps(status),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert r.status_code == 200, r.text


def _ready_status(pod: dict[str, Any], ip: str, ready: bool) -> dict[str, Any]:
    flag = "True" if ready else "False"
    conds = [
        ("PodScheduled", "True"),
        ("Initialized", "True"),
        ("ContainersReady", flag),
        ("Ready", flag),
    ]
    containers = pod["spec"]["containers"]
    return {
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "hostIP": "10.0.0.1",
            "startTime": pod["status"].get("startTime") or _now(),
            "conditions": [
                {"type": t, "status": s, "lastTransitionTime": _now()} for t, s in conds
            ],
            "containerStatuses": [
                {
                    "name": c["name"],
                    "image": c["image"],
                    "imageID": "",
                    "ready": ready,
                    "started": True,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": _now()}},
                }
                for c in containers
            ],
        }
    }


class FakeKubelet:
    def __init__(self, api: httpx.Client, stream: httpx.Client) -> None:
        self.api, self.stream = api, stream
        self.hold: set[str] = set()
        self.stop = threading.Event()
        self.ips = (str(ipaddress.ip_address("10.244.0.10") + i) for i in itertools.count())
        self.pod_ip: dict[str, str] = {}
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True, name="fake-kubelet")
        self.nodes = itertools.cycle(NODES)

    def start(self) -> FakeKubelet:
        self.thread.start()
        return self

    def release(self, namespace: str) -> None:
        """Pods of ``namespace`` become Ready (now and from now on)."""
        self.hold.discard(namespace)
        pods = self.api.get(f"/api/v1/namespaces/{namespace}/pods").json()["items"]
        for pod in pods:
            self._drive(pod)

    def _run(self) -> None:
        rv = ""
        while not self.stop.is_set():
            try:
                if not rv:
                    listing = self.api.get("/api/v1/pods").json()
                    for pod in listing["items"]:
                        self._drive(pod)
                    rv = listing["metadata"]["resourceVersion"]
                rv = self._watch(rv)
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                if not self.stop.is_set():
                    self.errors.append(repr(e))
                    self.stop.wait(0.5)  # the API server restarts: watch again
                    rv = ""

    def _watch(self, rv: str) -> str:
        params = {
            "watch": "1",
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "30",
        }
        with self.stream.stream("GET", "/api/v1/pods", params=params) as resp:
            for line in resp.iter_lines():
                if self.stop.is_set() or not line:
                    continue
                event = json.loads(line)
                if event["type"] == "ERROR":
                    return ""  # 410 Gone: list again
                rv = event["object"]["metadata"].get("resourceVersion", rv)
                if event["type"] in ("ADDED", "MODIFIED"):
                    self._drive(event["object"])
        return rv

    def _drive(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        if meta.get("deletionTimestamp"):
            self.api.delete(path, params={"gracePeriodSeconds": "0"})
            return
        if not spec.get("nodeName"):
            binding = {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": meta["name"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": next(self.nodes)},
            }
            self.api.post(path + "/binding", json=binding)
            return  # the bind's MODIFIED event brings it back
        ready = meta["namespace"] not in self.hold
        conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
        if (
            pod.get("status", {}).get("phase") == "Running"
            and (conds.get("Ready") == "True") == ready
        ):
            return
        ip = self.pod_ip.setdefault(meta["uid"], next(self.ips))
        self.api.patch(
            path + "/status",
            content=json.dumps(_ready_status(pod, ip, ready)),
            headers={"Content-Type": "application/merge-patch+json"},
        )

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=40)
