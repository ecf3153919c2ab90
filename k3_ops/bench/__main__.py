"""``python -m k3_ops.bench``: see ``k3_ops.bench.cli``."""
import sys

from .cli import main

main(sys.argv[1:])
