"""Signed calls between the router and the workers: the service secret never travels.

Each call carries ``X-PDServe-Auth: v2 <unix time> <nonce> <hex tag>``, the tag an HMAC
(the ``http`` key, pdserve/keys.py) over the method, the path with its query, the
``Host`` the call is sent to (the worker it names), the time, the nonce and the SHA-256
of the body. A worker answers 401 to a call whose tag does not check under any of its
keys, whose time is more than ``WINDOW_S`` away from its clock, whose nonce it has seen
within the window (a replay), or whose ``Host`` does not name it (worker/own_address.py:
a call captured on its way to one worker is refused by every other). Its reply carries
``X-PDServe-Proof``, an HMAC over the call's tag: the caller believes only a worker that
proves the secret, so an address from a poisoned discovery learns nothing and is sent
nothing it could use (the tag is bound to that one call and expires).

What it does not do: encrypt, or sign the reply's body (a streamed reply is read as it
comes). Someone who can alter packets on the pod network needs a mesh with mTLS
(docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections import OrderedDict
from dataclasses import dataclass

from pdserve import keys

HEADER = "X-PDServe-Auth"
PROOF_HEADER = "X-PDServe-Proof"
HEADER_KEY = HEADER.lower().encode()  # as ASGI scopes carry header names
PROOF_KEY = PROOF_HEADER.lower().encode()
VERSION = "v2"  # v2: the tag covers the Host (v1 did not; refused)
WINDOW_S = 30.0  # clocks of the router's and the workers' nodes agree to well within this
MAX_NONCES = 1_000_000  # the replay cache's bound (older entries go first)
_EMPTY_SHA = hashlib.sha256(b"").digest()
_REPLY = ("reply",)  # a proof's label


def _tag(
    key: bytes, method: str, target: str, host: str, ts: str, nonce: str, body_sha: bytes
) -> bytes:
    head = (VERSION, method, target)
    return keys.mac_after(key, head, host.encode(), ts.encode(), nonce.encode(), body_sha)


def sign(
    ring: keys.KeyRing,
    method: str,
    target: str,
    body: bytes = b"",
    now: float | None = None,
    host: str = "",
) -> str:
    """The ``X-PDServe-Auth`` value for one call (``target``: the path and query; ``host``:
    the ``Host`` header it is sent with, which names the worker)."""
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = os.urandom(12).hex()
    sha = hashlib.sha256(body).digest() if body else _EMPTY_SHA
    tag = _tag(ring.signing, method, target, host, ts, nonce, sha)
    return f"{VERSION} {ts} {nonce} {tag.hex()}"


def proof(key: bytes, auth: str) -> str:
    """A worker's answer to the call signed ``auth``: proves it holds the key."""
    return keys.mac_after(key, _REPLY, auth.encode()).hex()


def proof_ok(ring: keys.KeyRing, auth: str, given: str | None) -> bool:
    """Whether a reply's ``X-PDServe-Proof`` answers the call signed ``auth``."""
    if not ring:
        return True
    if not given or not _hex(given):
        return False
    return ring.verify(bytes.fromhex(given), auth.encode(), head=_REPLY) is not None


def _hex(text: str) -> bool:
    """A 32-byte tag in hex."""
    if len(text) != 64:
        return False
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Verdict:
    key: bytes | None  # the key that made the tag (None: refused)
    reason: str = ""  # why it was refused


class Verifier:
    """A worker's check of incoming calls, with its replay cache (one per process)."""

    def __init__(self, ring: keys.KeyRing, window_s: float = WINDOW_S) -> None:
        self.ring, self.window_s = ring, window_s
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it expires

    def check(
        self,
        method: str,
        target: str,
        auth: str | None,
        body: bytes,
        now: float | None = None,
        host: str = "",
    ) -> Verdict:
        if not self.ring:
            return Verdict(b"")  # no secret configured: open (the worker warned at start)
        now = time.time() if now is None else now
        why = self.precheck(auth, now)
        if why:
            return Verdict(None, why)
        _, ts, nonce, tag = (auth or "").split(" ")
        sha = hashlib.sha256(body).digest() if body else _EMPTY_SHA
        given = bytes.fromhex(tag)
        key = next(
            (
                k
                for k in self.ring.keys
                if hmac.compare_digest(given, _tag(k, method, target, host, ts, nonce, sha))
            ),
            None,
        )
        if key is None:
            return Verdict(
                None, "bad signature (not the service secret, an altered call or another Host)"
            )
        if not self._first_use(nonce, now):
            return Verdict(None, "replayed call (nonce seen within the window)")
        return Verdict(key)

    def precheck(self, auth: str | None, now: float | None = None) -> str:
        """What the header alone tells, before a byte of the body is read: "" or why the
        call is refused (missing, malformed, outside the time window, a nonce seen)."""
        parts = (auth or "").split(" ")
        if len(parts) != 4 or parts[0] != VERSION or not _hex(parts[3]):
            return f"missing or malformed {HEADER}"
        now = time.time() if now is None else now
        try:
            skew = abs(now - float(parts[1]))
        except ValueError:
            return f"malformed {HEADER} time"
        if not skew <= self.window_s:
            return f"{HEADER} time is {skew:.0f}s off (window {self.window_s:g}s)"
        if parts[2] in self._seen and self._seen[parts[2]] > now:
            return "replayed call (nonce seen within the window)"
        return ""

    def _first_use(self, nonce: str, now: float) -> bool:
        seen = self._seen
        while seen and (next(iter(seen.values())) < now or len(seen) >= MAX_NONCES):
            seen.popitem(last=False)
        if nonce in seen:
            return False
        seen[nonce] = now + 2 * self.window_s  # past this its time is outside the window
        return True
