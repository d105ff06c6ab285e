"""``miles.http11`` against real loopback HTTP servers (asyncio servers written here, speaking raw
HTTP/1.1, so each test controls exactly the bytes, splits, delays and closes the client sees)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from miles.engine_client import EngineRequestError, EngineUnavailableError, HttpEngineClient
from miles.http11 import (
    ConnectFailed,
    ConnectionLost,
    HttpClient,
    ProtocolError,
    ResponseParser,
    ResponseTimeout,
)
from miles_contracts.wire.engine import GenerateRequest, SamplingParams

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]


class Server:
    """A loopback server running ``handler`` per connection; counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.open = 0
        self.most_open = 0
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.url = ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went away, or the test ended while this handler slept
        finally:
            self.open -= 1
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes] | None:
        """One request (None once the client closed the connection)."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        request = (lines[0], headers, body)
        self.requests.append(request)
        return request


@contextlib.asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[Server]:
    server = Server(handler)
    listener = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}"
    try:
        yield server
    finally:
        listener.close()


def respond(body: bytes, status: str = "200 OK", headers: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode() + body


async def echo_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
    """Keep-alive: answer each request with its request line."""
    while (request := await server.read_request(reader)) is not None:
        writer.write(respond(request[0].encode()))
        await writer.drain()


_LOOP = {"kind": "asyncio"}


@pytest.fixture(autouse=True, params=["asyncio", "uvloop"])
def event_loop_kind(request: pytest.FixtureRequest) -> None:
    """Every test on both loops: the stdlib's, and uvloop, which the session server runs on."""
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
    _LOOP["kind"] = request.param


def run(coro: Awaitable[Any]) -> Any:
    bounded = asyncio.wait_for(coro, 30)
    if _LOOP["kind"] == "uvloop":
        import uvloop

        return uvloop.run(bounded)
    return asyncio.run(bounded)


# ------------------------------------------------------------------------------- connections


def test_keep_alive_reuses_one_connection_for_sequential_requests() -> None:
    async def main() -> None:
        async with serve(echo_forever) as server, HttpClient(server.url) as client:
            for n in range(5):
                response = await client.request("GET", f"/n/{n}")
                assert (response.status, response.text) == (200, f"GET /n/{n} HTTP/1.1")
            assert server.connections == 1
            assert client.open_connections == 1

    run(main())


def test_request_bytes_host_length_and_headers() -> None:
    async def main() -> None:
        async with serve(echo_forever) as server, HttpClient(server.url + "/prefix/") as client:
            await client.request("POST", "/generate", body=b'{"a": 1}', headers={"X-SMG-Routing-Key": "s1"})
            await client.request("POST", "/empty")
            await client.request("GET", "/get")
        (line, headers, body), (_, empty_headers, _), (_, get_headers, _) = server.requests
        assert line == "POST /prefix/generate HTTP/1.1"
        assert headers["host"] == server.url.removeprefix("http://")
        assert headers["x-smg-routing-key"] == "s1" and headers["content-length"] == "8" and body == b'{"a": 1}'
        assert empty_headers["content-length"] == "0"  # a POST always says how long its body is
        assert "content-length" not in get_headers

    run(main())


def test_concurrent_requests_open_at_most_max_connections() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while (request := await server.read_request(reader)) is not None:
            await asyncio.sleep(0.02)
            writer.write(respond(request[0].encode()))

    async def main() -> None:
        async with serve(slow) as server, HttpClient(server.url, max_connections=3) as client:
            answers = await asyncio.gather(*[client.request("GET", f"/{n}") for n in range(12)])
            assert [a.text for a in answers] == [f"GET /{n} HTTP/1.1" for n in range(12)]
            assert server.most_open <= 3 and server.connections == 3

    run(main())


