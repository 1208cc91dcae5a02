"""What a bench on loopback sets up first: the tiny model, and the service secret that the
services it starts share with it (their internal calls are signed)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from pdserve.env import SERVICE_SECRET

ROOT = Path(__file__).resolve().parents[2]  # the checkout: bench/lib/ -> root


def tiny_model(preset: str = "tiny") -> Path:
    """The ``preset`` random model (seed 0), written once under the checkout's .cache."""
    from pdserve.engine.tiny_model import write_tiny_model

    return write_tiny_model(ROOT / ".cache" / "models" / f"{preset}-seed0", preset)


def secret_env() -> dict[str, str]:
    """This process's service secret (the caller's, or one made now and kept in its
    environment), and a copy of the environment that carries it, for the children."""
    os.environ.setdefault(SERVICE_SECRET, secrets.token_hex(16))
    return dict(os.environ)
