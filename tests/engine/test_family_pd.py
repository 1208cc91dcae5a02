"""Every served family of tests/model_families.py through a real prefill -> NIXL ->
decode hand-off, token-identical to transformers' greedy tokens.

One process per family pair, no worker processes: a prefill engine and a decode engine
on one loaded model, each with its own KV pool, joined by the workers' own transfer
classes (``KVServer`` holding the prompts' blocks under leases, ``RemoteKVConnector``
reading them over NIXL/UCX; pdserve/testing/pd_pair.py). The matrix's prompts (45, 24
and 5 tokens: past the 8-token windows, across 16-token blocks, one shorter than a
window) are prefilled together in 32-token chunks, handed off, and decoded together, so
every decode step mixes context lengths. The decode engine never recomputes a prompt: it
runs decodes only, on KV it did not compute, and reads every handed-off block's bytes
(MLA's compressed latent for DeepSeek). Both pools are free at the end.

tests/workers/test_family_handoff.py runs the same hand-off through real worker
processes and HTTP for one family (the plumbing around it); this file covers the
families. ``test_handoff_bytes_matter`` shows the comparison can fail: the latent's rope
part zeroed on the prefill side after the prefill, the decode tokens differ.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from engine_helpers import assert_all_free, family_config
from family_matrix import MAX_TOKENS, PROMPTS, Served, reference

from pdserve.testing.pd_pair import PDPair
from tests.model_families import BY_ID, Family

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]


def _pair(model_dir: Path) -> PDPair:
    return PDPair(family_config(model_dir, max_num_batched_tokens=32), transport="nixl")


def test_family_through_nixl_handoff(served: Served) -> None:
    with _pair(served.model_dir) as pair:
        assert pair.server.transport_name == pair.connector.inner.transport_name == "nixl"
        # One model, two pools.
        assert pair.decode.runner.model is pair.prefill.runner.model
        assert pair.decode.kv_tensor.data_ptr() != pair.prefill.kv_tensor.data_ptr()
        done = pair.run(PROMPTS, MAX_TOKENS)
        assert done.tokens == served.expected
        # Decodes only on the decode side: every prompt's KV came over the transfer.
        assert set(done.decode_chunks) == {1}, done.decode_chunks
        assert len(done.decode_chunks) == len(PROMPTS) * (MAX_TOKENS - 1)
        per_block = pair.decode.runner.kv_shape.bytes_per_block
        assert done.bytes_read == done.blocks * per_block > 0
        assert_all_free(pair.prefill)
        assert_all_free(pair.decode)


def test_handoff_bytes_matter(family_dir: Callable[[Family], Path]) -> None:
    """The hand-off's bytes decide the tokens: zero the rope part of DeepSeek-V3's latent
    in the prefill pool after the prefill (the transfer then carries zeros there) and the
    decode engine's tokens are no longer transformers'."""
    model_dir = family_dir(BY_ID["deepseek-v3"])
    expected = reference(model_dir)
    with _pair(model_dir) as pair:
        latent = pair.prefill.runner.latent
        assert latent is not None
        pool = pair.prefill.kv_tensor
        hold = pair.prefill.kv.holder.hold

        def zero_rope_then_hold(rid: str, block_ids: list[int], *rest: object) -> object:
            pool[:, :, block_ids, :, :, latent.kv_lora_rank :] = 0
            return hold(rid, block_ids, *rest)  # type: ignore[arg-type]

        pair.prefill.kv.holder.hold = zero_rope_then_hold  # type: ignore[method-assign]
        done = pair.run(PROMPTS, MAX_TOKENS)
        assert [t[0] for t in done.tokens] == [e[0] for e in expected]  # prefill's own
        assert done.tokens != expected
        assert_all_free(pair.prefill)
        assert_all_free(pair.decode)
