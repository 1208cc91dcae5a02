"""Linear layers of the compiled CPU forward: oneDNN-packed weights, BLAS for small GEMMs.

``prepare(model)`` runs once, before ``torch.compile``. On a CPU with oneDNN, every
``nn.Linear`` becomes a :class:`PackedLinear`: its weight reordered once into oneDNN's
blocked layout (``mkldnn._reorder_linear_weight``) and multiplied by
``mkldnn._linear_pointwise`` through the ``pdserve::packed_linear`` operator. Measured
(one thread, AMD EPYC with AVX-512 BF16, the ``small`` preset's 56 decoder weights per
step): float32 5.3 vs 13.3 ms at 16 rows and 47 vs 112 ms at 256 rows against MKL (which
takes a slow path on this CPU); bfloat16 1.7 vs 3.4 ms at 1 row and 3.0 vs 4.5 ms at 16
against torch's own, unpacked oneDNN call. Served, the ``small`` preset at concurrency 16
went from 0.72x to 1.30x vLLM's CPU build in float32, 1.03x to 1.36x in bfloat16.

oneDNN costs ~10 us a call, which dominates a small GEMM (128x128 at 1 row: 10.4 vs
2.4 us with MKL). So a float32 weight of under ``SMALL_GEMM_MACS`` elements also keeps a
BLAS copy, stored input-major (``[in, out]`` in memory: a no-transpose GEMM, up to 2x for
a few rows), and a call whose rows x in x out is under ``BLAS_CALL_MACS`` uses it. Real
models' weights are all larger, so they hold one copy.

``BLAS_CALL_MACS`` was ``SMALL_GEMM_MACS`` (2^19) until 2026-12-07, which sent the tiny
preset's MLP (128 x 256) to oneDNN at exactly 16 rows, the decode batch of the serve bench.
Measured then on the Intel Xeon (AVX-512, no BF16; one thread, CPU time, us a call,
input-major BLAS vs packed oneDNN): 128 x 256 at 16 rows 9.4 vs 27.1, at 32 rows 18.0 vs
41.5; 128 x 3,072 at 16 rows 90 vs 114, at 32 rows 198 vs 241; 576 x 1,536 at 16 rows 262
vs 304. A whole compiled decode step of 16 rows (interleaved rounds, loaded host): tiny
preset 7.9 -> 6.8 ms, wide-vocab 16.4 -> 14.8 ms. Prompt chunks of hundreds of rows and
more stay on oneDNN.

Weights off the CPU (CUDA) are left as they are: these layouts were measured on CPU.

An output head tied to the input embedding (SmolLM2, Llama 3.2, Gemma: one tensor for
both) keeps that tensor for the embedding's row lookups and for calls of up to
``SHARED_ROWS`` rows, and gets a packed copy for larger calls (one more copy of the head:
113 MB for SmolLM2-135M in float32). Measured 2026-12-07 (Intel Xeon, AVX-512 without
BF16, one thread, CPU time, median of 5-7 interleaved rounds) on SmolLM2's head, 576 x
49,152, float32 ms as it was (MKL, the [vocab, hidden] tensor) vs packed: 1 row 8.3 vs
10.7, 3 rows 11.2 vs 12.4, 4 rows 20.7 vs 12.2, 8 rows 31.4 vs 14.4, 16 rows 24.9 vs 17.4,
32 rows 29.8 vs 23.0, 64 rows 43.3 vs 37.6. Before, a tied head was left as it was.

The packed tensor has oneDNN's opaque layout, which the compiler cannot trace, so the
operator takes an integer handle (a constant in the graph) and finds the weight at run
time, as attention finds the pool. The handle table holds weak references: a model that
is dropped frees its weights. A new layer takes the lowest handle no live layer holds,
so a model's handles, and with them its graphs and inductor's cache keys, do not depend
on the models the process made before (with a process-wide counter, the compiled family
matrix's k-th family hit the cache only where it came k-th again; in another order its
graphs were traced, compiled and its C++ kernels built again). Dynamo guards each
handle's value: a graph traced for other handles is never reused. The eager forward
(``--enforce-eager``) never comes here: it runs transformers' own linears,
token-identical to ``generate()``.

oneDNN builds a primitive (JIT code) per input shape, ~0.5-1 ms per linear on this CPU,
and caches 1,024 of them. Prefill rows are the prompt chunk's length, which takes every
value, so a service under random prompt lengths paid that at almost every new request
(its first ~250 requests ran 2-3x slower: TTFT p50 29-62 ms against 13-17 ms once warm,
tiny model at 12 req/s) and a model with several weight shapes could thrash the cache.
Rows above ``EXACT_ROWS`` are padded up to a multiple of ``NARROW_ROW_BUCKET`` below
``NARROW_ROWS``, of ``ROW_BUCKET`` up to ``WIDE_ROWS`` and of ``WIDE_ROW_BUCKET`` above
(``rows_bucket``): at most 15 more rows (7 below 64 rows, where decode batches sit and a
row costs the most: 17 rows padded to 32 took 283 us against 170 on a 512 x 1,536
weight, to 24 213 us; 6% from 256 rows up), and under a hundred shapes per weight up to
2,048 rows. Measured on the tiny model at 12
req/s: TTFT p50 / p90 in the first 20 s of load 19.6 / 38.9 ms (was 29-62 / 73-136),
once warm 9.2-9.8 / 12.7-12.9 ms (was 13-17 / 24-36: the cache had been thrashing too).

bfloat16 on a CPU without bfloat16 instructions (no ``avx512_bf16``, no AMX: oneDNN
emulates the GEMM on AVX-512): a bfloat16 weight of under ``SMALL_GEMM_MACS`` elements
keeps a float32 input-major copy instead of a packed one, and every call multiplies by it,
the input upcast and the output rounded back to bfloat16 (the upcasts are exact and both
ways sum the products in float32, so the result is a bfloat16 GEMM's up to the order of
the sums). Measured 2026-12-07 (Intel Xeon, AVX-512 without BF16, one thread, CPU time, us
a call, packed bfloat16 oneDNN vs this): 128 x 256 at 1 / 16 / 256 rows 24 / 61 / 618 vs
11 / 19 / 139; 128 x 3,072 (the tiny preset's head) 49 / 487 / 6,994 vs 36 / 122 / 1,629;
512 x 1,024 57 / 637 / 9,189 vs 60 / 162 / 2,062. Larger weights stay packed in bfloat16
(a float32 copy of a real model's weights would double their memory).

Intel: on an Intel CPU (``vendor_id: GenuineIntel``; MKL runs its own AVX-512 kernels
there) a float32 weight of ``SMALL_GEMM_MACS`` up to ``BLAS_ONLY_ELEMENTS`` elements keeps
one input-major copy and no packed one, and every call multiplies by BLAS. Measured
2026-12-07 on the Xeon (AVX-512, one thread, CPU time, us a call, input-major BLAS vs
packed oneDNN): SmolLM2's MLP 576 x 1,536 at 1 / 16 / 64 / 256 / 2,048 rows 148 / 293 /
810 / 3,292 / 25,977 vs 193 / 329 / 962 / 3,521 / 26,445 (1,536 x 576 alike); 1,024 x
2,048 at 1 / 16 / 64 / 512 rows 358 / 1,355 / 2,697 / 15,771 vs 556 / 1,442 / 3,359 /
16,467. A head's size is another matter (576 x 49,152: 19.7 vs 14.4 ms at 16 rows), so
larger weights stay packed. Same memory as before (one copy); on other CPUs (the AMD
EPYC above, where MKL took a slow path) nothing changes.

``PDSERVE_CPU_LINEAR``: ``auto`` (the rule above, the default), ``blas`` (no oneDNN:
float32 weights input-major, bfloat16 as they are), ``onednn`` (oneDNN for every call).
"""

