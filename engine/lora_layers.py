"""The LoRA term of a targeted linear layer, for a step that mixes adapters.

Every adapter resident on the device owns a run of columns of one stacked pair per
wrapped layer: ``A`` ``[K, in]`` and ``B`` ``[out, K]``, K the sum of the resident
adapters' ranks (zeros where an adapter does not target the layer)::

    columns   | slot 1 (r=8) | slot 2 (r=16)   | slot 3 (r=8) |
    col_slot  |  1 1 ... 1   |  2 2 ....... 2  |  3 ...     3 |

One mask per step, ``mask[t, k] = scaling(slot k) if token t's slot is slot k else 0``
(``LoraStep.begin``), picks each token's own columns, so a layer adds
``((x @ A.T) * mask) @ B.T`` for the whole batch: two dense matmuls whatever the mix of
adapters and the base model (slot 0), no pass per adapter, no gather of weights per
token, and shapes that change only when adapters load. A step where every token is the
base model's skips the term (``mask`` None).
"""

from __future__ import annotations

import torch


class LoraStep:
    """The current step's token → column mask, shared by every wrapped layer."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None
        self.col_slot: torch.Tensor | None = None  # [K] slot of each column
        self.col_scale: torch.Tensor | None = None  # [K] scaling of each column

    def begin(self, token_slots: torch.Tensor) -> None:
        """``token_slots``: [T] the slot of each token of the step (0: the base model)."""
        assert self.col_slot is not None and self.col_scale is not None
        hit = self.col_slot[None, :] == token_slots[:, None]
        self.mask = hit.to(self.col_scale.dtype) * self.col_scale[None, :]

    def end(self) -> None:
        self.mask = None


class LoraLinear(torch.nn.Module):
    """A linear layer (``nn.Linear`` or cpu_linear's ``PackedLinear``) plus the LoRA
    term of the step's adapters; without a mask or an adapter, the layer alone."""

    def __init__(self, base: torch.nn.Module, step: LoraStep) -> None:
        super().__init__()
        self.base = base
        self.in_features: int = base.in_features  # type: ignore[assignment]
        self.out_features: int = base.out_features  # type: ignore[assignment]
        self.step = step
        self.lora_a: torch.Tensor | None = None  # [K, in]
        self.lora_b: torch.Tensor | None = None  # [out, K]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mask, a, b = self.step.mask, self.lora_a, self.lora_b
        if mask is None or a is None or b is None:
            return y
        # y += ((x @ A.T) * mask) @ B.T in three calls, in place: y is this call's output
        y = y if y.is_contiguous() else y.contiguous()
        xa = torch.mm(x.reshape(-1, self.in_features), a.t()).mul_(mask)
        y.view(-1, self.out_features).addmm_(xa, b.t())
        return y

    def extra_repr(self) -> str:
        k = 0 if self.lora_a is None else self.lora_a.shape[0]
        return f"lora_columns={k}"


def wrap(model: torch.nn.Module, path: str, step: LoraStep) -> LoraLinear:
    """Put a LoraLinear around the layer at ``path`` (dotted, from the model's root);
    the existing wrapper if it has one. KeyError: no such layer."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    layer = getattr(parent, name, None)
    if isinstance(layer, LoraLinear):
        return layer
    if layer is None or not hasattr(layer, "in_features") or not hasattr(layer, "out_features"):
        raise KeyError(path)
    wrapper = LoraLinear(layer, step)
    setattr(parent, name, wrapper)
    return wrapper