def test_waiting_for_a_free_connection_respects_the_timeout() -> None:
    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        await asyncio.sleep(10)

    async def main() -> None:
        async with serve(stalls) as server, HttpClient(server.url, max_connections=1) as client:
            first = asyncio.ensure_future(client.request("GET", "/slow", timeout=5))
            await asyncio.sleep(0.05)
            with pytest.raises(ResponseTimeout, match="no free connection"):
                await client.request("GET", "/queued", timeout=0.1)
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            assert client.open_connections == 0  # the cancelled request's connection was closed, its slot freed

    run(main())


def test_server_closing_after_the_response_gets_a_new_connection() -> None:
    async def one_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        writer.write(respond(b"bye", headers="Connection: close\r\n"))
        await writer.drain()

    async def main() -> None:
        async with serve(one_per_connection) as server, HttpClient(server.url) as client:
            for _ in range(3):
                assert (await client.request("GET", "/")).body == b"bye"
            assert server.connections == 3

    run(main())


def test_an_idle_connection_the_server_closed_is_retried_on_a_new_one() -> None:
    async def closes_when_idle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        request = await server.read_request(reader)
        assert request is not None
        writer.write(respond(b"first"))
        await writer.drain()
        # Then close the idle keep-alive connection, as uvicorn does after its keep-alive timeout.

    async def main() -> None:
        async with serve(closes_when_idle) as server, HttpClient(server.url) as client:
            assert (await client.request("POST", "/a", body=b"x")).body == b"first"
            await asyncio.sleep(0.05)
            assert (await client.request("POST", "/b", body=b"y")).body == b"first"
            assert server.connections == 2
            assert [r[0] for r in server.requests] == ["POST /a HTTP/1.1", "POST /b HTTP/1.1"]  # /b sent once

    run(main())


def test_a_reused_connection_closed_as_the_request_arrives_is_retried_once_on_a_new_one() -> None:
    async def closes_second_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        if server.connections > 2:
            return  # from the third connection on, hang up at once
        writer.write(respond(f"connection {server.connections}".encode()))
        await writer.drain()
        await server.read_request(reader)  # the race with a keep-alive timeout: read, then hang up unanswered

    async def main() -> None:
        async with serve(closes_second_request) as server, HttpClient(server.url) as client:
            assert (await client.request("GET", "/a")).text == "connection 1"
            assert (await client.request("GET", "/b")).text == "connection 2"
            assert server.connections == 2
            # Only once: when the new connection hangs up too, the request fails.
            with pytest.raises(ConnectionLost, match="without answering"):
                await client.request("GET", "/c")
            assert server.connections == 3

    run(main())


def test_idle_connections_past_keepalive_expiry_are_not_reused() -> None:
    async def main() -> None:
        async with serve(echo_forever) as server, HttpClient(server.url, keepalive_expiry=0.05) as client:
            await client.request("GET", "/1")
            await asyncio.sleep(0.1)
            await client.request("GET", "/2")
            assert server.connections == 2 and client.open_connections == 1

    run(main())


# ----------------------------------------------------------------------------------- bodies


def test_chunked_body_split_across_writes_with_extensions_and_trailers() -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while await server.read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n")
            for piece in (b"5\r\n{\"a\":", b"\r\n", b"A;ext=1\r\n 123456789\r\n", b"1\r\n}\r\n0\r\nX-Trailer: t\r\n", b"\r\n"):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.005)

    async def main() -> None:
        async with serve(chunked) as server, HttpClient(server.url) as client:
            for _ in range(2):
                response = await client.request("GET", "/")
                assert response.json() == {"a": 123456789}
                assert response.headers["content-type"] == "application/json"
            assert server.connections == 1  # a complete chunked response leaves the connection reusable

    run(main())


