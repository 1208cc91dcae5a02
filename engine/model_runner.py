"""Loads a transformers model and runs one flattened step over the paged pool.

All scheduled tokens of a step — prefill chunks and decodes — run as one
sequence of length T through the model's own forward; ``position_ids`` carry
each token's position in its request and the paged attention function keeps
requests apart. Only the rows that are sampled get logits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pdserve.engine.attention import (
    ATTN_IMPLEMENTATION,
    CURRENT,
    AttentionMetadata,
    PrefillChunk,
)
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_pool import KVPool, KVShape
from pdserve.engine.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``start .. start + num_tokens`` of one request, computed in one step."""

    request: Request
    num_tokens: int
    start: int
    samples: bool  # the chunk reaches the request's last token: its logits are sampled

    @classmethod
    def of(cls, request: Request, num_tokens: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return cls(request, num_tokens, start, start + num_tokens == request.num_tokens)


def model_identity(model_dir: str | Path) -> str:
    """A short fingerprint of config and weights; peers must agree on it."""
    path = Path(model_dir)
    h = hashlib.sha256((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        h.update(weights.name.encode())
        h.update(str(weights.stat().st_size).encode())
        with open(weights, "rb") as f:
            h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        model = AutoModelForCausalLM.from_pretrained(
            config.model,
            dtype=self.dtype,
            attn_implementation=ATTN_IMPLEMENTATION,
            local_files_only=True,
        )
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        hf = self.model.config
        self.hf_config = hf
        self.num_layers: int = hf.num_hidden_layers
        self.num_kv_heads: int = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim: int = (
            getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        )
        self.max_position_embeddings: int = hf.max_position_embeddings
        self.pool: KVPool | None = None

    @property
    def kv_shape(self) -> KVShape:
        return KVShape(
            self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype
        )

    def bind_pool(self, pool: KVPool) -> None:
        self.pool = pool

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run one step; returns float32 logits of the sampled chunks, in order."""
        assert self.pool is not None and chunks
        input_ids, positions, slots, sample_rows = self._flatten(chunks)
        CURRENT.pool = self.pool
        CURRENT.meta = self._metadata(chunks, slots)
        try:
            out = self.model(
                input_ids=input_ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
                logits_to_keep=sample_rows,
            )
        finally:
            CURRENT.pool = CURRENT.meta = None
        return out.logits[0].float()

    def _flatten(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        bs = self.block_size
        for c in chunks:
            req, start = c.request, c.start
            tokens = req.all_token_ids
            for p in range(start, start + c.num_tokens):
                ids.append(tokens[p])
                pos.append(p)
                slots.append(req.block_ids[p // bs] * bs + p % bs)
            if c.samples:
                rows.append(len(ids) - 1)
        dev = self.device
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            torch.tensor(slots, dtype=torch.long, device=dev),
            torch.tensor(rows, dtype=torch.long, device=dev),
        )

    def _metadata(self, chunks: list[ScheduledChunk], slots: torch.Tensor) -> AttentionMetadata:
        bs, dev = self.block_size, self.device
        offs = torch.arange(bs, device=dev)
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        row = 0
        for c in chunks:
            req, start, n = c.request, c.start, c.num_tokens
            ctx = start + n
            nblocks = -(-ctx // bs)
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(req.block_ids[:nblocks])
                decode_lens.append(ctx)
            else:
                table = torch.tensor(req.block_ids[:nblocks], dtype=torch.long, device=dev)
                ctx_slots = (table[:, None] * bs + offs).flatten()[:ctx]
                mask = None
                if start > 0:
                    q_pos = torch.arange(start, ctx, device=dev)[:, None]
                    mask = torch.arange(ctx, device=dev)[None, :] <= q_pos
                prefills.append(PrefillChunk(row, n, ctx_slots, mask))
            row += n
        meta = AttentionMetadata(slots, None, None, None, prefills)
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            table = torch.tensor(padded, dtype=torch.long, device=dev)
            meta.decode_slots = (table[:, :, None] * bs + offs).flatten(1)
            lens = torch.tensor(decode_lens, dtype=torch.long, device=dev)
            mask = torch.arange(width * bs, device=dev)[None, :] < lens[:, None]
            meta.decode_mask = mask[:, None, None, :]
            meta.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=dev)
        return meta
