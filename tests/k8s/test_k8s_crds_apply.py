"""``pdserve crds apply``: server-side apply of the chart's CRDs, against the API emulator.

The command runs for real (the official ``kubernetes`` client, the kubeconfig fixture's
context) in a thread beside the emulator; the emulator implements apply patches (create
if missing, merge, ``dryRun=All``, ``fieldManager`` required: a 422 without it).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from k8s_helpers import ROOT

from pdserve.cli import main as pdserve_main
from pdserve.testing.k8s_emulator import ApiServer

pytestmark = pytest.mark.timeout(60)
CRDS = ROOT / "charts" / "pdserve" / "crds"
CRD_RESOURCE = "apiextensions.k8s.io/v1/customresourcedefinitions"


def chart_crd_names() -> list[str]:
    return sorted(
        d["metadata"]["name"]
        for p in CRDS.glob("*.yaml")
        for d in yaml.safe_load_all(p.read_text())
        if d
    )


def stored(server: ApiServer) -> dict[str, dict[str, Any]]:
    return {
        o["metadata"]["name"]: o
        for (r, _ns, _n), o in server.objects.items()
        if r.plural == "customresourcedefinitions" and not o.deleted
    }


async def crds(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    rc = await asyncio.to_thread(pdserve_main, ["crds", "apply", *args])
    return rc, capsys.readouterr().out.splitlines()


@pytest.fixture
def crd_server(api_server: ApiServer, kubeconfig: str) -> ApiServer:
    api_server.resources[CRD_RESOURCE] = kmock.ResourceInfo(
        kind="CustomResourceDefinition",
        namespaced=False,
        verbs={"get", "list", "watch", "create", "patch"},
    )
    return api_server


async def test_apply_creates_reports_unchanged_and_configured(
    crd_server: ApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = chart_crd_names()
    assert "llmservices.pdserve.io" in names
    rc, out = await crds("--dry-run", capsys=capsys)
    assert rc == 0 and stored(crd_server) == {}  # a dry run writes nothing
    assert out == [
        f"customresourcedefinition.apiextensions.k8s.io/{n} created (dry run)"
        for n in sorted(names, key=lambda n: out_order(n))
    ]
    rc, out = await crds(capsys=capsys)
    assert rc == 0 and all(line.endswith(" created") for line in out) and len(out) == len(names)
    llm = stored(crd_server)["llmservices.pdserve.io"]
    chart = yaml.safe_load((CRDS / "llmservices.pdserve.io.yaml").read_text())
    assert llm["spec"] == chart["spec"]
    rc, out = await crds(capsys=capsys)
    assert rc == 0 and all(line.endswith(" unchanged") for line in out), out

    # A newer release: one more printer column in the LLMService CRD.
    newer = tmp_path / "crds"
    shutil.copytree(CRDS, newer)
    crd = yaml.safe_load((newer / "llmservices.pdserve.io.yaml").read_text())
    column = {"name": "Model", "type": "string", "jsonPath": ".spec.model.servedName"}
    crd["spec"]["versions"][0].setdefault("additionalPrinterColumns", []).append(column)
    (newer / "llmservices.pdserve.io.yaml").write_text(yaml.safe_dump(crd))
    rc, out = await crds("--dir", str(newer), "--dry-run", capsys=capsys)
    line = next(x for x in out if "llmservices" in x)
    assert line.endswith("configured (spec.versions) (dry run)"), line
    assert stored(crd_server)["llmservices.pdserve.io"]["spec"] == chart["spec"]  # not written
    rc, out = await crds("--dir", str(newer), capsys=capsys)
    assert rc == 0 and any(
        x.endswith("llmservices.pdserve.io configured (spec.versions)") for x in out
    ), out
    assert (
        column
        in stored(crd_server)["llmservices.pdserve.io"]["spec"]["versions"][0][
            "additionalPrinterColumns"
        ]
    )


def out_order(name: str) -> tuple[int, str]:
    """The command applies files in name order, each file's documents in order."""
    files = sorted(CRDS.glob("*.yaml"))
    for i, path in enumerate(files):
        docs = [d["metadata"]["name"] for d in yaml.safe_load_all(path.read_text()) if d]
        if name in docs:
            return i, f"{docs.index(name):03d}"
    raise AssertionError(name)


async def test_api_server_error_is_reported_not_a_traceback(
    crd_server: ApiServer, capsys: pytest.CaptureFixture[str]
) -> None:
    crd_server.outage = 503
    rc, out = await crds(capsys=capsys)
    assert rc == 1
    assert out[-1].startswith("pdserve crds: applying ") and "HTTP 503" in out[-1]
