"""``python -m miles_tito.server`` = ``miles serve session`` (same arguments)."""

import sys

from miles_tito.server.cli import main

sys.exit(main())
