"""``python -m miles_tito.server`` = ``miles serve session`` (same arguments)."""

import argparse
import sys

from miles_tito.server.cli import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m miles_tito.server", description="Serve the Miles session server.")
add_arguments(parser)
sys.exit(run(parser.parse_args()))
