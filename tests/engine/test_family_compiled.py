"""The family matrix on the compiled forward (``torch.compile``, what workers serve
with), for one family per attention option: the suite otherwise runs eager
(tests/conftest.py sets PDSERVE_ENFORCE_EAGER=1; ``compile=True`` here turns it off on
purpose). A compile costs seconds to a minute on CPU per family, so the whole table
compiled would cost minutes: docs/models.md says which rows run here.

Inductor's cache (``PDSERVE_COMPILE_CACHE``, one directory shared by the session and by
later sessions) keeps the generated kernels, so a rerun loads instead of compiling.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import family_config
from test_model_families import SERVED, _generate, _model_dir, _reference

from pdserve.engine import cpu_linear
from pdserve.engine.llm_engine import LLMEngine
from tests.model_families import BY_ID, Family

pytestmark = [pytest.mark.unit, pytest.mark.timeout(600)]

# Window + soft-cap (gemma2), sinks + window + MoE (gpt-oss), MLA compressed + MoE
# (deepseek-v2: the absorbed query and output run in the compiled graph around the
# attention operator). Also token-identical compiled, left out for the suite's time (a
# compile each, tens of seconds even from inductor's cache): PhiMoE, whose compiled
# failure (its router replaced by a packed linear) is the kind of defect the next test
# checks on every family without compiling.
COMPILED_FAMILIES = ["gemma2", "gpt-oss", "deepseek-v2"]


@pytest.fixture(scope="module")
def families() -> dict[str, Path]:
    return {}


@pytest.mark.parametrize("family_id", COMPILED_FAMILIES)
def test_family_compiled_matches_transformers(
    family_id: str, families: dict[str, Path], tiny_model_dir: Path
) -> None:
    model_dir = _model_dir(families, BY_ID[family_id], tiny_model_dir)
    expected = _reference(model_dir)
    engine = LLMEngine(family_config(model_dir, max_num_batched_tokens=32, compile=True))
    assert engine.runner.compiled and engine.compile_seconds > 0
    assert _generate(engine) == expected


@pytest.mark.parametrize("family", SERVED, ids=[f.id for f in SERVED])
def test_family_with_the_compiled_layout_matches_transformers(
    family: Family, families: dict[str, Path], tiny_model_dir: Path
) -> None:
    """Every served family with the compiled path's model surgery (engine/cpu_linear.py:
    linears packed for oneDNN or laid out input-major, what ``compiled.prepare`` does
    before ``torch.compile``), run eagerly: a replaced layer that no longer returns what
    the model's code expects (PhiMoE's router) or computes differently shows here for
    the whole table, at an eager engine's cost instead of a compile's."""
    model_dir = _model_dir(families, family, tiny_model_dir)
    expected = _reference(model_dir)
    engine = LLMEngine(family_config(model_dir, max_num_batched_tokens=32))
    counts = cpu_linear.prepare(engine.runner.model)
    assert counts["onednn"] + counts["blas_input_major"] > 0, counts  # something relaid
    assert _generate(engine) == expected
