"""Helpers that the test suite and the benches share; never imported by product code.

- ``loopback``: machine-wide port blocks, starting and stopping services on loopback;
- ``router_fakes``: fake prefill and decode workers that speak the real workers' protocol;
- ``lora_adapters``: PEFT-format LoRA adapters written to disk for tests and benches;
- ``hf_reference``: transformers' greedy tokens, the reference the engine is compared with.

They live in the package, not in tests/, so that bench/ never imports tests/.
"""
