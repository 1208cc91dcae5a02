"""A short tag for this host's CPU: every cache of compiled code is keyed by it.

Compiled code belongs to the CPU it was built for. Inductor's generated kernels
hard-code the vector width of the ISA it picked (which ``ATEN_CPU_CAPABILITY`` also
sets), yet its graph cache does not key on that ISA; the attention kernel is built
with ``-march=native``. A cache that another CPU filled (a volume mounted on several
nodes, an image baked elsewhere, another ``ATEN_CPU_CAPABILITY``) would hand this
host that CPU's code. Measured: inductor's cache returned a model's AVX-512 kernels
to an AVX2 run, which compiled them with 8-lane vectors for 16-lane loops: NaN logits,
every greedy token 0, no error. An attention kernel built for AVX-512 stops a CPU
without it with SIGILL. So the caches are keyed by ``host_tag()``.

Stdlib only: ``pdserve.engine`` calls it at import, before torch.
"""

from __future__ import annotations

import hashlib
import os
import platform
from functools import cache
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_flags() -> list[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``), sorted; or the
    processor's name where /proc/cpuinfo is absent."""
    try:
        text = CPUINFO.read_text(errors="replace")
    except OSError:
        return [platform.processor()]
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return sorted(set(value.split()))
    return [platform.processor()]


@cache
def host_tag() -> str:
    """``<machine>-<12 hex>``: equal on hosts whose compiled code is interchangeable."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "")
    text = "|".join([platform.machine(), capability, " ".join(cpu_flags())])
    return f"{platform.machine()}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
