"""The benches' shared harness: what every script in bench/ would otherwise write again.

- ``stats``: percentiles, median and spread of repetitions;
- ``procfs``: CPU seconds of a process, a thread or a process tree from /proc;
- ``output``: the one JSON line a bench prints (and optionally writes) as its result;
- ``flags``: the common ``--quick``, ``--plot`` and ``--repeat`` flags;
- ``completions``: the OpenAI completion bodies the benches send.

A bench runs as ``python bench/NAME.py`` (bench/ is then first on ``sys.path``, so
``from lib import stats`` resolves here); the tests import benches with bench/ on the path
(pyproject's pytest ``pythonpath``). Nothing here imports tests/.
"""
