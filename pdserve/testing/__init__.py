"""Helpers that the test suite and the benches share; never imported by product code.

- ``loopback``: machine-wide port blocks, starting and stopping services on loopback;
- ``router_fakes``: fake prefill and decode workers that speak the real workers' protocol;
- ``lora_adapters``: PEFT-format LoRA adapters written to disk for tests and benches;
- ``hf_reference``: transformers' greedy tokens, the reference the engine is compared with;
- ``k8s_emulator``/``k8s_history``/``k8s_objects``/``operator_replica``: the Kubernetes API
  emulator (kmock), sample LLMServices, an operator replica in its own thread;
- ``tiny_engine``, ``engine_probes``, ``pod_policy_probe``: the tiny engine's config and
  issue 44's probes (bench/chaos_isolation.py reports them, the tests hold them to 0).

They live in the package, not in tests/, so that bench/ never imports tests/.
"""
