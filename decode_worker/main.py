"""``pdserve decode-worker``: run a decode worker (also ``python -m pdserve.decode_worker``)."""

from __future__ import annotations

import argparse

from pdserve.decode_worker.server import DecodeWorker
from pdserve.decode_worker.server import add_arguments as add_arguments
from pdserve.worker.args import FLAGS_DECODE
from pdserve.worker.http import run_worker

FLAGS = FLAGS_DECODE  # its flags (pdserve/config_cli.py)


def run(args: argparse.Namespace) -> int:
    return run_worker(DecodeWorker, args)
