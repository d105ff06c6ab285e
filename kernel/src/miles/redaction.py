"""Keeping a run's secrets out of what Miles writes: service logs, logged command lines, errors.

Secrets travel in the environment of the processes that need them, never in argv: the run token
(``MILES_AUTH_TOKEN``) and the trainer group's secret (``MILES_TRAINER_SECRET``). What could still
carry one -- a program that prints its own arguments (SGLang logs its ``server_args``, ``api_key``
included, when it starts), an error that quotes a log -- passes through a :class:`Redactor`, which
writes :data:`MARKER` in place of each secret:

* every byte a supervised process prints, on its way to ``<run>/logs/<name>.log``
  (:mod:`miles.executor.output`, used by the local and the Ray executor);
* the command line an executor writes at the top of that log;
* the ``error: ...`` line ``miles`` prints.

The redactor knows the values of :data:`SECRET_ENV` in the environments it is given. Session keys
are made inside the session server, where no redactor sees their values; they carry a prefix
(``miles_contracts.wire.auth.SESSION_KEY_PREFIX``) and are recognised by their shape instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

from miles_contracts.wire.auth import SESSION_KEY_PATTERN, SESSION_KEY_PREFIX, TOKEN_ENV

MARKER = "[redacted]"
TRAINER_SECRET_ENV = "MILES_TRAINER_SECRET"
SECRET_ENV = (TOKEN_ENV, TRAINER_SECRET_ENV)
"""Environment variables whose values are secrets wherever they appear."""

_MIN_SECRET = 8  # shorter values are no secret worth the name; redacting them would garble logs
_HELD_AT_END = 4  # an unfinished secret's first characters at the end of a stream, from this many on
_SESSION_KEY = re.compile(SESSION_KEY_PATTERN.encode())
_UNFINISHED_KEY = re.compile(re.escape(SESSION_KEY_PREFIX).encode() + rb"[A-Za-z0-9_-]{0,31}\Z")
_KEY_LENGTH = len(SESSION_KEY_PREFIX) + 32


class Redactor:
    """Replaces known secrets and anything shaped like a session key with :data:`MARKER`.

    :param secrets: the values to hide (those shorter than 8 characters are ignored).
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        values = sorted({s for s in secrets if len(s) >= _MIN_SECRET}, key=len, reverse=True)
        self._secrets = [s.encode() for s in values]  # longest first: one secret may contain another
        self._marker = MARKER.encode()

    @classmethod
    def for_environment(cls, *environs: Mapping[str, str]) -> Redactor:
        """A redactor for the secrets in :data:`SECRET_ENV` of ``environs`` (default: this process's)."""
        sources = environs or (os.environ,)
        return cls(env[name] for env in sources for name in SECRET_ENV if env.get(name))

    def text(self, text: str) -> str:
        return self.data(text.encode(errors="surrogateescape")).decode(errors="surrogateescape")

    def data(self, data: bytes) -> bytes:
        for secret in self._secrets:
            data = data.replace(secret, self._marker)
        return _SESSION_KEY.sub(self._marker, data)

    def stream(self) -> StreamRedactor:
        """A redactor for output that arrives in chunks (a secret may be cut between two)."""
        return StreamRedactor(self)

    def unfinished(self, data: bytes) -> int:
        """How many of the last bytes of ``data`` could be the start of a secret or session key
        whose rest has not arrived yet."""
        held = 0
        for secret in [*self._secrets, SESSION_KEY_PREFIX.encode()]:
            for size in range(min(len(secret) - 1, len(data)), held, -1):
                if data.endswith(secret[:size]):
                    held = size
                    break
        key = _UNFINISHED_KEY.search(data[-_KEY_LENGTH:])
        if key is not None:
            held = max(held, len(data[-_KEY_LENGTH:]) - key.start())
        return held


    def begins_secret(self, data: bytes) -> bool:
        """Whether ``data`` is the start of a known secret (4 characters or more) or of a session key
        (its prefix and more)."""
        if data.startswith(SESSION_KEY_PREFIX.encode()):
            return True
        return len(data) >= _HELD_AT_END and any(secret.startswith(data) for secret in self._secrets)


class StreamRedactor:
    """``feed(chunk)`` returns what can be written now; ``finish()`` what is left at the end.

    It holds back only the end of a chunk that could begin a secret (a few dozen bytes at most,
    and nothing in ordinary output), so a log shows each line as soon as it was printed.
    """

    def __init__(self, redactor: Redactor) -> None:
        self._redactor = redactor
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._redactor.data(self._pending + chunk)
        held = self._redactor.unfinished(data)
        self._pending = data[len(data) - held:] if held else b""
        return data[:len(data) - held]

    def finish(self) -> bytes:
        """The held-back end: an output cut off in the middle of a secret shows the marker, not
        the secret's first characters."""
        rest, self._pending = self._pending, b""
        return MARKER.encode() if self._redactor.begins_secret(rest) else rest


def redact(text: str) -> str:
    """``text`` without the secrets of this process's environment (and session keys)."""
    return Redactor.for_environment().text(text)
