import sys

from pdserve.cli import main

sys.exit(main(["decode-worker", *sys.argv[1:]]))
