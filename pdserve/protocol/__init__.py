"""What the router, the worker front ends and the engine say to each other.

The worker contract and its codec, the sampling parameters, the engine's outputs and
streams, block hashing and KV events. Nothing here imports torch or transformers
(``tests/test_imports.py`` holds it to that), so the router and a worker's HTTP front
end start without loading the engine; the engine imports this package, never the
other way round.
"""
