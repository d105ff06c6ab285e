"""The session server under cProfile, switched on and off by signals, for ``miles bench session --profile``:
``python -m miles_tito.bench.profiled_server --profile-out FILE <miles serve session's arguments>``.

``SIGUSR1`` starts a fresh profile of the main thread (the one the event loop and every handler
run on); ``SIGUSR2`` stops it and writes it to ``FILE`` (``pstats`` format), then renames it into
place, so a reader never sees half a file. The bench profiles one concurrency level only, not the
start-up nor the warm-up. The server itself is unchanged: it ends with ``os._exit`` on a stop signal,
which would lose a profile written at exit, hence the signals.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import signal
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    from miles_tito.server.cli import main as serve

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--profile-out", required=True)
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    profile: list[cProfile.Profile] = []

    def start(signum: int, frame: Any) -> None:
        profile[:] = [cProfile.Profile()]
        profile[0].enable()

    def dump(signum: int, frame: Any) -> None:
        if not profile:
            return
        profile[0].disable()
        partial = args.profile_out + ".partial"
        profile[0].dump_stats(partial)
        os.replace(partial, args.profile_out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, dump)
    return serve(rest)


if __name__ == "__main__":
    raise SystemExit(main())
