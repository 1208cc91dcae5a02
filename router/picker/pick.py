"""One request's pick: body → decode endpoints (primary, then fallbacks) and the prefill
worker, with the router's own parsing, tokenizer, prefix index and scorers.

The picker holds a router :class:`~pdserve.router.runtime.Runtime` (discovery, the prefix
index fed by the workers' KV events, the dispatcher's planning) but serves no HTTP and
dispatches nothing: the gateway carries the request to the decode pod it names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.router import edge
from pdserve.router.api.serving import fit_context, prepare_body
from pdserve.router.api_keys import Caller
from pdserve.router.errors import APIError
from pdserve.router.picker.prefill_header import PREFILL_HEADER, SIGNATURE_HEADER, endpoint_of, sign
from pdserve.router.runtime import Runtime, Ticket
from pdserve.router.scheduling import disagg
from pdserve.router.scheduling.snapshot import Snapshot, WorkerView

log = logging.getLogger(__name__)
CHAT_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> chat


@dataclass
class Pick:
    """What the picker answers for one request, and what it holds until the response ends."""

    endpoints: list[str]  # decode endpoints, primary first (ip:port, as the gateway dials)
    urls: list[str]  # the same workers' URLs, for the router's own book-keeping
    set_headers: dict[str, str] = field(default_factory=dict)
    remove_headers: tuple[str, ...] = ()
    prompt_tokens: int = 0
    begun: str = ""  # the decode URL counted in flight ("" once released)
    ticket: Ticket | None = None  # the admission slot, held until the response ends


class Picker:
    def __init__(
        self, rt: Runtime, fallbacks: int = 2, target: Callable[[WorkerView], str] | None = None
    ) -> None:
        """``fallbacks``: endpoints after the primary (what a retry walks); ``target``: the
        ``ip:port`` the gateway dials for a decode worker (default: the worker's own)."""
        assert fallbacks >= 0
        self.rt = rt
        self.fallbacks = fallbacks
        self.target = target or (lambda w: endpoint_of(w.url))

    async def pick(
        self,
        path: str,
        headers: Mapping[str, str],
        body: bytes | None,
        subset: frozenset[str] | None = None,
    ) -> Pick:
        """Raises APIError: 400/413 for a bad body, 401 for a bad key, 429 past the key's
        limits, 503 with no worker. The router mode's gate applies here too: the key and
        its request bucket before the body is looked at, an admission slot (``--max-queue``,
        ``--max-concurrency-per-key``, fair across keys) before it is tokenized, held
        until the response ends, and the token bucket once the prompt is counted."""
        rt = self.rt
        caller, client = self._gate(headers)
        if rt.peers is not None:  # the key's request bucket and count at its owner
            await rt.take_request(client)
        try:
            if body is not None and len(body) > rt.cfg.max_body_bytes:
                raise APIError(413, f"request body is over {rt.cfg.max_body_bytes} bytes")
            ticket = rt.admission.try_now(client) or await rt.admit(client, caller.priority)
        except BaseException:
            rt.untake(client)
            raise
        try:
            pick = await self._pick(path, caller, client, body, subset)
        except BaseException:
            ticket.release()
            raise
        pick.ticket = ticket
        return pick

    def _gate(self, headers: Mapping[str, str]) -> tuple[Caller, str]:
        caller = self.rt.keys.caller(headers.get("authorization", ""))
        forwarded = headers.get("x-forwarded-for", "").split(",")[0].strip()
        client = "key:" + caller.key if caller.key else "addr:" + forwarded
        self.rt.limiter.take_request(client)
        return caller, client

    async def _pick(
        self,
        path: str,
        caller: Caller,
        client: str,
        body: bytes | None,
        subset: frozenset[str] | None,
    ) -> Pick:
        rt = self.rt
        snap = self._restrict(rt.discovery.snapshot(), subset)
        chat = CHAT_PATHS.get(path.split("?", 1)[0])
        if body is None or chat is None:  # no OpenAI body to read: load alone decides
            plan = rt.scheduler.plan([], snap)
            return self._answer(plan.decode, None, 0)
        req, ids = await rt.off_loop(_prepare, rt, body, chat)
        req = fit_context(rt, snap, req, len(ids))
        await rt.take_tokens(client, len(ids) + req.best_of * req.sampling.max_tokens)
        # An adapter's prefix is hashed under the adapter, as its workers store it.
        lora = rt.adapter_of(req.model)
        plan = rt.scheduler.plan(ids, snap, rt.cache_salt(caller.key, req.cache_salt), lora)
        prefill = plan.prefill[0] if plan.kind == disagg.REMOTE_PREFILL else None
        return self._answer(plan.decode, prefill, len(ids), body)

    def _restrict(self, snap: Snapshot, subset: frozenset[str] | None) -> Snapshot:
        if subset is None:
            return snap
        keep = [w for w in snap.workers if w.role != "decode" or self.target(w) in subset]
        if not any(w.role == "decode" and w.healthy for w in keep):
            raise APIError(503, "no endpoint of the proxy's subset is eligible", code="no_worker")
        return replace(snap, workers=tuple(keep))

    def _answer(
        self,
        decode: tuple[WorkerView, ...],
        prefill: WorkerView | None,
        n: int,
        body: bytes = b"",
    ) -> Pick:
        if not decode:
            raise APIError(503, "no worker is ready: no healthy decode worker", code="no_worker")
        chosen = decode[: 1 + self.fallbacks]
        pick = Pick([self.target(w) for w in chosen], [w.url for w in chosen], prompt_tokens=n)
        if prefill is not None:
            endpoint = endpoint_of(prefill.url)
            pick.set_headers = {PREFILL_HEADER: endpoint, SIGNATURE_HEADER: sign(endpoint, body)}
        else:  # a client's own value must not reach the decode pod's front
            pick.remove_headers = (PREFILL_HEADER, SIGNATURE_HEADER)
        self.rt.discovery.begin(pick.urls[0], n)
        pick.begun = pick.urls[0]
        return pick

    def served(self, pick: Pick, endpoint: str) -> None:
        """The proxy says ``endpoint`` answered: every endpoint listed before it failed
        (the proxy walked the list in order), so later picks leave them out until a
        health check passes again; the in-flight count moves to the one that served."""
        if not endpoint or endpoint not in pick.endpoints:
            return
        k = pick.endpoints.index(endpoint)
        for url in pick.urls[:k]:
            self.rt.discovery.mark_failed(url)
        if k and pick.begun:
            self.rt.discovery.end(pick.begun, pick.prompt_tokens)
            pick.begun = pick.urls[k]
            self.rt.discovery.begin(pick.begun, pick.prompt_tokens)

    def release(self, pick: Pick) -> None:
        if pick.begun:
            self.rt.discovery.end(pick.begun, pick.prompt_tokens)
            pick.begun = ""
        if pick.ticket is not None:
            pick.ticket.release()
            pick.ticket = None


def _prepare(rt: Runtime, body: bytes, chat: bool) -> tuple[Any, list[int]]:
    return prepare_body(rt, edge.parse_json(body), chat)
