"""The LoRA adapters the router serves, by the name a request gives as its ``model``.

An adapter comes from ``--lora NAME=PATH`` (its hash computed here from the files: the
router mounts the same directories as the workers) or from ``POST /v1/load_lora_adapter``
(the hash the workers answered). The hash travels with every request (``LoraRef``) and
seeds the router's block hashes as the workers seed theirs (hashing.salt_root's
``extra_key``), so the prefix index matches the workers' keyed caches; a worker whose
adapter of that name has other files refuses the request (``lora_mismatch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.engine.lora_files import LoraError, adapter_hash
from pdserve.protocol.contract import LoraRef, valid_lora_hash, valid_lora_name


@dataclass(frozen=True)
class Adapter:
    name: str
    hash: str
    path: str  # where the workers load it from


def parse_lora(value: str) -> tuple[str, str]:
    """``--lora NAME=PATH`` → (name, path); ValueError naming what is wrong."""
    name, sep, path = value.partition("=")
    if not sep or not path:
        raise ValueError(f"--lora {value!r}: expected NAME=PATH")
    if not valid_lora_name(name) or "=" in name:
        raise ValueError(f"--lora {value!r}: the name must be printable, 1 to 256 characters")
    return name, path


def declared(pairs: Sequence[tuple[str, str]], base_names: Sequence[str]) -> list[Adapter]:
    """The adapters of ``--lora``: each directory hashed (ValueError when unreadable, a
    name given twice, or a name that is the base model's)."""
    out: dict[str, Adapter] = {}
    for name, path in pairs:
        if name in out:
            raise ValueError(f"--lora {name}: the name is given twice")
        if name in base_names:
            raise ValueError(f"--lora {name}: the name is the base model's")
        try:
            digest = adapter_hash(path)
        except OSError as exc:
            raise ValueError(f"--lora {name}={path}: cannot read the adapter: {exc}") from exc
        out[name] = Adapter(name, digest, path)
    return list(out.values())


class AdapterTable:
    """Name → adapter. Read on every request (``ref``), changed by the admin endpoints."""

    def __init__(self, adapters: Sequence[Adapter] = ()) -> None:
        self._by_name = {a.name: a for a in adapters}

    def __len__(self) -> int:
        return len(self._by_name)

    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def adapters(self) -> list[Adapter]:
        return list(self._by_name.values())

    def get(self, name: str) -> Adapter | None:
        return self._by_name.get(name)

    def ref(self, model: str) -> LoraRef | None:
        """The adapter a request's ``model`` names (None: the base model, or unknown)."""
        a = self._by_name.get(model)
        return LoraRef(a.name, a.hash) if a is not None else None

    def add(self, adapter: Adapter) -> None:
        if not valid_lora_hash(adapter.hash):
            raise LoraError(f"adapter {adapter.name!r}: the workers answered a bad hash")
        self._by_name[adapter.name] = adapter

    def remove(self, name: str) -> bool:
        return self._by_name.pop(name, None) is not None

    def cards(self, base: str, created: int) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the adapters (vLLM's shape; no path: the operator's)."""
        cards = []
        for a in self._by_name.values():
            cards.append(
                {
                    "id": a.name,
                    "object": "model",
                    "created": created,
                    "owned_by": "pdserve",
                    "root": a.name,
                    "parent": base,
                }
            )
        return cards
