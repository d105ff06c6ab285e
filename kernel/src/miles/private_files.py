"""Files and folders of a run that only its user may read: logs, and files that may hold secrets.

A run's logs can show what a service printed about itself, and its ``config.yaml`` what the user
put there (``sglang.env`` values, tracker settings): both are created readable by their owner only
(files 0600, folders 0700), whatever the umask, and made so again when they already exist.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: Path) -> Path:
    """``path`` (and missing parents) as a folder only its owner can enter."""
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    path.chmod(DIR_MODE)
    return path


def open_private(path: Path, *, append: bool = True) -> BinaryIO:
    """``path`` opened for writing bytes (appending, or from empty), mode 0600."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # a file from before (an earlier start of the same run) keeps no wider mode
        return os.fdopen(fd, "ab" if append else "wb")
    except BaseException:
        os.close(fd)
        raise


def write_private_text(path: Path, text: str) -> None:
    """``path`` holds ``text`` (UTF-8), mode 0600."""
    with open_private(path, append=False) as file:
        file.write(text.encode())
