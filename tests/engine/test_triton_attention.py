"""The Triton paged-attention kernels, run by Triton's interpreter on CPU tensors.

Triton decides at import whether it interprets (``TRITON_INTERPRET=1`` must be set before
triton and triton.language are first imported, and the engine imports them through
torch's inductor), so the kernels run in a child process that sets it: the suite's own
process keeps triton as it found it.

Proves: decode tiles and prefill-chunk tiles (a chunk that starts its request, chunks
that continue a cached context, decodes in the same step) equal the gather reference
within 1e-5 in float32, over random block tables (blocks in random pool order, table rows
padded with other requests' blocks), context lengths 1..600, GQA 1/2/4, sliding windows,
soft-capping and sinks on and off (triton_cases.py holds the cases and the reference).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton_cases

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).resolve().parent
TOLERANCE = 1e-5


def interpreted_env() -> dict[str, str]:
    return {**os.environ, "TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module")
def kernel_errors() -> dict[str, float]:
    """Every case's largest difference from the reference, from one interpreter process."""
    out = subprocess.run(
        [sys.executable, str(HERE / "triton_cases.py")],
        capture_output=True, text=True, timeout=280, env=interpreted_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_cases_cover_the_ranges() -> None:
    cases = triton_cases.CASES
    assert {c.gqa for c in cases} == {1, 2, 4}
    contexts = [s + n for c in cases for s, n in c.chunks]
    assert min(contexts) == 1 and max(contexts) == 600
    assert any(c.window for c in cases) and any(not c.window for c in cases)
    assert any(c.softcap for c in cases) and any(not c.softcap for c in cases)
    assert any(c.pad for c in cases) and any(c.sinks for c in cases)
    # A chunk that starts its request, one that continues a context, decodes beside them.
    chunks = triton_cases.MIXED
    assert (0, 37) in chunks and any(s > 0 and n > 1 for s, n in chunks)
    assert any(n == 1 for _, n in chunks)
    assert len({c.id for c in cases}) == len(cases)


@pytest.mark.parametrize("case_id", [c.id for c in triton_cases.CASES] + ["store_kv"])
def test_kernel_matches_reference(kernel_errors: dict[str, float], case_id: str) -> None:
    err = kernel_errors[case_id]
    assert err <= TOLERANCE, f"{case_id}: max |triton - reference| = {err}"  # NaN fails too
