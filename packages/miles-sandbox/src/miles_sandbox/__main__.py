"""``python -m miles_sandbox``: the sandbox service (what :func:`miles_sandbox.server.sandbox_command` runs)."""

import sys

from miles_sandbox.server import main

sys.exit(main())
