"""Built-in profiles: a published-figures GPU profile and an assumed CPU profile.

``H100_LLAMA3_8B`` (bf16, one GPU per replica) is derived from published figures,
not measured here (docs/autoscaling.md shows the arithmetic):
- Llama-3-8B model card: 8.0e9 parameters, 32 layers, 8 KV heads x 128 dims (GQA),
  so 2*8e9 = 16 GFLOP per prompt token and 2*32*8*128*2 B = 128 KiB of KV per token.
- H100 SXM datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB.
- Assumed efficiency: prefill at ~40% MFU (=> ~20k prompt tokens/s marginal),
  decode reads at ~80% of HBM bandwidth, 8 ms per prefill step and 7 ms per
  decode step of fixed overhead (weights read + launches), 90% of HBM for
  weights + KV with 4 GB of activations.

``CPU_TINY`` is an assumed profile for this engine's tiny test model on a few CPU
cores; replace it with ``pdserve profile --out FILE`` measurements.
"""

from __future__ import annotations

from pdserve.planner.capacity import DecodeProfile, PrefillProfile, Profile

_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads, 128 dims, bf16
_HBM_BYTES_PER_S = 3.35e12 * 0.8
_KV_BYTES = 80e9 * 0.9 - 16e9 - 4e9

H100_LLAMA3_8B = Profile(
    model="meta-llama/Meta-Llama-3-8B (bf16)",
    hardware="1x H100 SXM 80GB (published figures, assumed efficiencies)",
    prefill=PrefillProfile(
        chunk_overhead_s=0.008,
        tokens_per_s=20_000.0,
        chunk_tokens=8192,
        attention_s_per_token_sq=2 * 32 * 4096 / 400e12,  # causal QK^T + AV at 400 TFLOP/s
        source="estimate: 16 GFLOP/token (2 x 8.0e9 params, Llama-3-8B model card) at an "
        "assumed 40% of 989 TFLOP/s (H100 SXM datasheet, dense bf16); 8 ms per step assumed",
    ),
    decode=DecodeProfile(
        step_base_s=0.007,
        step_per_seq_s=3e-5,
        step_per_kv_token_s=_KV_BYTES_PER_TOKEN / _HBM_BYTES_PER_S,
        max_num_seqs=256,
        kv_capacity_tokens=int(_KV_BYTES // _KV_BYTES_PER_TOKEN),
        source="estimate: 16 GB of bf16 weights and 128 KiB of KV per token (32 layers x 8 KV "
        "heads x 128, model card) read at an assumed 80% of 3.35 TB/s (H100 SXM datasheet); "
        "7 ms base and 30 us per sequence assumed",
    ),
    source="estimate from published figures (Llama-3-8B model card, H100 SXM datasheet) with "
    "assumed efficiencies; not a measurement",
    startup_s=40.0,
    startup_source="assumed: pod scheduled on a node with the image cached and the weights "
    "(16 GB) on local NVMe; not a measurement",
)

CPU_TINY = Profile(
    model="pdserve tiny-model (float32)",
    hardware="4 CPU cores (assumed; measure with `pdserve profile`)",
    prefill=PrefillProfile(chunk_overhead_s=0.02, tokens_per_s=5_000.0, chunk_tokens=2048),
    decode=DecodeProfile(
        step_base_s=0.01,
        step_per_seq_s=5e-4,
        step_per_kv_token_s=2e-7,
        max_num_seqs=128,
        kv_capacity_tokens=65_536,
    ),
    source="assumed (no measurement); bench/profiles/cpu-tiny-measured.json is measured",
)

PRESETS: dict[str, Profile] = {"h100-llama3-8b": H100_LLAMA3_8B, "cpu-tiny": CPU_TINY}
