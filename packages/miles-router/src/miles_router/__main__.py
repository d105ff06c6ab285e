"""``python -m miles_router``: the same as ``miles serve router``, without loading the CLI of every
other plugin first (what :func:`miles_router.router_command` runs)."""

import sys

from miles_router.cli import main

sys.exit(main())
