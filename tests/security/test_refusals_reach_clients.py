"""A refused request's client reads the refusal (issue 33, item 11).

The guard used to answer 413 (or 401, 403, 415) and close the connection while the client was
still sending its body. A socket closed with unread bytes is reset, and a client that sends its
whole body before reading (Python's ``urllib``, a raw socket) then failed with "Broken pipe" or
"Connection reset by peer" and never saw the status or the reason. Real servers (the suite's
engine, router and session server, 1 MiB body limit), real clients.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from miles_contracts.wire.auth import auth_headers
from miles_contracts.wire.guard import DISCARD_MAX_BYTES
from security_support import MAX_BODY

BIG = 8 * MAX_BODY
"""Well past the limit: the client is still sending when the guard decides."""

LIMIT_SAYS = f"the limit is {MAX_BODY} bytes"


def urllib_post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()


def raw_exchange(url: str, head: str, body_pieces: list[bytes], pause_s: float = 0.0) -> tuple[int, str]:
    """Send ``head`` and then each piece (sleeping ``pause_s`` between them) on a plain socket, and
    only then read the answer until the server closes: ``(status, body)``."""
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=60) as sock:
        sock.sendall(head.encode())
        for piece in body_pieces:
            sock.sendall(piece)
            time.sleep(pause_s)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2].decode()


def request_head(path: str, headers: dict[str, str]) -> str:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
             *(f"{name}: {value}" for name, value in headers.items())]
    return "\r\n".join(lines) + "\r\n\r\n"


def chat_session(session_server) -> dict[str, str]:
    return session_server.client.post("/sessions").json()


def big_chat_body() -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "a" * BIG}]}).encode()


def test_urllib_reads_the_413_of_every_server(engine, router, session_server) -> None:
    """Python's own HTTP client writes the whole body before it reads: it failed with a reset."""
    session = chat_session(session_server)
    targets = [(f"{engine.url}/generate", auth_headers()), (f"{router.url}/generate", auth_headers()),
               (f"{session['base_url']}/chat/completions", {"Authorization": f"Bearer {session['api_key']}"})]
    for url, headers in targets:
        status, text = urllib_post(url, big_chat_body(), headers)
        assert status == 413 and LIMIT_SAYS in text, (url, status, text[:300])
    assert engine.client.get("/health").status_code == 200


def test_httpx_and_the_openai_sdk_read_the_413(session_server) -> None:
    session = chat_session(session_server)
    answer = httpx.post(f"{session['base_url']}/chat/completions", content=big_chat_body(), timeout=60,
                        headers={"Content-Type": "application/json", "Authorization": f"Bearer {session['api_key']}"})
    assert answer.status_code == 413 and LIMIT_SAYS in answer.json()["error"]["message"], answer.text
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a" * BIG}])
    assert refused.value.status_code == 413 and LIMIT_SAYS in str(refused.value.message)


def test_a_slow_raw_client_sends_its_whole_body_and_reads_the_413(engine) -> None:
    """64 KiB at a time with pauses, announced by Content-Length; then chunked, without a length."""
    piece, pieces = b" " * 65536, 4 * MAX_BODY // 65536
    head = request_head("/generate", {**auth_headers(), "Content-Length": str(len(piece) * pieces)})
    status, text = raw_exchange(engine.url, head, [piece] * pieces, pause_s=0.002)
    assert status == 413 and LIMIT_SAYS in text, (status, text)

    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    head = request_head("/generate", {**auth_headers(), "Transfer-Encoding": "chunked"})
    status, text = raw_exchange(engine.url, head, [chunk] * pieces + [b"0\r\n\r\n"], pause_s=0.002)
    assert status == 413 and LIMIT_SAYS in text, (status, text)


def test_a_refusal_for_a_missing_token_reaches_a_client_still_sending(engine, session_server) -> None:
    """The token is checked before the body is read; the 401 waits for the body all the same."""
    for url in (f"{engine.url}/generate", f"{session_server.url}/sessions"):
        status, text = urllib_post(url, b"{" + b" " * (4 * MAX_BODY) + b"}", {"Authorization": "Bearer wrong"})
        assert status == 401 and "Authorization: Bearer" in text, (url, status, text[:300])


def test_clients_that_wait_or_announce_too_much_are_answered_before_sending(engine) -> None:
    """``Expect: 100-continue``: the client sends nothing until it hears from us, so the 413 comes
    first (and no "100 Continue"). A body announced beyond the discard bound is not read either."""
    for extra in ({"Expect": "100-continue", "Content-Length": str(BIG)},
                  {"Content-Length": str(MAX_BODY + DISCARD_MAX_BYTES + 1)}):
        status, text = raw_exchange(engine.url, request_head("/generate", {**auth_headers(), **extra}), [])
        assert status == 413 and LIMIT_SAYS in text, (extra, status, text)
