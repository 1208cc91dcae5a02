"""``pip install 'pdserve[router]'`` is a router without torch: a fresh venv gets the extra
(from this checkout, with uv and the index arguments scripts/setup.sh uses), torch is not
importable there, ``pdserve router --help`` works, and the router serves ``/v1/models`` for
the tiny model. About 30 s with uv's cache warm."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.testing.loopback import free_port

ROOT = Path(__file__).resolve().parents[1]
UV = ROOT / ".venv" / "bin" / "uv"
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def _pip(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else ""


def _uv_args() -> list[str]:
    """pip's sources as uv's flags (scripts/uv_args.py), as setup.sh passes them."""
    argv = [sys.executable, str(ROOT / "scripts" / "uv_args.py"), _pip("config", "list")]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return [a for a in out.splitlines() if a]


def _install_router_extra(venv: Path) -> Path:
    env = dict(os.environ)
    cert = _pip("config", "get", "global.cert").strip()  # uv's TLS takes pip's, as setup.sh
    if cert and not env.get("SSL_CERT_FILE"):
        env["SSL_CERT_FILE"] = cert
    subprocess.run([str(UV), "venv", "-q", str(venv), "--python", sys.executable], check=True)
    python = venv / "bin" / "python"
    cmd = [
        str(UV),
        "pip",
        "install",
        "-q",
        "--python",
        str(python),
        "--index-strategy",
        "unsafe-best-match",
        *_uv_args(),
        f"{ROOT}[router]",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return python


@pytest.mark.skipif(not UV.exists(), reason="uv is installed by scripts/setup.sh")
def test_the_router_extra_installs_and_serves_without_torch(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    python = _install_router_extra(tmp_path / "venv")
    no_torch = subprocess.run([str(python), "-c", "import torch"], capture_output=True, text=True)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    pdserve = str(tmp_path / "venv" / "bin" / "pdserve")
    helped = subprocess.run([pdserve, "router", "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "--model" in helped.stdout, helped.stderr
    port = free_port()
    argv = [
        pdserve,
        "router",
        "--model",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--decode",
        "http://127.0.0.1:9",
        "--log-level",
        "warning",
    ]
    router = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        models = _get_when_up(f"http://127.0.0.1:{port}/v1/models", router)
        assert [m["id"] for m in models["data"]] == [tiny_model_dir.name]
    finally:
        router.terminate()
        router.wait(10)


def _get_when_up(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, (proc.stdout.read() if proc.stdout else b"").decode()[-2000:]
        try:
            reply = httpx.get(url, timeout=2.0)
            if reply.status_code == 200:
                return dict(reply.json())
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} did not answer in {timeout_s} s")