from __future__ import annotations

import gc
import itertools
import logging
import weakref

import torch
import torch.nn.functional as F

from pdserve import env

logger = logging.getLogger(__name__)

SMALL_GEMM_MACS = 1 << 19  # float32: a weight of fewer elements keeps a BLAS copy
# float32 on an Intel CPU (MKL's own): a weight of SMALL_GEMM_MACS up to this many
# elements is kept input-major only, every call BLAS (module docstring, "Intel")
BLAS_ONLY_ELEMENTS = 1 << 21
BLAS_CALL_MACS = 1 << 23  # a call of fewer multiply-adds on such a weight goes to BLAS
SHARED_ROWS = 3  # a tied float32 head: calls of up to this many rows use the shared weight
PACK_BATCH_HINT = 16  # oneDNN's layout hint; measured no slower from 1 to 1,024 rows
CHOICES = ("auto", "blas", "onednn")
EXACT_ROWS = 16  # oneDNN calls of up to this many rows run as they are; above it on a
NARROW_ROW_BUCKET, NARROW_ROWS = 8, 64  # multiple of 8 below 64 rows,
ROW_BUCKET = 16  # of 16 up to WIDE_ROWS,
WIDE_ROW_BUCKET, WIDE_ROWS = 64, 1024  # of 64 above (< 100 shapes up to 2,048 rows)

