"""pdserve: LLM serving with disaggregated prefill and decode.

The top-level folders of the repository are the subpackages of this package:
``engine/`` is ``pdserve.engine``, ``router/`` is ``pdserve.router`` and so on.
"""

__version__ = "0.1.0"
