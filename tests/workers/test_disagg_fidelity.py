"""Must show 1 of issue 3: disaggregated greedy outputs equal the single-process engine,
with the KV really moved by the transport (bytes counted by the decode worker)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest
from worker_helpers import assert_all_free, handoff, metric, proc, worker_cluster

from pdserve.protocol.sampling_params import SamplingParams

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def workload(n: int = 50, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(4, 3000) for _ in range(rng.randint(1, 200))], rng.randint(1, 16))
        for _ in range(n)
    ]


@pytest.mark.parametrize("transport", ["nixl", "tcp"])
def test_disaggregated_outputs_match_single_process(
    tiny_model_dir: Path, tmp_path: Path, reference, transport: str
) -> None:
    work = workload()
    expected = reference.generate(
        [p for p, _ in work],
        [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work],
    )
    assert reference.kv.all_free

    with worker_cluster(tiny_model_dir, tmp_path, transport) as cluster:
        p_url, d_url = proc(cluster, "prefill").url, proc(cluster, "decode").url
        bytes_per_token_block = None
        handed_off_blocks = 0

        async def one(client: httpx.AsyncClient, i: int) -> list[int]:
            nonlocal handed_off_blocks
            tokens, blocks = await handoff(client, p_url, d_url, f"fid-{i}", *work[i])
            handed_off_blocks += blocks
            return tokens

        async def run() -> list[list[int]]:
            sem = asyncio.Semaphore(8)
            async with httpx.AsyncClient() as client:

                async def limited(i: int) -> list[int]:
                    async with sem:
                        return await one(client, i)

                return await asyncio.gather(*(limited(i) for i in range(len(work))))

        got = asyncio.run(run())
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g == e, f"prompt {i} (len {len(work[i][0])}): {g} != {e}"

        shape = reference.runner.kv_shape
        bytes_per_token_block = shape.bytes_per_block
        moved = metric(d_url, "pdserve_kv_transfer_bytes_total", transport=transport)
        assert handed_off_blocks > 0
        assert moved == handed_off_blocks * bytes_per_token_block
        assert_all_free(p_url, d_url)