_LIB = torch.library.Library("pdserve", "FRAGMENT")  # attention.py defines the namespace
_LIB.define("packed_linear(Tensor x, int handle, int out_features) -> Tensor")
_layers: dict[int, weakref.ref[PackedLinear]] = {}


def _free_handle() -> int:
    """The lowest handle no live layer holds (module docstring)."""
    return next(h for h in itertools.count() if h not in _layers)


class PackedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight lives packed for oneDNN, outside the module's
    parameters (the compiler sees only ``packed_linear(x, handle, out)``)."""

    def __init__(
        self, linear: torch.nn.Linear, blas_copy: bool, tied: bool = False, blas_only: bool = False
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # A small bfloat16 weight on a CPU without bfloat16 instructions: every call runs
        # on a float32 copy (module docstring, "bfloat16"), so no packed one is kept; nor
        # for a mid-sized float32 weight on an Intel CPU (``blas_only``: "Intel").
        self.upcast = blas_copy and weight.dtype != torch.float32
        blas_copy = blas_copy or blas_only
        self.packed = (
            None
            if self.upcast or blas_only
            else torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        )
        # [out, in] to F.linear, [in, out] in memory; for calls under BLAS_CALL_MACS
        self.blas = weight.float().t().contiguous().t() if blas_copy else None
        # A float32 head tied to the embedding: the embedding's own tensor (no copy) for
        # calls of few rows, where MKL's GEMV beats oneDNN's packed GEMM (module docstring).
        self.shared = weight if tied and weight.dtype == torch.float32 else None
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.blas_bias = None if self.bias is None or not self.upcast else self.bias.float()
        self.handle = handle = _free_handle()

        def forget(_: object) -> None:
            _layers.pop(handle, None)

        _layers[handle] = weakref.ref(self, forget)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve.packed_linear(x, self.handle, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


def rows_bucket(rows: int) -> int:
    """The row count a oneDNN call of ``rows`` rows runs on (see the module docstring)."""
    if rows <= EXACT_ROWS:
        return rows
    if rows < NARROW_ROWS:
        step = NARROW_ROW_BUCKET
    else:
        step = WIDE_ROW_BUCKET if rows > WIDE_ROWS else ROW_BUCKET
    return -(-rows // step) * step


def call_path(layer: PackedLinear, x: torch.Tensor) -> str:
    """Which weight a call on ``x`` multiplies by: ``blas`` (the input-major copy),
    ``shared`` (a tied head's embedding tensor) or ``onednn`` (the packed one)."""
    macs = x.numel() * layer.out_features
    if layer.blas is not None and (layer.packed is None or macs < BLAS_CALL_MACS):
        return "blas"
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if layer.shared is not None and (rows <= SHARED_ROWS or macs < SMALL_GEMM_MACS):
        return "shared"
    return "onednn"


def _packed_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    layer = _layers[handle]()
    assert layer is not None, "packed linear of a dropped model"
    path = call_path(layer, x)
    if layer.upcast:  # bfloat16 in and out, float32 products and sums (exact upcasts)
        assert layer.blas is not None
        return F.linear(x.float(), layer.blas, layer.blas_bias).to(x.dtype)
    if path != "onednn":
        weight = layer.blas if path == "blas" else layer.shared
        assert weight is not None
        return F.linear(x, weight, layer.bias)
    assert layer.packed is not None
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    padded = rows_bucket(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
    flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(flat, layer.packed, layer.bias, "none", [], "")
    return out[:rows].reshape(*x.shape[:-1], out_features)


_LIB.impl("packed_linear", _packed_linear, "CPU")


@torch.library.register_fake("pdserve::packed_linear")
def _(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def choice() -> str:
    got = env.get(env.CPU_LINEAR, "auto")
    if got not in CHOICES:
        raise ValueError(f"{env.CPU_LINEAR}={got!r}: expected one of {', '.join(CHOICES)}")
    return got


def onednn_usable(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU multiplies bfloat16 in hardware (``avx512_bf16`` or ``amx_bf16``);
    None where ``cpuinfo`` cannot be read. Without either, oneDNN emulates bfloat16 GEMMs
    on AVX-512: measured 2026-12-07 on such a Xeon (one thread, CPU time, SmolLM2's head,
    576 x 49,152) 39 ms against 17-22 ms in float32 at 16 rows, 130 against 33-39 at 64."""
    try:
        with open(cpuinfo) as f:
            flags = set(f.read().split())
    except OSError:
        return None
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def intel_cpu(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this is an Intel CPU (``vendor_id: GenuineIntel``), where MKL runs its own
    AVX-512 kernels: there its float32 GEMM on an input-major weight beat oneDNN's packed
    one at every row count measured for mid-sized weights (module docstring, "Intel").
    False where ``cpuinfo`` cannot be read."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip() == "GenuineIntel"
    except OSError:
        pass
    return False


def blas_only(weight: torch.Tensor, mode: str) -> bool:
    """A float32 weight of SMALL_GEMM_MACS up to BLAS_ONLY_ELEMENTS elements on an Intel
    CPU: kept input-major only (no packed copy), every call multiplied by BLAS."""
    if mode != "auto" or weight.dtype != torch.float32:
        return False
    return SMALL_GEMM_MACS <= weight.numel() <= BLAS_ONLY_ELEMENTS and intel_cpu()


def should_pack(weight: torch.Tensor, mode: str) -> bool:
    return mode != "blas" and weight.device.type == "cpu" and onednn_usable(weight.dtype)


def keeps_blas_copy(weight: torch.Tensor, mode: str) -> bool:
    """A small weight keeps a float32 input-major copy: a float32 one for calls of few
    multiply-adds, a bfloat16 one on a CPU without bfloat16 instructions for every call."""
    if mode != "auto" or weight.numel() >= SMALL_GEMM_MACS:
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and native_bf16() is False


def prepare(model: torch.nn.Module) -> dict[str, int]:
    """Pack or relay out every linear layer of ``model`` (see the module docstring);
    returns how many took each path."""
    mode = choice()
    if _layers:  # a model made before this one may be dead but not yet collected (a cycle):
        gc.collect()  # its handles are free again (module docstring); one model: no cost
    embedding_ptrs = {
        m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding)
    }
    counts = {"onednn": 0, "onednn_tied": 0, "blas_input_major": 0, "as_is": 0}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, torch.nn.Linear):
                continue
            weight = child.weight
            if type(child).forward is not torch.nn.Linear.forward:
                # A subclass with its own forward (PhiMoE's router returns logits, weights
                # and experts): replacing it would change what it returns.
                counts["as_is"] += 1
                continue
            # Only CPU weights: these layouts were measured on CPU; cuBLAS wants its own.
            cpu = weight.device.type == "cpu"
            tied = weight.data_ptr() in embedding_ptrs
            if not cpu or weight.stride(1) != 1 or (tied and not should_pack(weight, mode)):
                counts["as_is"] += 1
            elif tied:  # the embedding keeps the weight; the head gets a packed copy too
                setattr(parent, name, PackedLinear(child, False, tied=True))
                counts["onednn_tied"] += 1
            elif should_pack(weight, mode) and blas_only(weight, mode):
                setattr(parent, name, PackedLinear(child, False, blas_only=True))
                counts["blas_input_major"] += 1
            elif should_pack(weight, mode):
                setattr(parent, name, PackedLinear(child, keeps_blas_copy(weight, mode)))
                counts["onednn"] += 1
            elif weight.dtype == torch.float32:
                relaid = weight.detach().t().contiguous().t()
                child.weight = torch.nn.Parameter(relaid, requires_grad=False)
                counts["blas_input_major"] += 1
            else:
                counts["as_is"] += 1
    logger.info("linear layers: %s", counts)
    if _bf16_packed(model) and native_bf16() is False:
        logger.warning(
            "bfloat16 weights on a CPU without avx512_bf16 or amx_bf16: oneDNN emulates "
            "the GEMMs (2-4x float32's time at 16-64 rows); --dtype float32 is faster here"
        )
    return counts


def _bf16_packed(model: torch.nn.Module) -> bool:
    """Some bfloat16 weight is multiplied by oneDNN (not by its float32 copy)."""
    return any(
        isinstance(m, PackedLinear) and m.packed is not None and m.packed.dtype == torch.bfloat16
        for m in model.modules()
    )
