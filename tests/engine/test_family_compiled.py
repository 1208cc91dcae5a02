"""Every served family of tests/model_families.py on the compiled forward
(``torch.compile``, what workers serve with), token-identical to transformers: the suite
otherwise runs eager (tests/conftest.py sets PDSERVE_ENFORCE_EAGER=1; ``compile=True``
here turns it off on purpose).

One compile per family, shared by its cases: the engine compiles its three graph
variants at construction (engine/compiled.py: a prompt chunk, one decode, batched decodes
and chunks), then serves the matrix's prompts at once (45, 24 and 5 tokens: past the
8-token windows, one shorter than a window, mixed lengths in each step, the long ones
split into chunks by a 32-token step budget) on those variants, with no new graph.
The same compiled runner then serves the P/D hand-off (pdserve/testing/pd_pair.py): the
compiled engine prefills and holds the prompts' blocks in a real ``KVServer``, a decode
engine on the same compiled forward (``ModelRunner.unbound``, its own pool) reads them
over NIXL and decodes, token-identical to transformers, no new graph, both pools free
(tests/engine/test_family_pd.py runs the same hand-off eager).

Cost (docs/testing.md, "The compiled family matrix"): inductor's generated code is
cached per machine (``PDSERVE_COMPILE_CACHE``, keyed by the CPU: engine/host_tag.py, and
by inductor on the graph, its inputs and torch's version), so after the machine's first
run a family's compile is dynamo's trace of the tiny model plus loading its kernels.
The first run on a machine builds every family's C++ kernels once.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from engine_helpers import assert_all_free, family_config
from family_matrix import MAX_TOKENS, PROMPTS, SERVED, Served, generate

from pdserve.engine.llm_engine import LLMEngine
from pdserve.testing.pd_pair import PDPair

pytestmark = [pytest.mark.unit, pytest.mark.timeout(600)]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each family's graphs are dropped after its test: 25 models' compiled code would
    otherwise stay alive in this process (and count against one recompile limit)."""
    yield
    torch._dynamo.reset()


# One xdist group a family (tests/xdist_plan.py): the families share no fixture worth a
# worker (their models are cached on disk), so make test spreads them over both workers
# instead of queueing ~4 CPU-min on one. Their cache keys do not depend on which families
# a worker compiled before (engine/cpu_linear.py's handles). The marks ride on the
# conftest's `served` fixture, parametrized here (indirect) for this file only.
@pytest.mark.parametrize(
    "served",
    [
        pytest.param(f, id=f.id, marks=pytest.mark.xdist_group(f"family-compiled-{f.id}"))
        for f in SERVED
    ],
    indirect=True,
)
def test_family_compiled_matches_transformers(served: Served) -> None:
    from torch._dynamo.utils import counters

    engine = LLMEngine(family_config(served.model_dir, max_num_batched_tokens=32, compile=True))
    # Compiled, not the eager fallback a failed compile leaves (compile_job.warm_up).
    assert engine.runner.compiled and engine.compile_seconds > 0
    graphs = counters["stats"]["unique_graphs"]
    assert generate(engine) == served.expected
    # Served on the variants the warm-up compiled, as a worker serves: no new graph.
    assert counters["stats"]["unique_graphs"] == graphs
    assert_all_free(engine)
    # The P/D hand-off on the same compiled runner: prefill here -> NIXL -> decode.
    with PDPair(engine.config, transport="nixl", prefill=engine) as pair:
        assert pair.decode.runner.compiled
        done = pair.run(PROMPTS, MAX_TOKENS)
        assert done.tokens == served.expected
        assert set(done.decode_chunks) == {1}, done.decode_chunks  # KV came over NIXL
        assert done.bytes_read == done.blocks * pair.decode.runner.kv_shape.bytes_per_block > 0
        assert counters["stats"]["unique_graphs"] == graphs
        assert_all_free(pair.prefill)
        assert_all_free(pair.decode)
