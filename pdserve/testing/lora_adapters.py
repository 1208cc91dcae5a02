"""Tiny PEFT LoRA adapters on the tiny model, and PEFT's merged model as the oracle.

An adapter is written by PEFT itself (``get_peft_model`` + ``save_pretrained``), then its
A and B are overwritten with seeded random values in float32: PEFT initialises B to zero,
which would make every adapter the base model. The values are large enough that each
adapter's greedy tokens differ from the base model's and from each other's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    targets: tuple[str, ...]
    rank: int
    alpha: int
    seed: int
    rslora: bool = False


# Three adapters that differ in rank, targets and scaling (one rsLoRA).
SPECS = (
    AdapterSpec("attn8", ATTENTION, 8, 16, 1),
    AdapterSpec("mlp4", MLP, 4, 4, 2),
    AdapterSpec("all16", ATTENTION + MLP, 16, 8, 3, rslora=True),
)


def _base(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


def write_adapter(model_dir: Path, out: Path, spec: AdapterSpec) -> Path:
    """A PEFT adapter directory for the tiny model at ``out``."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        lora_dropout=0.0,
        use_rslora=spec.rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(_base(model_dir), config)
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                fan_in = param.shape[1]
                param.copy_(torch.randn(param.shape, generator=gen) * (1.5 / fan_in**0.5))
    peft_model.save_pretrained(str(out))
    return out


def merged_model(model_dir: Path, adapter_dir: Path) -> Any:
    """PEFT's own merge of the adapter into the base model (the oracle)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(_base(model_dir), adapter_dir).merge_and_unload().eval()


def edit_config(adapter_dir: Path, **changes: Any) -> None:
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
