"""``pdserve prefill-worker``: run a prefill worker (also ``python -m pdserve.prefill_worker``)."""

from __future__ import annotations

import argparse

from pdserve.prefill_worker.server import PrefillWorker
from pdserve.prefill_worker.server import add_arguments as add_arguments
from pdserve.worker.args import FLAGS_PREFILL
from pdserve.worker.http import run_worker

FLAGS = FLAGS_PREFILL  # its flags (pdserve/config_cli.py)


def run(args: argparse.Namespace) -> int:
    return run_worker(PrefillWorker, args)
