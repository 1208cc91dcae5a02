"""``python bench/chaos.py --quick`` runs, and its recovery figures meet the issue's goals.

The isolation figures (bad input answered with a 5xx, streams poisoned by another
client's request) measure the edge's range checks and the engine's per-request fault
isolation (issue 9 points 1-2); the recovery figures measure migration, retries and
supervision (points 5-6).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.testing import chaos_figures
from pdserve.testing.loopback import run_bench

pytestmark = [pytest.mark.bench, pytest.mark.slow, pytest.mark.timeout(600)]


# One of the suite's slowest (~80 s alone): the bench's --quick run starts one `pdserve up`
# and runs every fault phase against it (kills, a hang, storms, tenant attacks), each phase
# waiting for recovery; the three tests below read the one run's figures.
@pytest.fixture(scope="module")
def chaos(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("chaos")
    result = run_bench(
        "chaos.py", "--quick", "--model", str(tiny_model_dir), "--out", str(out), timeout=580
    )
    assert (out / "chaos-quick.png").stat().st_size > 0
    return result


def test_chaos_recovery_figures(chaos: dict[str, Any]) -> None:
    assert chaos["soak_requests"] == 40 and chaos["soak_errors"] == 0, chaos["soak_error_samples"]
    assert chaos["decode_killed"] and chaos["decode_kill_failed_streams"] == 0
    # The kill landed on a worker running >= 4 of the phase's streams (seen in its own
    # /stats), and they moved: a kill of an idle worker (migrated 0) proves nothing, and
    # the bench fails that phase (failed_phases, exit 1) instead of passing it.
    assert chaos["decode_kill_victim_running"] >= 4, chaos
    assert chaos["migrated_streams"] >= 1 and chaos["decode_kill_passed"], chaos
    assert chaos["failed_phases"] == [], chaos
    assert chaos["prefill_killed"] and chaos["prefill_kill_failed_requests"] == 0
    assert chaos["decode_hung"] and chaos["hang_failed_streams"] == 0
    assert chaos["stalled_streams"] >= 1
    assert chaos["storm_5xx"] == chaos["overload_5xx"] == 0
    assert chaos["overload_429"] > 0 and chaos["overload_429_without_retry_after"] == 0
    assert chaos["workers_back"] and chaos["up_running"] and chaos["up_exit_code"] == 0, chaos
    assert chaos["leaked_blocks"] == 0 and chaos["workers_checked"] == 4


def test_chaos_isolation_figures(chaos: dict[str, Any]) -> None:
    assert chaos["bad_input_5xx"] == 0, chaos["bad_input_5xx_cases"]
    assert chaos["poisoned_streams"] == 0, chaos["poison_5xx"]


def test_chaos_tenant_figures(chaos: dict[str, Any]) -> None:
    """Issue 24: trickled bodies hold no slot, a client that stops reading is cut without
    harming other streams, chat text cannot forge control tokens, odd logit_bias keys are
    400s. Before the fixes: 5 refused, the reader never cut (aborted 0), 6 injected, 2
    odd-key 5xx (docs/benchmarks.md, chaos)."""
    assert chaos["slowloris_refused_others"] == 0, chaos
    assert chaos["slow_reader_harmed_streams"] == 0 and chaos["slow_reader_aborted"] >= 1, chaos
    assert chaos["control_token_injected"] == 0 and chaos["control_token_chat_ok"], chaos
    assert chaos["odd_key_5xx"] == 0 and chaos["odd_key_not_400"] == 0, chaos
    # Pathological grammars: each answered 200 or 400, other clients' streams on pace, and
    # no request aborted while compiling left decoding on a worker.
    assert chaos["grammar_specs"] == 5 and chaos["grammar_5xx"] == 0, chaos
    assert chaos["grammar_stalled_others"] == 0, chaos
    assert chaos["compile_aborts"] >= 1 and chaos["compile_abort_leaked"] == 0, chaos


def test_chaos_boundary_figures(chaos: dict[str, Any]) -> None:
    """Issue 44: no keyless change on the admin port, no limit the picker drops, no merged
    pod that lost its hardening, no symlink left in a sealed cache, no abandoned compile
    past its bound, no LoRA load outside --lora-root (bench/chaos_isolation.py)."""
    figures = chaos_figures.BOUNDARY
    assert {k: chaos[k] for k in figures} == dict.fromkeys(figures, 0), chaos
