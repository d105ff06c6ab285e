"""A supervised process's output: copied to its log file (mode 0600) with the run's secrets redacted.

An executor starts each process with stdout and stderr on one pipe, and an :class:`OutputPump`
thread copies what arrives to ``<logs>/<name>.log`` through a
:class:`~miles.redaction.StreamRedactor`, so a secret the process prints (SGLang logs its
``server_args``, ``--api-key`` included) never reaches the disk, and neither the log tail an
executor quotes when a process dies, nor the driver's error that carries it. Chunks are written as
they arrive (a line shows in the log as soon as it was printed); only the end of a chunk that could
begin a secret waits for the next one.

The pipe ends when the process and every child that inherited its output have exited; the pump
then writes what it held back and closes the log. :meth:`OutputPump.settle` lets an executor read
a complete log after a process died.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, BinaryIO

from miles.private_files import open_private
from miles.redaction import Redactor

_CHUNK = 1 << 16
SETTLE_S = 2.0
"""How long a dead process's last output may take to reach its log before the log is read."""


def open_log(path: Path, redactor: Redactor, argv: Sequence[str], *, where: str = "") -> BinaryIO:
    """The log ``path`` (created 0600, appended to), headed by the command about to start, redacted."""
    log = open_private(path)
    header = f"\n==== start {time.strftime('%H:%M:%S')}{where}: {' '.join(argv)}\n"
    log.write(redactor.text(header).encode())
    log.flush()
    return log


class OutputPump:
    """Copies ``source`` (a process's output pipe) into ``log`` through ``redactor``, in a daemon
    thread; closes both at the end of the output."""

    def __init__(self, source: IO[bytes], log: BinaryIO, redactor: Redactor, *, name: str = "output") -> None:
        self._source = source
        self._log = log
        self._stream = redactor.stream()
        self._settled = False
        self._thread = threading.Thread(target=self._copy, name=f"miles-log-{name}", daemon=True)
        self._thread.start()

    def settle(self, timeout: float = SETTLE_S) -> bool:
        """After the process ended: wait, the first time only, up to ``timeout`` seconds for the
        rest of its output to reach the log (a child that still holds the pipe keeps it open).
        Whether all of it did."""
        if not self._settled:
            self._thread.join(timeout)
            self._settled = True
        return not self._thread.is_alive()

    def _copy(self) -> None:
        fd = self._source.fileno()
        writable = True
        try:
            while chunk := os.read(fd, _CHUNK):
                text = self._stream.feed(chunk)
                if writable:
                    # a full or lost disk ends the log, never the process: its pipe is still drained
                    writable = self._write(text)
            if writable:
                self._write(self._stream.finish())
        finally:
            with contextlib.suppress(OSError):
                self._log.close()
            self._source.close()

    def _write(self, data: bytes) -> bool:
        try:
            self._log.write(data)
            self._log.flush()
        except OSError:
            return False
        return True
