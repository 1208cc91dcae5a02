"""Loads a transformers model and runs one flattened step over the paged pool.

All scheduled tokens of a step — prefill chunks and decodes — run as one
sequence of length T through the model's own forward; ``position_ids`` carry
each token's position in its request and the paged attention function keeps
requests apart. Only the rows that are sampled get logits.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from pdserve.engine import (
    attention_backends,
    attention_probe,
    compiled,
    cuda_graphs,
    graph_call,
    mla,
    model_seal,
    model_support,
)
from pdserve.engine.attention import (
    ATTN_IMPLEMENTATION,
    CURRENT,
    AttentionMetadata,
    DecodeGroup,
    KernelTokens,
    PrefillChunk,
)
from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_graphs import GraphRunner
from pdserve.engine.kv_pool import KVPool, KVShape
from pdserve.engine.lora_registry import LoraRegistry, lora_passes
from pdserve.engine.prompt_logprobs import PromptRows
from pdserve.engine.request import Request
from pdserve.engine.sched_output import ScheduledChunk

logger = logging.getLogger(__name__)

# A decode joins the current group while its context has at least this share of the
# group's longest context (in blocks): at most 1 - share of a group's slots are padding.
DECODE_GROUP_SHARE = 0.6
# On CPU, small groups keep each gather in cache until attention reads it back; one
# gather for a whole large batch goes to memory and back, which costs more than the
# calls saved. A GPU wants few, large calls.
DECODE_GROUP_ROWS = {"cpu": 8}
DECODE_GROUP_ROWS_DEFAULT = 256


def model_identity(model_dir: str | Path) -> str:
    """A short fingerprint of config and weights; peers must agree on it (a sealed load
    computes the same from the bytes it verified: model_seal.identity)."""
    path = Path(model_dir)
    heads = []
    for weights in sorted(path.glob("*.safetensors")):
        with open(weights, "rb") as f:
            heads.append((weights.name, weights.stat().st_size, f.read(model_seal.IDENTITY_HEAD)))
    return model_seal.identity((path / "config.json").read_bytes(), heads)


def load_weights(
    files: str, hf_config: Any, dtype: torch.dtype, sealed: model_seal.SealedModel | None
) -> Any:
    """The model: from the tensors a sealed load parsed from the bytes it verified (the
    class ``AutoModelForCausalLM`` maps the config to, given the state dict), else from
    ``files`` by path (a sealed model without safetensors weights: its private copy)."""
    state = sealed.take_weights() if sealed is not None else None
    if state:
        cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
        return cls.from_pretrained(
            None,
            config=hf_config,
            state_dict=state,
            dtype=dtype,
            attn_implementation=ATTN_IMPLEMENTATION,
        )
    return AutoModelForCausalLM.from_pretrained(
        files,
        config=hf_config,
        dtype=dtype,
        attn_implementation=ATTN_IMPLEMENTATION,
        local_files_only=True,
    )


class ModelRunner:
    attention_backend = attention_backends.GATHER  # set per model in __init__
    graphs: cuda_graphs.DecodeGraphs | None = None  # enable_cuda_graphs()
    latent: mla.LatentLayout | None = None  # MLA compressed (engine/mla.py)
    kv_planes = 2  # the pool's planes: K and V, or MLA's one latent
    direct_calls: graph_call.DirectCalls | None = None  # the compiled forward's graphs

    def __init__(self, config: EngineConfig) -> None:
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        # A shared cache: every file read once, checked against the service's seal and
        # loaded from the bytes that were hashed (engine/model_seal.py); else by path.
        sealed = model_seal.load(config.model)
        files = str(sealed.files) if sealed is not None else config.model
        hf_config = AutoConfig.from_pretrained(files, local_files_only=True)
        # Refused by name before the weights load: options the attention does not honour.
        self.layers = model_support.check_config(hf_config)
        self.architecture = model_support.architecture(hf_config)
        model = load_weights(files, hf_config, self.dtype, sealed)
        self.model_id = sealed.identity if sealed is not None else model_identity(config.model)
        model_support.check_model(model, self.layers)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        self._probe()
        # DeepSeek-V2/V3: MLA in its compressed form (engine/mla.py), before the compiled
        # path repacks the linears; None for every other model.
        self.latent = mla.compress(self.model)
        # The compiled forward (engine/compiled.py): in service now, or once compiled in
        # the background (compile_job.py); the eager one serves until then.
        # torch.compile's set-up imports inductor (~3 CPU-s on the 2-core dev machine):
        # a background compile does it on its own thread, off the way to "ready".
        self.compiled_fn = None
        self.compile_wanted = config.compile
        now = config.compile and not config.compile_in_background
        if config.compile:
            compiled.prepare(self.model)
            if now:
                self.compiled_fn = compiled.compiled_forward(self.model)
        self.forward = self.compiled_fn if now and self.compiled_fn is not None else self.model
        self.eager_only = ""  # why the compiled forward may no longer be swapped in
        hf = self.model.config
        self.hf_config = hf
        self.num_layers: int = hf.num_hidden_layers
        self.num_kv_heads: int = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        # Under MLA V is narrower than K; the pool stores it padded to K's size.
        self.head_dim: int = model_support.head_dims(hf)[0]
        if self.latent is not None:  # one latent head, key and value at once
            self.num_kv_heads, self.head_dim = 1, self.latent.head_dim
            self.kv_planes = 1
        self.max_position_embeddings: int = hf.max_position_embeddings
        self.pool: KVPool | None = None
        self.decode_group_rows = DECODE_GROUP_ROWS.get(self.device.type, DECODE_GROUP_ROWS_DEFAULT)
        self._gather_buffer: torch.Tensor | None = None
        # cpu (the C++ kernel), triton, or gather (the reference): by device or by
        # PDSERVE_ATTENTION_BACKEND (attention_backends.py).
        shape = attention_backends.AttentionShape(
            self.device,
            self.dtype,
            hf.num_attention_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
        )
        # A first start serves with the gather path while the compile thread builds the
        # kernel (compile_job.py): the build is a minute of one core on a small CPU.
        background = config.compile and config.compile_in_background
        self.kernel_pending = background and attention_backends.kernel_deferred(shape)
        pending = self.kernel_pending
        self.attention_backend = (
            attention_backends.GATHER if pending else (attention_backends.choose(shape))
        )
        self.use_kernel = self.attention_backend == attention_backends.CPU  # False: gather
        self.loras: LoraRegistry | None = None
        if config.lora is not None:  # adapters (engine/lora_registry.py)
            self.loras = LoraRegistry(self.model, config.lora, self.device, self.dtype)
            self.loras.on_first_wrap = self._lora_eager

    def _lora_eager(self) -> None:
        """The first adapter layer changed the model under the compiled forward and the
        CUDA graphs: both are dropped, the worker runs eager from now on (docs/lora.md)."""
        if self.compiled or self.graphs is not None:
            logger.warning("LoRA adapters loaded: the forward runs eager from now on")
        self.use_eager()
        self.eager_only = "LoRA adapters loaded"
        self.graphs = None

    def _probe(self) -> None:
        """One token through the model at load under attention_probe's attention and mask
        functions, which answer zeros and record what each layer's call passes and what
        its mask holds: the layers' options follow the model's code (not the config), and
        an option the engine does not honour refuses the start, before any pool exists."""
        self.layers = attention_probe.probe(self.model, self.layers, self.architecture, self.device)

    @property
    def compiled(self) -> bool:
        return self.forward is not self.model

    def ensure_compiled_fn(self) -> Callable[..., object]:
        """The compiled forward (``torch.compile``'s wrapper, made on first use)."""
        if self.compiled_fn is None:
            self.compiled_fn = compiled.compiled_forward(self.model)
        return self.compiled_fn

    def use_kernel_backend(self) -> None:
        """Attention runs the C++ kernel from the next step on (built meanwhile)."""
        self.attention_backend, self.use_kernel = attention_backends.CPU, True
        self.kernel_pending = False

    def use_eager(self) -> None:
        """Run the model's own forward from now on (a compile that failed)."""
        self.forward = self.model

    @property
    def kv_shape(self) -> KVShape:
        return KVShape(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            self.dtype,
            self.kv_planes,
        )

    def bind_pool(self, pool: KVPool) -> None:
        self.pool = pool

    def unbound(self) -> ModelRunner:
        """A runner on this one's model (the same module and weights) with no pool bound:
        another engine's, with a pool of its own (``LLMEngine.shadow``, an in-process
        prefill/decode pair: pdserve/testing/pd_pair.py)."""
        runner = copy.copy(self)
        runner.pool, runner._gather_buffer = None, None
        return runner

    def enable_cuda_graphs(
        self,
        runner: GraphRunner | None = None,
        buckets: Sequence[int] = cuda_graphs.DEFAULT_BUCKETS,
    ) -> None:
        """Decode steps replay CUDA graphs from now on (cuda_graphs.py); needs the Triton
        back-end and a bound pool. ``runner``: the tests' fake, else torch.cuda's."""
        assert self.pool is not None and self.attention_backend == attention_backends.TRITON
        max_blocks = -(-self.max_position_embeddings // self.block_size)
        step = cuda_graphs.model_step(self)
        graph_runner = runner or cuda_graphs.CudaGraphRunner()
        graphs = cuda_graphs.DecodeGraphs(step, max_blocks, self.device, graph_runner, buckets)
        with torch.inference_mode():
            graphs.capture()
        self.graphs = graphs

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run one step; returns float32 logits of the sampled chunks, in order."""
        assert self.pool is not None and chunks
        if self.loras is not None and any(c.request.lora is not None for c in chunks):
            return self._execute_lora(chunks)
        if self.graphs is not None and all(c.num_tokens == 1 and c.samples for c in chunks):
            batch = cuda_graphs.decode_batch(chunks, self.block_size)
            return self.graphs.run(batch, lambda _b: self._execute(chunks)).float()
        return self._execute(chunks)

    def _execute_lora(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """A step under adapters: one pass, unless it needs more adapters than slots."""
        assert self.loras is not None
        loras = self.loras
        passes = lora_passes([c.request.lora for c in chunks], loras.config.max_loras)
        if len(passes) == 1:
            return self._execute(chunks)
        # The pass whose adapters are resident first: one slot change per step, not one a pass.
        passes.sort(key=lambda m: loras.num_missing([chunks[i].request.lora for i in m]))
        first = np.cumsum([0] + [c.num_rows for c in chunks]).tolist()  # each chunk's rows
        out: torch.Tensor | None = None
        for members in passes:
            logits = self._execute([chunks[i] for i in members])
            if out is None:
                out = logits.new_empty((first[-1], logits.shape[-1]))
            rows = [r for i in members for r in range(first[i], first[i + 1])]
            out[torch.tensor(rows, dtype=torch.long, device=out.device)] = logits
        assert out is not None
        return out

    def _lora_begin(self, chunks: list[ScheduledChunk]) -> None:
        """Each token's adapter slot for the wrapped layers (0: the base model)."""
        if self.loras is None or all(c.request.lora is None for c in chunks):
            return
        slot_of = self.loras.slots_for([c.request.lora for c in chunks if c.request.lora])
        per_chunk = [0 if c.request.lora is None else slot_of[id(c.request.lora)] for c in chunks]
        counts = torch.tensor([c.num_tokens for c in chunks], dtype=torch.long)
        token_slots = torch.tensor(per_chunk, dtype=torch.long).repeat_interleave(counts)
        self.loras.step.begin(token_slots.to(self.device))

    def _execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        input_ids, positions, slots, sample_rows = self._flatten(chunks)
        self._lora_begin(chunks)
        CURRENT.pool = self.pool
        CURRENT.meta = self._metadata(chunks, slots)
        CURRENT.layers, CURRENT.architecture = self.layers, self.architecture
        num_sampled = sample_rows.numel()
        prompt = PromptRows.of(chunks)  # rows that score prompt tokens (echo, prompt_logprobs)
        if prompt.rows:
            rows = torch.tensor(prompt.rows, dtype=torch.long, device=self.device)
            sample_rows = torch.cat([sample_rows, rows])
        elif num_sampled == 0 and self.compiled:
            # A step of mid-prompt chunks samples nothing; one row of logits (dropped)
            # keeps it on a graph the warm-up compiled instead of a fourth variant.
            sample_rows = sample_rows.new_full((1,), input_ids.numel() - 1)
        try:
            logits = self._forward(input_ids.unsqueeze(0), positions.unsqueeze(0), sample_rows)
        finally:
            CURRENT.pool = CURRENT.meta = None
            CURRENT.layers = ()
            if self.loras is not None:
                self.loras.step.end()
        prompt.record(logits[0, num_sampled:])
        return logits[0, :num_sampled].float()

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """The forward's logits of ``rows``, [1, rows, vocab]; once the compiled forward
        serves, its proven graph variants are called directly (engine/graph_call.py)."""
        if self.compiled and compiled.serving() and graph_call.ENABLED:
            direct = self.direct_calls
            if direct is None or direct.forward is not self.forward:
                direct = self.direct_calls = graph_call.DirectCalls(self.forward)
            return direct.run(input_ids, positions, rows)
        out = self.forward(
            input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=rows
        )
        return out.logits

    def _flatten(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ids: list[int] = []
        pos: list[int] = []
        blocks: list[int] = []  # the block of each token
        rows: list[int] = []
        bs = self.block_size
        for c in chunks:
            req, start, end = c.request, c.start, c.start + c.num_tokens
            if c.num_tokens == 1:
                ids.append(_token_at(req, start))
                pos.append(start)
                blocks.append(req.block_ids[start // bs])
            else:
                ids.extend(_tokens(req, start, end - len(c.draft)))
                ids.extend(c.draft)
                pos.extend(range(start, end))
                first = start // bs
                table = np.asarray(req.block_ids[first : (end - 1) // bs + 1], dtype=np.int64)
                offset = start - first * bs
                blocks.extend(np.repeat(table, bs)[offset : offset + c.num_tokens].tolist())
            if c.samples:
                rows.extend(range(len(ids) - c.num_rows, len(ids)))
        dev = self.device
        positions = torch.tensor(pos, dtype=torch.long)
        slots = torch.tensor(blocks, dtype=torch.long) * bs + positions % bs
        return (
            torch.tensor(ids, dtype=torch.long).to(dev),
            positions.to(dev),
            slots.to(dev),
            torch.tensor(rows, dtype=torch.long).to(dev),
        )

    def _metadata(self, chunks: list[ScheduledChunk], slots: torch.Tensor) -> AttentionMetadata:
        if self.attention_backend == attention_backends.TRITON:
            spans = [(c.start, c.num_tokens, c.request.block_ids) for c in chunks]
            hq, hkv = self.hf_config.num_attention_heads, self.num_kv_heads
            triton = attention_backends.triton_metadata(
                spans, hq, hkv, self.block_size, self.device
            )
            return AttentionMetadata(slots, [], [], triton=triton)
        if self.use_kernel:
            return self._kernel_metadata(chunks, slots)
        bs, dev = self.block_size, self.device
        decodes: list[tuple[int, list[int], int]] = []  # (row, blocks, context length)
        prefills: list[PrefillChunk] = []
        row = 0
        for c in chunks:
            req, start, n = c.request, c.start, c.num_tokens
            ctx = start + n
            if n == 1:
                decodes.append((row, req.block_ids[: -(-ctx // bs)], ctx))
            elif start == 0:  # the chunk is the whole context: attend to its own K/V
                prefills.append(PrefillChunk(row, n))
            else:
                table = torch.tensor(req.block_ids[: -(-ctx // bs)], dtype=torch.long)
                q_pos = torch.arange(start, ctx)[:, None]
                mask = torch.arange(ctx)[None, :] <= q_pos
                prefills.append(PrefillChunk(row, n, table.to(dev), ctx, mask.to(dev)))
            row += n
        groups = self._decode_groups(decodes)
        gathered = [g.block_table.numel() for g in groups]
        gathered += [c.block_table.numel() for c in prefills if c.block_table is not None]
        k_buffer, v_buffer = self._buffers(max(gathered, default=0))
        return AttentionMetadata(slots, groups, prefills, k_buffer, v_buffer)

    def _kernel_metadata(
        self, chunks: list[ScheduledChunk], slots: torch.Tensor
    ) -> AttentionMetadata:
        """Fresh prefill chunks for SDPA; every other token for the kernel, in one batch."""
        bs = self.block_size
        prefills: list[PrefillChunk] = []
        rows: list[np.ndarray] = []
        ctxs: list[np.ndarray] = []
        tables: list[list[int]] = []
        row = 0
        for c in chunks:
            start, n = c.start, c.num_tokens
            if start == 0 and n > 1:  # the chunk is the whole context: its own K/V
                prefills.append(PrefillChunk(row, n))
            else:
                rows.append(np.arange(row, row + n, dtype=np.int32))
                ctxs.append(np.arange(start + 1, start + n + 1, dtype=np.int32))
                tables.append(c.request.block_ids[: -(-(start + n) // bs)])
            row += n
        if not rows:
            return AttentionMetadata(slots, [], prefills)
        table = np.zeros((len(tables), max(map(len, tables))), dtype=np.int32)
        for i, blocks in enumerate(tables):
            table[i, : len(blocks)] = blocks
        owner = np.repeat(np.arange(len(rows), dtype=np.int32), [len(r) for r in rows])
        kernel = KernelTokens(
            rows=torch.from_numpy(np.concatenate(rows)),
            table=torch.from_numpy(owner),
            ctx=torch.from_numpy(np.concatenate(ctxs)),
            tables=torch.from_numpy(table),
        )
        return AttentionMetadata(slots, [], prefills, kernel=kernel)

    def _buffers(self, num_blocks: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Gather buffers of at least ``num_blocks`` blocks, kept across steps."""
        if num_blocks == 0:
            return None, None
        buf = self._gather_buffer
        if buf is None or buf.shape[1] < num_blocks:
            size = num_blocks if buf is None else max(num_blocks, 2 * buf.shape[1])
            s = self.kv_shape
            buf = torch.empty(
                (s.planes, size, s.block_size, s.num_kv_heads, s.head_dim),
                dtype=self.dtype,
                device=self.device,
            )
            self._gather_buffer = buf
        return buf[0], buf[-1]  # one buffer under compressed MLA (attention gathers once)

    def _decode_groups(self, decodes: list[tuple[int, list[int], int]]) -> list[DecodeGroup]:
        """Decodes in groups of similar length, so padding to the longest wastes little."""
        groups: list[DecodeGroup] = []
        decodes = sorted(decodes, key=lambda d: len(d[1]), reverse=True)
        i = 0
        while i < len(decodes):
            width = len(decodes[i][1])
            j = i + 1
            while (
                j < len(decodes)
                and j - i < self.decode_group_rows
                and len(decodes[j][1]) >= width * DECODE_GROUP_SHARE
            ):
                j += 1
            groups.append(self._decode_group(decodes[i:j], width))
            i = j
        return groups

    def _decode_group(self, members: list[tuple[int, list[int], int]], width: int) -> DecodeGroup:
        table = np.zeros((len(members), width), dtype=np.int64)
        for k, (_row, blocks, _ctx) in enumerate(members):
            table[k, : len(blocks)] = blocks
        lens = torch.tensor([ctx for _, _, ctx in members], dtype=torch.long)
        mask = torch.arange(width * self.block_size)[None, :] < lens[:, None]
        dev = self.device
        return DecodeGroup(
            rows=torch.tensor([r for r, _, _ in members], dtype=torch.long).to(dev),
            block_table=torch.from_numpy(table).to(dev),
            mask=mask[:, None, None, :].to(dev),
            ctx=lens.view(-1, 1, 1, 1).to(dev),
        )


def _tokens(req: Request, start: int, end: int) -> list[int]:
    """``req.all_token_ids[start:end]`` without concatenating the whole sequence."""
    prompt, n = req.prompt_token_ids, req.num_prompt_tokens
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return req.output_token_ids[start - n : end - n]
    return prompt[start:] + req.output_token_ids[: end - n]


def _token_at(req: Request, p: int) -> int:
    n = req.num_prompt_tokens
    return req.prompt_token_ids[p] if p < n else req.output_token_ids[p - n]
