"""A venv on an optimised CPython that runs this venv's packages: the shipped interpreter's
stand-in for the router benchmarks.

The router image (Dockerfile) runs ``python:3.11-slim``, whose CPython is built with
profile-guided optimisation and link-time optimisation (``--enable-optimizations
--with-lto``). A development venv is often on an interpreter built without either (pyenv's
default build, this repository's venv on its CI machine), which runs pure Python markedly
slower, and the router is mostly pure Python. Debian's ``/usr/bin/python3`` is built with
PGO and LTO (its changelog; a static executable), so on a Debian host it is the closest
stand-in for the image's interpreter there is without a container runtime.

    python bench/opt_venv.py                     # makes .cache/opt-venv, prints its python
    python bench/router_throughput.py --router-python "$(python bench/opt_venv.py)"
    python bench/router_throughput.py --compare-python "$(python bench/opt_venv.py)"

The new venv has no packages of its own: a ``.pth`` file adds this venv's site-packages
(the same CPython minor version, so the same extension ABI). Both interpreters' speed on a
small pure-Python loop is printed to stderr, so the gap is seen, not assumed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Imported first from the .pth: the repository's top-level operator/ (the kopf operator)
# would otherwise shadow the standard library's module when the interpreter starts in the
# repository's root, as pyenv's interpreter never lets happen (its start-up imports it).
PTH = 'import operator, collections\nimport site; site.addsitedir("{site}")\n'

LOOP = """
import time
def work():
    d = {}
    for i in range(200_000):
        d[i % 97] = d.get(i % 97, 0) + len(f"{i}:{i * 2}")
    return d
best = min((lambda t: (work(), time.perf_counter() - t)[1])(time.perf_counter())
           for _ in range(5))
print(best)
"""


def loop_seconds(python: str) -> float:
    out = subprocess.run([python, "-c", LOOP], capture_output=True, text=True, check=True, cwd="/")
    return float(out.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="/usr/bin/python3", help="the optimised interpreter")
    p.add_argument("--out", default=str(ROOT / ".cache" / "opt-venv"))
    args = p.parse_args(argv)
    if not Path(args.base).exists():
        p.error(f"{args.base} does not exist")
    probe = subprocess.run(
        [args.base, "-c", "import sys; print(*sys.version_info[:2], sep='.')"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    ours = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if probe.stdout.strip() != ours:
        p.error(f"{args.base} is Python {probe.stdout.strip()}; this venv's packages need {ours}")
    out = Path(args.out)
    python = out / "bin" / "python"
    if not python.exists():
        subprocess.run([args.base, "-m", "venv", "--without-pip", str(out)], check=True, cwd="/")
    site = sysconfig.get_paths()["purelib"]
    target = out / "lib" / f"python{ours}" / "site-packages" / "pdserve_parent_venv.pth"
    target.write_text(PTH.format(site=site))
    t0 = time.perf_counter()
    here, there = loop_seconds(sys.executable), loop_seconds(str(python))
    print(
        f"pure-Python loop: {sys.executable} {1000 * here:.1f} ms, {python} "
        f"{1000 * there:.1f} ms ({here / there:.2f}x); checked in "
        f"{time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
