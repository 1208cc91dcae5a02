import sys

from pdserve.cli import main

sys.exit(main(["prefill-worker", *sys.argv[1:]]))
