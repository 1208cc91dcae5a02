"""The engine core: the process a worker runs its engine in (main.py, forked from a
zygote: zygote.py), the front end's client to it (client.py, config.py), its loop
(loop.py) and each role's part (prefill.py, decode.py) with what both share (events.py,
info.py)."""
