"""A KV load's phases (transfer/load_state.py): the lives a load can have are walked edge by
edge, every other step raises, terminal phases go nowhere, and the lease is ours exactly
between the granted claim and the peer's answer to our done."""

from __future__ import annotations

import pytest

from pdserve.transfer.load_state import (
    LEASE_HELD,
    NEXT,
    IllegalTransition,
    LoadPhase,
    LoadRecord,
)
from pdserve.transfer.messages import KVHandle

pytestmark = pytest.mark.unit

P = LoadPhase


def _record() -> LoadRecord:
    handle = KVHandle(
        request_id="r",
        agent_name="a",
        side_channel="tcp://127.0.0.1:1",
        block_ids=[3],
        num_tokens=5,
        block_hashes=[],
        block_size=16,
        nonce="n",
        lease_ttl_s=30.0,
    )
    return LoadRecord("r", handle, [3], [0], deadline=0.0)


LIVES = [
    [P.HANDSHAKING, P.CLAIMING, P.CLAIMED, P.TRANSFERRING, P.CONFIRMING, P.DONE],
    [P.CLAIMING, P.CLAIMED, P.TRANSFERRING, P.CONFIRMING, P.DONE],  # peer known already
    [P.HANDSHAKING, P.HANDSHAKING, P.CLAIMING, P.FAILED],  # peer restarted: asked again
    [P.HANDSHAKING, P.ABORTED],  # cancelled before the claim
    [P.HANDSHAKING, P.CLAIMING, P.CLAIMED, P.ABORTED],  # cancelled while claiming
    [P.CLAIMING, P.CLAIMED, P.TRANSFERRING, P.ABORTED],  # cancelled mid-read, stopped
    [P.CLAIMING, P.CLAIMED, P.TRANSFERRING, P.STOPPING, P.FAILED],  # quarantined, lifted
    [P.CLAIMING, P.CLAIMED, P.TRANSFERRING, P.CONFIRMING, P.FAILED],  # lease broke
    [P.FAILED],  # the peer's geometry refused
]


@pytest.mark.parametrize("life", LIVES, ids=lambda life: "-".join(p.value for p in life))
def test_each_life_is_legal_and_holds_the_lease_only_between_claim_and_answer(
    life: list[LoadPhase],
) -> None:
    load = _record()
    assert load.phase is P.QUEUED and not load.holds_lease
    for phase in life:
        load.advance(phase)
        assert load.phase is phase
        assert load.holds_lease == (phase in (P.CLAIMED, P.TRANSFERRING, P.CONFIRMING))
    assert life[-1].terminal
    for phase in P:
        with pytest.raises(IllegalTransition, match=f"{life[-1].value} -> {phase.value}"):
            load.advance(phase)  # nothing follows an end


def test_every_step_not_in_the_table_raises() -> None:
    for start in P:
        for to in P:
            load = _record()
            load.phase = start
            if to in NEXT[start]:
                load.advance(to)
                assert load.phase is to
            else:
                with pytest.raises(IllegalTransition):
                    load.advance(to)
                assert load.phase is start  # a refused step changes nothing


def test_the_table_is_closed() -> None:
    """Every phase is reachable from QUEUED, and every live phase can fail."""
    seen, frontier = {P.QUEUED}, [P.QUEUED]
    while frontier:
        for to in NEXT[frontier.pop()]:
            if to not in seen:
                seen.add(to)
                frontier.append(to)
    assert seen == set(P)
    assert all(P.FAILED in NEXT[p] for p in P if not p.terminal)
    assert {P.CLAIMED, P.TRANSFERRING, P.CONFIRMING} == LEASE_HELD
    assert {p for p in P if p.terminal} == {P.DONE, P.FAILED, P.ABORTED}
