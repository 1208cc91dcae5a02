"""The benches' shared harness: what every script in bench/ would otherwise write again.

- ``stats``: percentiles, median and spread of repetitions;
- ``procfs``: CPU seconds of a process, a thread or a process tree from /proc;
- ``output``: the one JSON line a bench prints (and optionally writes) as its result;
- ``flags``: the common ``--quick``, ``--plot`` and ``--repeat`` flags;
- ``completions``: the OpenAI completion bodies the benches send.

A bench runs as ``python bench/NAME.py`` from the project's venv: Python puts bench/, the
script's folder, first on ``sys.path``, so ``from lib import stats`` and ``import serve``
resolve here, and pdserve comes from the venv's install. The tests import benches by the
same names (pyproject's pytest ``pythonpath`` lists bench/). Nothing in bench/ edits
``sys.path`` or imports tests/ (tests/test_import_paths.py).
"""
