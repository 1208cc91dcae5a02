"""``pdserve prefill-worker``: run a prefill worker (also ``python -m pdserve.prefill_worker``)."""

from __future__ import annotations

import argparse
import logging

from pdserve.prefill_worker.server import PrefillWorker
from pdserve.prefill_worker.server import add_arguments as add_arguments
from pdserve.worker_http import serve


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    worker = PrefillWorker(args)
    try:
        serve(worker.app(), args.host, args.port, args.log_level)
    finally:
        worker.close()
    return 0
