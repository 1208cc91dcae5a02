"""``pdserve decode-worker``: run a decode worker (also ``python -m pdserve.decode_worker``)."""

from __future__ import annotations

import argparse
import logging

from pdserve.decode_worker.server import DecodeWorker
from pdserve.decode_worker.server import add_arguments as add_arguments
from pdserve.worker_http import serve


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    worker = DecodeWorker(args)
    try:
        serve(worker.app(), args.host, args.port, args.log_level)
    finally:
        worker.close()
    return 0
