"""API keys: who a caller is, its priority class, and whether it is an admin.

Tenant keys come from ``--api-key`` (or ``PDSERVE_API_KEY``) and ``--api-key-file``, one
key a line, optionally followed by ``priority=N`` (an integer, higher is admitted first
when the router's queue is full; default 0). ``#`` starts a comment line. The file is
re-read when its modification time or size changes (looked at most once a second), so a
key is added or revoked without a restart (a Kubernetes Secret volume updates the file in
place); a file that cannot be read, or holds no key, leaves the keys as they were.

Admin keys (``--admin-api-key`` / ``--admin-api-key-file``) open ``/workers`` and
``/metrics`` while tenant keys are on; a tenant key does not.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.router.errors import APIError
from pdserve.router.file_watch import WatchedFile

log = logging.getLogger(__name__)
CHECK_EVERY_S = 1.0


@dataclass(frozen=True)
class Caller:
    key: str  # "" when no keys are configured
    priority: int = 0
    admin: bool = False


OPEN = Caller("")  # every caller when no keys are configured


def parse_key_lines(text: str) -> dict[str, int]:
    """``KEY [priority=N]`` lines → key → priority; ValueError names a bad line."""
    keys: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        priority = 0
        for word in words[1:]:
            name, _, value = word.partition("=")
            if name != "priority" or not value.lstrip("-").isdigit() or len(value) > 6:
                raise ValueError(f"line {n}: expected KEY [priority=N], got {word!r}")
            priority = int(value)
        keys[words[0]] = priority
    return keys


def read_key_file(path: str) -> dict[str, int]:
    with open(path, encoding="utf-8") as f:
        keys = parse_key_lines(f.read())
    if not keys:
        raise ValueError(f"{path} holds no API key")
    return keys


class KeyFile:
    """A key file and its keys, re-read when it changes (checked at most once a second)."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.clock = path, clock
        self.keys: dict[str, int] = {}
        self._file = WatchedFile(path, read_key_file)
        self._checked = -1e18
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._checked < CHECK_EVERY_S:
            return
        self._checked = now
        first = self._file.stamp is None
        try:
            keys = self._file.changed()
        except (OSError, ValueError) as exc:
            if force:
                raise
            log.warning(
                "API key file %s not reloaded, keeping %d keys: %s", self.path, len(self.keys), exc
            )
            return
        if keys is None:
            return
        if not first:
            log.info("API key file %s reloaded: %d keys", self.path, len(keys))
        self.keys = keys


class KeyStore:
    def __init__(
        self,
        keys: tuple[str, ...] = (),
        key_file: str = "",
        admin_keys: tuple[str, ...] = (),
        admin_key_file: str = "",
    ) -> None:
        self._static = dict.fromkeys(keys, 0)
        self._file = KeyFile(key_file) if key_file else None
        self._admin_static = tuple(admin_keys)
        self._admin_file = KeyFile(admin_key_file) if admin_key_file else None

    @property
    def enabled(self) -> bool:
        return bool(self._static) or self._file is not None

    def tenant_keys(self) -> dict[str, int]:
        if self._file is None:
            return self._static
        self._file.refresh()
        return {**self._static, **self._file.keys}

    def admin_keys(self) -> tuple[str, ...]:
        if self._admin_file is None:
            return self._admin_static
        self._admin_file.refresh()
        return (*self._admin_static, *self._admin_file.keys)

    def caller(self, authorization: str) -> Caller:
        """The caller behind an ``Authorization`` header; 401 without a valid key."""
        if not self.enabled:
            return OPEN
        scheme, _, token = authorization.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        if not token:
            raise APIError(
                401, "missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key"
            )
        if _match(token, self.admin_keys()) is not None:
            return Caller(token, admin=True)
        keys = self.tenant_keys()
        found = _match(token, keys)
        if found is None:
            raise APIError(401, "incorrect API key", code="invalid_api_key")
        return Caller(found, keys[found])

    def require_admin(self, authorization: str) -> None:
        """With tenant keys on, only an admin key passes (401 without a key, 403 with a
        tenant's); with no keys configured the admin endpoints are open, as before."""
        caller = self.caller(authorization)
        if self.enabled and not caller.admin:
            raise APIError(
                403, "this endpoint needs an admin key (--admin-api-key)", code="admin_key_required"
            )

    def require_admin_key(self, authorization: str) -> None:
        """Routes that change state: an admin key always, with or without tenant keys
        (401 without a key, 403 with another; 403 when no admin key is configured)."""
        scheme, _, token = authorization.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        admins = self.admin_keys()
        if token and _match(token, admins) is not None:
            return
        if not admins:
            raise APIError(
                403,
                "this endpoint needs an admin key, and none is configured: "
                "start the router with --admin-api-key or --admin-api-key-file",
                code="admin_key_required",
            )
        if not token:
            raise APIError(
                401, "missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key"
            )
        raise APIError(
            403, "this endpoint needs an admin key (--admin-api-key)", code="admin_key_required"
        )


def _match(token: str, keys: object) -> str | None:
    """The configured key equal to ``token``, compared in constant time per key."""
    found = None
    for k in keys:  # type: ignore[attr-defined]
        if hmac.compare_digest(token.encode(), k.encode()):
            found = k
    return found
