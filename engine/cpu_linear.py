"""Linear layers of the compiled CPU forward: oneDNN-packed weights, or BLAS input-major.

``prepare(model)`` runs once, before ``torch.compile``, and picks for each ``nn.Linear``:

* **oneDNN, packed** (``pdserve::packed_linear``): the weight reordered once into
  oneDNN's blocked layout (``mkldnn._reorder_linear_weight``) and multiplied by
  ``mkldnn._linear_pointwise``. Every bfloat16 weight, and float32 weights of at least
  ``PACK_MIN_ELEMENTS``. Measured (one thread, AMD EPYC with AVX-512 BF16, the ``small``
  preset's 56 decoder weights per step): float32 5.3 vs 13.3 ms at 16 rows and 47 vs
  112 ms at 256 rows against MKL, which takes a slow path on this CPU; bfloat16 1.7 vs
  3.4 ms at 1 row and 3.0 vs 4.5 ms at 16 against torch's unpacked oneDNN call.
* **BLAS, input-major**: the rest of the float32 weights, stored ``[in, out]`` in memory
  so ``x @ W.T`` is a no-transpose GEMM (up to 2x for a few rows: 1x128 @ 128x384 13.8
  vs 6.7 us). Below ``PACK_MIN_ELEMENTS`` oneDNN's ~10 us per call outweighs its GEMM
  (128x128 at 1 row: 10.4 vs 2.4 us).

The packed tensor has oneDNN's opaque layout, which the compiler cannot trace, so the
operator takes an integer handle (a constant in the graph) and finds the weight at run
time, as attention finds the pool. The handle table holds weak references: a model that
is dropped frees its weights. Weights shared with an embedding stay as they are (lookups
want rows). The eager forward (``--enforce-eager``) never comes here: it runs
transformers' own linears, token-identical to ``generate()``.

``PDSERVE_CPU_LINEAR``: ``auto`` (the rule above, the default), ``blas`` (never pack),
``onednn`` (pack every weight).
"""

from __future__ import annotations

import itertools
import logging
import weakref

import torch

from pdserve import env

logger = logging.getLogger(__name__)

PACK_MIN_ELEMENTS = 512 * 256  # float32: smaller weights stay with BLAS (see above)
PACK_BATCH_HINT = 16  # oneDNN's layout hint; measured no slower from 1 to 1,024 rows
CHOICES = ("auto", "blas", "onednn")

_LIB = torch.library.Library("pdserve", "FRAGMENT")  # attention.py defines the namespace
_LIB.define("packed_linear(Tensor x, int handle, int out_features) -> Tensor")
_layers: dict[int, weakref.ref[PackedLinear]] = {}
_handles = itertools.count()


class PackedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight lives packed for oneDNN, outside the module's
    parameters (the compiler sees only ``packed_linear(x, handle, out)``)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.handle = handle = next(_handles)

        def forget(_: object) -> None:
            _layers.pop(handle, None)

        _layers[handle] = weakref.ref(self, forget)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve.packed_linear(x, self.handle, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


def _packed_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    layer = _layers[handle]()
    assert layer is not None, "packed linear of a dropped model"
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")


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


def should_pack(weight: torch.Tensor, mode: str) -> bool:
    if mode == "blas" or weight.device.type != "cpu" or not onednn_usable(weight.dtype):
        return False
    return mode == "onednn" or weight.dtype == torch.bfloat16 or weight.numel() >= PACK_MIN_ELEMENTS


def prepare(model: torch.nn.Module) -> dict[str, int]:
    """Pack or relay out every linear layer of ``model`` (see the module docstring);
    returns how many took each path."""
    mode = choice()
    embedding_ptrs = {
        m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding)
    }
    counts = {"onednn": 0, "blas_input_major": 0, "as_is": 0}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, torch.nn.Linear):
                continue
            weight = child.weight
            if weight.data_ptr() in embedding_ptrs or weight.stride(1) != 1:
                counts["as_is"] += 1
            elif should_pack(weight, mode):
                setattr(parent, name, PackedLinear(child))
                counts["onednn"] += 1
            elif weight.dtype == torch.float32:
                relaid = weight.detach().t().contiguous().t()
                child.weight = torch.nn.Parameter(relaid, requires_grad=False)
                counts["blas_input_major"] += 1
            else:
                counts["as_is"] += 1
    logger.info("linear layers: %s", counts)
    return counts
