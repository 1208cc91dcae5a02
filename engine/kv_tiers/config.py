"""The tiers' configuration: one frozen dataclass, its flags, and the factory.

Importing this module loads no torch (a worker's front end parses the flags). Tiers are
named by the same strings everywhere (flags, KV events, metrics, the CRD): ``host``,
``disk``, ``shared``. Reads try them in that order (fastest first); an evicted block is
written to every configured tier (they are inclusive: the host tier's LRU can drop a block
the disk tier still has).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pdserve import env
from pdserve.config_cli import flag_group

TIER_NAMES = ("host", "disk", "shared")
SHARED_PASSWORD_ENV = env.KV_SHARED_PASSWORD  # the shared store's password (a Secret)


@dataclass(frozen=True)
class TierConfig:
    host_bytes: int = 0  # host-memory tier size; 0: no host tier
    host_compress: bool = False  # zlib level 1 in the host tier
    disk_path: str | None = None  # local-disk tier directory; None: no disk tier
    disk_bytes: int = 8 << 30  # local-disk tier size
    shared_url: str | None = None  # redis://host:port/db of the shared store; None: none
    shared_ttl_s: int | None = None  # expiry of shared entries (the server's LRU bounds it too)
    load_timeout_s: float = 1.0  # a tier load slower than this is cut off: recompute the rest
    write_queue_blocks: int = 256  # evicted blocks waiting to be written; beyond: dropped

    def __post_init__(self) -> None:
        if self.host_bytes < 0:
            raise ValueError(f"kv_tier_host_bytes must be >= 0, got {self.host_bytes}")
        if self.disk_path is not None and self.disk_bytes <= 0:
            raise ValueError(f"kv_tier_disk_bytes must be positive, got {self.disk_bytes}")
        if self.load_timeout_s <= 0:
            raise ValueError(f"kv_tier_load_timeout must be positive, got {self.load_timeout_s}")
        if self.write_queue_blocks < 1:
            raise ValueError("kv_tier_write_queue_blocks must be >= 1")
        if self.shared_url is not None and not self.shared_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError(f"kv_tier_shared_url must be a redis:// URL, got {self.shared_url!r}")

    @property
    def enabled(self) -> list[str]:
        """The configured tiers, in read order."""
        on = (self.host_bytes > 0, self.disk_path is not None, self.shared_url is not None)
        return [name for name, yes in zip(TIER_NAMES, on, strict=True) if yes]


flag_tiers = flag_group("KV tiers (docs/kv_tiers.md)")


@dataclass(frozen=True)
class TierArgs:
    """The KV tiers below the pool: each is off until its flag sizes or names it."""

    kv_tier_host_bytes: int = flag_tiers(
        0, "bytes of host RAM for KV blocks evicted from the pool (0: off)"
    )
    kv_tier_host_compress: bool = flag_tiers(False, "zlib-compress blocks in the host tier")
    kv_tier_disk_path: str | None = flag_tiers(
        None, "directory of the local-disk KV tier (off without it)"
    )
    kv_tier_disk_bytes: int = flag_tiers(8 << 30, "size bound of the local-disk KV tier")
    kv_tier_shared_url: str | None = flag_tiers(
        None,
        f"redis://HOST:PORT/DB of the shared KV store (password: ${SHARED_PASSWORD_ENV})",
    )
    kv_tier_shared_ttl: int | None = flag_tiers(
        None,
        "seconds a block stays in the shared store (default: until the server evicts it)",
    )
    kv_tier_load_timeout: float = flag_tiers(
        1.0, "seconds a tier load may take; the rest of the prefix is recomputed"
    )
    kv_tier_write_queue_blocks: int = flag_tiers(
        256, "evicted blocks queued for writing; more are dropped, not waited for"
    )


def tier_config_from_args(args: Any) -> TierConfig | None:
    cfg = TierConfig(
        host_bytes=getattr(args, "kv_tier_host_bytes", 0),
        host_compress=getattr(args, "kv_tier_host_compress", False),
        disk_path=getattr(args, "kv_tier_disk_path", None),
        disk_bytes=getattr(args, "kv_tier_disk_bytes", 8 << 30),
        shared_url=getattr(args, "kv_tier_shared_url", None),
        shared_ttl_s=getattr(args, "kv_tier_shared_ttl", None),
        load_timeout_s=getattr(args, "kv_tier_load_timeout", 1.0),
        write_queue_blocks=getattr(args, "kv_tier_write_queue_blocks", 256),
    )
    return cfg if cfg.enabled else None


def make_tiers(cfg: TierConfig) -> list[Any]:
    """The configured tiers, in read order (imports each tier's module only when used)."""
    tiers: list[Any] = []
    if cfg.host_bytes > 0:
        from pdserve.engine.kv_tiers.host import HostTier

        tiers.append(HostTier(cfg.host_bytes, cfg.host_compress))
    if cfg.disk_path is not None:
        from pdserve.engine.kv_tiers.disk import DiskTier

        tiers.append(DiskTier(cfg.disk_path, cfg.disk_bytes))
    if cfg.shared_url is not None:
        from pdserve.engine.kv_tiers.redis_tier import RedisTier

        password = os.environ.get(SHARED_PASSWORD_ENV)
        tiers.append(RedisTier(cfg.shared_url, password, cfg.load_timeout_s, cfg.shared_ttl_s))
    return tiers
