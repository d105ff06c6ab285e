"""The response side of :mod:`miles.http11`: what a response is, how one is parsed out of the
bytes a connection receives, and the client's error types.

Kept apart from the connection and the pool so it can be tested on byte splits the network rarely
makes, and read on its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_HEAD_BYTES = 64 * 1024
"""Longest status line plus headers accepted (longer is a :class:`ProtocolError`)."""


class HttpError(Exception):
    """Base class of this client's errors."""


class ConnectFailed(HttpError):
    """No connection could be opened (refused, unknown host, or the connect timed out)."""


class ConnectionLost(HttpError):
    """The server closed or reset the connection before the response was complete.

    :ivar response_started: whether any byte of the response had arrived.
    """

    def __init__(self, message: str, *, response_started: bool) -> None:
        super().__init__(message)
        self.response_started = response_started


class ResponseTimeout(HttpError):
    """No complete response (or no free connection) within the request's timeout."""


class ProtocolError(HttpError):
    """The server's answer is not HTTP/1.1 this client can read."""


@dataclass(slots=True)
class HttpResponse:
    """A whole response. Header names are lower-case; a repeated header's values are joined by ``, ``."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------- parsing


class ResponseParser:
    """Incremental parser of one response; :meth:`feed` returns it once complete.

    Separate from the connection so that it can be tested on byte splits the network rarely makes.
    Informational (1xx) responses before the final one are skipped.
    """

    __slots__ = ("_buffer", "_no_body", "_status", "_headers", "_mode", "_remaining", "_body", "_keep_alive", "started")

    def __init__(self, *, no_body: bool = False) -> None:
        self._buffer = bytearray()
        self._no_body = no_body  # a HEAD request: whatever the headers say, no body follows
        self._status = 0
        self._headers: dict[str, str] = {}
        self._mode = ""  # "" = reading the head; then "length", "chunk-size", "chunk-data", "trailers", "close"
        self._remaining = 0
        self._body = bytearray()
        self._keep_alive = True
        self.started = False

    @property
    def keep_alive(self) -> bool:
        """Whether the connection may carry another request after this response."""
        return self._keep_alive and self._mode != "close"

    def feed(self, data: bytes) -> HttpResponse | None:
        self.started = True
        self._buffer += data
        while True:
            if not self._mode:
                if not self._read_head():
                    return None
                if not self._mode:  # a 1xx response, or a response without a body
                    if self._status >= 200:
                        return self._finish()
                    continue
            return self._finish() if self._read_body() else None

    def feed_eof(self) -> HttpResponse:
        """The server closed the connection: the response if it was delimited by the close."""
        if self._mode == "close":
            self._body += self._buffer
            self._buffer.clear()
            return self._finish()
        raise ConnectionLost(self._lost_message(), response_started=self.started)

    def _lost_message(self) -> str:
        if not self.started:
            return "the server closed the connection without answering"
        if not self._mode:
            return "the server closed the connection in the middle of the response head"
        return f"the server closed the connection in the middle of the response body (HTTP {self._status})"

    def _read_head(self) -> bool:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise ProtocolError(f"the response head is longer than {MAX_HEAD_BYTES} bytes")
            return False
        head = bytes(self._buffer[:end]).decode("latin-1")
        del self._buffer[: end + 4]
        lines = head.split("\r\n")
        version, status = _status_line(lines[0])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise ProtocolError(f"malformed response header line {line[:100]!r}")
            name = name.lower()
            value = value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self._status, self._headers = status, headers
        self._mode = self._body_mode(version, status, headers)
        return True

    def _body_mode(self, version: str, status: int, headers: dict[str, str]) -> str:
        connection = headers.get("connection", "").lower()
        self._keep_alive = ("close" not in connection) if version == "HTTP/1.1" else ("keep-alive" in connection)
        encoding = headers.get("content-encoding", "identity").lower()
        if encoding not in ("identity", ""):
            raise ProtocolError(f"the response is compressed ({encoding}); this client asks for and reads only identity bodies")
        if status < 200 or status in (204, 304) or self._no_body:
            return ""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return "chunk-size"
        length = headers.get("content-length")
        if length is None:
            return "close"
        if not length.isdigit():
            raise ProtocolError(f"invalid Content-Length {length!r}")
        self._remaining = int(length)
        return "length"

    def _read_body(self) -> bool:
        """Move body bytes out of the buffer; True once the body is complete."""
        if self._mode == "length":
            return self._read_length()
        if self._mode == "close":
            self._body += self._buffer
            self._buffer.clear()
            return False
        return self._read_chunks()

    def _read_length(self) -> bool:
        take = min(self._remaining, len(self._buffer))
        if take:
            if not self._body and take == len(self._buffer):
                self._body, self._buffer = self._buffer, bytearray()
            else:
                self._body += self._buffer[:take]
                del self._buffer[:take]
            self._remaining -= take
        return self._remaining == 0

    def _read_chunks(self) -> bool:
        buffer = self._buffer
        pos = 0
        try:
            while True:
                if self._mode == "chunk-size":
                    end = buffer.find(b"\r\n", pos)
                    if end < 0:
                        if len(buffer) - pos > 1024:
                            raise ProtocolError("a chunk-size line is longer than 1024 bytes")
                        return False
                    self._remaining = _chunk_size(bytes(buffer[pos:end]))
                    pos = end + 2
                    self._mode = "chunk-data" if self._remaining else "trailers"
                elif self._mode == "chunk-data":
                    if len(buffer) - pos < self._remaining + 2:
                        return False
                    end = pos + self._remaining
                    if buffer[end : end + 2] != b"\r\n":
                        raise ProtocolError("a chunk is not followed by CRLF")
                    self._body += buffer[pos:end]
                    pos = end + 2
                    self._mode = "chunk-size"
                else:  # trailers: header lines up to an empty line, ignored
                    end = buffer.find(b"\r\n", pos)
                    if end < 0:
                        if len(buffer) - pos > MAX_HEAD_BYTES:
                            raise ProtocolError(f"the chunked trailers are longer than {MAX_HEAD_BYTES} bytes")
                        return False
                    empty = end == pos
                    pos = end + 2
                    if empty:
                        return True
        finally:
            del buffer[:pos]

    def _finish(self) -> HttpResponse:
        if self._buffer:
            self._keep_alive = False  # bytes after the response: this client never pipelines, the stream is off
        return HttpResponse(self._status, self._headers, bytes(self._body))


def _status_line(line: str) -> tuple[str, int]:
    version, _, rest = line.partition(" ")
    code = rest[:3]
    if version not in ("HTTP/1.1", "HTTP/1.0") or not code.isdigit() or rest[3:4] not in ("", " "):
        raise ProtocolError(f"malformed status line {line[:100]!r}")
    return version, int(code)


def _chunk_size(line: bytes) -> int:
    size = line.split(b";", 1)[0].strip()
    try:
        return int(size, 16)
    except ValueError:
        raise ProtocolError(f"invalid chunk size {size[:20]!r}") from None