def test_content_length_body_arriving_in_pieces() -> None:
    body = bytes(range(256)) * 1000

    async def dribbles(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while await server.read_request(reader) is not None:
            data = respond(body)
            for start in range(0, len(data), 70_000):
                writer.write(data[start : start + 70_000])
                await writer.drain()
                await asyncio.sleep(0.002)

    async def main() -> None:
        async with serve(dribbles) as server, HttpClient(server.url) as client:
            big = bytes(300_000)  # above the inline limit: head and body are written separately
            assert (await client.request("POST", "/", body=big)).body == body
            assert (await client.request("GET", "/")).body == body
            assert len(server.requests[0][2]) == len(big) and server.connections == 1

    run(main())


def test_body_delimited_by_close() -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\n\r\npart one, ")
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(b"part two")

    async def main() -> None:
        async with serve(until_close) as server, HttpClient(server.url) as client:
            assert (await client.request("GET", "/")).body == b"part one, part two"
            assert client.open_connections == 0

    run(main())


def test_head_204_and_informational_responses_carry_no_body() -> None:
    async def varied(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while (request := await server.read_request(reader)) is not None:
            if request[0].startswith("HEAD"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n")
            elif "/204" in request[0]:
                writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + respond(b"after 100"))

    async def main() -> None:
        async with serve(varied) as server, HttpClient(server.url) as client:
            head = await client.request("HEAD", "/")
            assert (head.status, head.body, head.headers["content-length"]) == (200, b"", "1234")
            assert (await client.request("GET", "/204")).status == 204
            assert (await client.request("GET", "/100")).body == b"after 100"
            assert server.connections == 1

    run(main())


def test_error_status_is_a_response_not_an_exception() -> None:
    async def fails(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while await server.read_request(reader) is not None:
            writer.write(respond(b'{"detail": "bad input_ids"}', "422 Unprocessable Entity"))

    async def main() -> None:
        async with serve(fails) as server, HttpClient(server.url) as client:
            response = await client.request("POST", "/generate", body=b"{}")
            assert response.status == 422 and response.json() == {"detail": "bad input_ids"}

    run(main())


# ----------------------------------------------------------------------------------- failures


def test_connection_refused_is_connect_failed() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connecting is refused

        async def main() -> None:
            async with HttpClient(f"http://127.0.0.1:{port}") as client:
                with pytest.raises(ConnectFailed, match=f"cannot connect to 127.0.0.1:{port}"):
                    await client.request("GET", "/")
                assert client.open_connections == 0

        run(main())


def test_timeout_raises_and_the_connection_is_not_reused() -> None:
    async def slow_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while (request := await server.read_request(reader)) is not None:
            if "/slow" in request[0]:
                await asyncio.sleep(1)
            writer.write(respond(b"ok"))

    async def main() -> None:
        async with serve(slow_first) as server, HttpClient(server.url) as client:
            with pytest.raises(ResponseTimeout, match="no complete response within 0.1s"):
                await client.request("GET", "/slow", timeout=0.1)
            assert (await client.request("GET", "/fast")).body == b"ok"
            assert server.connections == 2  # the timed-out connection might still get the late answer

    run(main())


def test_server_closing_mid_response_is_connection_lost() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
        await writer.drain()

    async def main() -> None:
        async with serve(cut) as server, HttpClient(server.url) as client:
            with pytest.raises(ConnectionLost, match="middle of the response body") as lost:
                await client.request("GET", "/")
            assert lost.value.response_started
            assert server.connections == 1  # a response had started: never re-sent

    run(main())


def test_server_closing_a_fresh_connection_without_answering_is_connection_lost() -> None:
    async def hangs_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)

    async def main() -> None:
        async with serve(hangs_up) as server, HttpClient(server.url) as client:
            with pytest.raises(ConnectionLost, match="without answering"):
                await client.request("POST", "/generate", body=b"{}")
            assert server.connections == 1  # a new connection is not retried: the server may have acted on it

    run(main())


def test_malformed_status_line_is_a_protocol_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"SPDY/3 200 OK\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def main() -> None:
        async with serve(garbage) as server, HttpClient(server.url) as client:
            with pytest.raises(ProtocolError, match="malformed status line"):
                await client.request("GET", "/")

    run(main())


def test_header_injection_is_refused() -> None:
    client = HttpClient("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="invalid header"):
        run(client.request("GET", "/", headers={"X-Key": "a\r\nEvil: 1"}))


@pytest.mark.parametrize("target", ["/a b", "/x\r\nEvil: 1", "/caf\u00e9", "/\u4e2d"])
def test_a_request_target_that_is_not_visible_ascii_is_refused(target: str) -> None:
    """It would end the request line early (a space, CR/LF: another header or request) or could
    not be written at all (text beyond Latin-1 made a UnicodeEncodeError the router turned into a
    503); callers percent-encode it."""
    client = HttpClient("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="invalid request target"):
        run(client.request("GET", target))


# ----------------------------------------------------------------------------------- parser


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_parser_gives_the_same_response_for_any_split(step: int) -> None:
    raw = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nSet-Thing: a\r\nSet-Thing: b\r\n\r\n"
        b"3\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\n\r\n"
    )
    parser = ResponseParser()
    responses = [r for start in range(0, len(raw), step) if (r := parser.feed(raw[start : start + step])) is not None]
    assert len(responses) == 1
    assert responses[0].body == b"abc0123456789abcdef"
    assert responses[0].headers["set-thing"] == "a, b"
    assert parser.keep_alive


def test_parser_refuses_compressed_bodies_and_bad_lengths() -> None:
    with pytest.raises(ProtocolError, match="compressed"):
        ResponseParser().feed(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 1\r\n\r\nx")
    with pytest.raises(ProtocolError, match="Content-Length"):
        ResponseParser().feed(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n")
    with pytest.raises(ProtocolError, match="chunk size"):
        ResponseParser().feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")


# ----------------------------------------------------------------------------- engine client


GENERATED = {
    "text": "", "output_ids": [5, 6],
    "meta_info": {"id": "r1", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
                  "completion_tokens": 2, "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]]},
}


def test_engine_client_generate_sends_the_routing_key_and_parses_the_answer() -> None:
    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while await server.read_request(reader) is not None:
            writer.write(respond(json.dumps(GENERATED).encode(), headers="Content-Type: application/json\r\n"))

    async def main() -> None:
        async with serve(engine) as server, HttpEngineClient(server.url) as client:
            request = GenerateRequest(input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=2), return_logprob=True)
            response = await client.generate(request, routing_key="session-1")
            assert response.output_ids == [5, 6] and response.logprobs() == [-0.5, -1.5]
            (line, headers, body), = server.requests
            assert line == "POST /generate HTTP/1.1" and headers["x-smg-routing-key"] == "session-1"
            assert headers["content-type"] == "application/json"
            assert json.loads(body) == request.model_dump(mode="json", exclude_none=True)

    run(main())


def test_engine_client_maps_failures_to_its_error_types() -> None:
    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while (request := await server.read_request(reader)) is not None:
            if "/slow" in request[0]:
                await asyncio.sleep(1)
            writer.write(respond(b'{"detail": "input_ids is empty"}', "400 Bad Request"))

    async def main() -> None:
        async with serve(engine) as server:
            async with HttpEngineClient(server.url) as client:
                with pytest.raises(EngineRequestError, match="HTTP 400: input_ids is empty") as refused:
                    await client.post("/generate", {})
                assert refused.value.status_code == 400
            async with HttpEngineClient(server.url, timeout=0.1) as client:
                with pytest.raises(EngineUnavailableError, match="did not answer in time"):
                    await client.post("/slow", {})
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            async with HttpEngineClient(f"http://127.0.0.1:{sock.getsockname()[1]}", retries=1) as client:
                with pytest.raises(EngineUnavailableError, match="cannot reach .*ConnectFailed"):
                    await client.get("/health")
                with pytest.raises(EngineUnavailableError, match="cannot reach .*ConnectFailed"):
                    await client.post("/generate", {})  # after one retry

    run(main())
