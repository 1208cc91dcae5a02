"""Calls to the workers' internal HTTP API, shared by the router and the decode worker's
prefill chain (decode_worker/chain.py): the keep-alive HTTP/1.1 pool (:mod:`.http1`), the
typed calls (:mod:`.worker_client`) and the OpenAI-style error a worker's refusal becomes
(:mod:`.errors`). Torch-free, and no import of the router: a worker imports this, never
``pdserve.router``."""
