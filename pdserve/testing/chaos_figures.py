"""Figures of ``bench/chaos.py``'s record that bench and suite both name.

``BOUNDARY``: issue 44's probes (bench/chaos_isolation.py, and the admin port's phase in
bench/chaos.py), each a count whose goal is 0. The bench draws them; the suite holds each
to 0 (tests/local/test_bench_chaos.py).
"""

from __future__ import annotations

BOUNDARY = (
    "admin_port_unauthenticated_changes",
    "picker_mode_limit_bypass",
    "merged_pod_policy_escapes",
    "cache_symlink_followed",
    "abandoned_compiles_over_bound",
    "lora_path_escapes",
    "worker_call_replayed_elsewhere",
    "prefill_pin_misused",
    "picker_ext_proc_unauthenticated",
    "proc_budget_over_cap",
    "model_file_swap_loaded",
    "replica_budget_over_cap",
    "budget_membership_over_cap",
    "compiled_cache_swap_loaded",
)
