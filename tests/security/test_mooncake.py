"""Mooncake (``weights.transport: mooncake``) against a process that is not part of the run.

Mooncake's transfer engine has no authentication: any process that connects to its ports can read
and write the memory registered with it. The attacker here is a real second process with its own
transfer engine and no token (``mooncake_peer.py``); the victims are a real trainer transport and
the suite's real engine. What these tests show is stopped: a sync that anyone else wrote into is
refused and nothing of it is loaded; nothing is registered between syncs; the ports answer on the
configured address only. What they show is not stopped (Mooncake cannot tell its peers apart): a
process on that address reads the bucket while the engines pull it (docs/design/security.md,
"Mooncake").
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

pytest.importorskip("mooncake.engine", reason="Mooncake's transfer engine is not installed (miles-mooncake[cpu])")

from miles_contracts.wire.auth import TOKEN_ENV  # noqa: E402
from miles_contracts.wire.listeners import new_listeners, wildcard_listeners  # noqa: E402
from miles_contracts.wire.mooncake import MOONCAKE_PATH, MooncakeError, open_transfer_engine  # noqa: E402
from miles_mooncake.transport import MooncakeTransport, engines_that_cannot_reach  # noqa: E402
from miles_weights.bench_models import load_tensors  # noqa: E402
from miles_weights.errors import WeightSyncError  # noqa: E402

PEER = Path(__file__).with_name("mooncake_peer.py")
POISON = 0x42  # the byte the outside peer writes: float32 48.56 in every weight


class OutsidePeer:
    """``mooncake_peer.py`` in its own process, started without the run's token."""

    def __enter__(self) -> OutsidePeer:
        env = {key: value for key, value in os.environ.items() if key != TOKEN_ENV}
        self.process = subprocess.Popen([sys.executable, str(PEER)], env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert json.loads(self._line()) == {"ready": True}
        return self

    def ask(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        answer: dict[str, Any] = json.loads(self._line())
        return answer

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the outside peer exited ({self.process.wait()})")
        return line

    def __exit__(self, *exc: object) -> None:
        self.process.kill()
        self.process.wait()


class PullWindow:
    """An HTTP hop between the trainer and the engine that passes every call on unchanged, except that
    before it passes a Mooncake bucket on (while the trainer's buffer is registered for the pull) it
    has the outside peer read the bucket's first bytes and, when ``overwrite`` is set, overwrite it."""

    def __init__(self, engine_url: str, peer: OutsidePeer) -> None:
        self.engine_url, self.peer = engine_url, peer
        self.overwrite = True
        self.seen: list[dict[str, Any]] = []  # per bucket: where it was and what the peer read
        window = self

        class Hop(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._pass_on()

            def do_POST(self) -> None:
                self._pass_on()

            def _pass_on(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path == MOONCAKE_PATH:
                    window.meddle(json.loads(body))
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
                answer = httpx.request(self.command, window.engine_url + self.path, content=body, headers=headers,
                                       timeout=120)
                self.send_response(answer.status_code)
                self.send_header("content-type", answer.headers.get("content-type", "application/json"))
                self.send_header("content-length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Hop)

    def meddle(self, bucket: dict[str, Any]) -> None:
        session, address, size = bucket["session_id"], bucket["address"], bucket["size"]
        read = self.peer.ask(f"read {session} {address} 64")
        self.seen.append({"session": session, "address": address, "read": read})
        if self.overwrite:
            assert self.peer.ask(f"write {session} {address} {size} {POISON}")["status"] == 0

    def __enter__(self) -> PullWindow:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def restored_engine(engine: Any) -> Iterator[Any]:
    """The suite's engine, resumed and back at its weight version after the test."""
    version = engine.target.weight_version
    yield engine
    engine.client.post("/continue_generation", json={})
    engine.client.post("/update_weight_version", json={"new_version": version})


def _checksums(engine: Any) -> dict[str, str]:
    checksums: dict[str, str] = engine.client.get("/weights_checksum").json()["checksums"]
    return checksums


@pytest.mark.slow
def test_a_process_without_the_token_cannot_change_what_an_engine_loads(restored_engine: Any, tiny_dense: Path) -> None:
    engine = restored_engine
    tensors = load_tensors(tiny_dense, engine.target.loaded.dtype, "cpu")  # what the engine holds already
    first_bytes = tensors[0][1].reshape(-1).view(torch.uint8)[:64].numpy().tobytes().hex()
    before = _checksums(engine)
    with OutsidePeer() as peer, PullWindow(engine.url, peer) as window, MooncakeTransport() as transport:
        with pytest.raises(WeightSyncError, match="do not match the digest") as caught:
            transport.push(tensors, targets=[window.url], version=7001)
        assert "nothing was loaded" in str(caught.value)
        assert _checksums(engine) == before  # the overwritten bucket was refused whole
        # not stopped: while the engines pull a bucket, a peer that reaches the port reads it
        assert window.seen[0]["read"] == {"status": 0, "hex": first_bytes}

        window.overwrite = False
        transport.push(tensors, targets=[window.url], version=7002)  # an untouched sync still goes through
        assert _checksums(engine) == before
        # between syncs nothing is registered: the trainer refuses the last bucket's address
        session, address = window.seen[-1]["session"], window.seen[-1]["address"]
        assert peer.ask(f"read {session} {address} 64")["status"] < 0
        assert peer.ask(f"write {session} {address} 64 {POISON}")["status"] < 0


def test_mooncake_ports_answer_only_on_the_configured_address() -> None:
    before = wildcard_listeners()
    engine, session = open_transfer_engine("127.0.0.1", "tcp")
    ports = []
    for fd in new_listeners(before):  # its handshake port and its TCP data port
        with socket.socket(fileno=os.dup(fd)) as listener:
            ports.append(listener.getsockname()[1])
    assert session == f"127.0.0.1:{engine.get_rpc_port()}" and engine.get_rpc_port() in ports and len(ports) >= 2
    for port in ports:
        socket.create_connection(("127.0.0.1", port), timeout=30).close()
        # 127.0.0.2 is this host too (all of 127/8 is): Mooncake bound every address, but a connection
        # made to any other than the configured one is dropped at its first packet and never answered
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", port), timeout=3).close()


def test_mooncake_refuses_an_address_that_is_not_this_hosts() -> None:
    with pytest.raises(MooncakeError, match="198.51.100.7.*not an address of this host"):
        open_transfer_engine("198.51.100.7", "tcp")


def test_engines_on_other_hosts_need_a_trainer_address_they_can_reach() -> None:
    local = ["http://127.0.0.1:30000", "http://localhost:30001"]
    other = "http://198.51.100.7:30000"  # a documentation address: never an address of this host
    assert engines_that_cannot_reach("127.0.0.1", [*local, other]) == [other]
    assert engines_that_cannot_reach("127.0.0.1", local) == []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # this host's address on its default route,
        probe.connect(("198.51.100.7", 9))  # found without sending a packet
        own = probe.getsockname()[0]
    assert engines_that_cannot_reach(own, [*local, other]) == []  # a network address: the operator's call


def test_a_mooncake_address_past_64_bits_is_a_400_that_says_so(engine: Any, tiny_dense: Path) -> None:
    name, tensor = load_tensors(tiny_dense, torch.float32, "cpu")[0]  # a tensor the engine has
    # shaped as the route took it before digests, so that an engine without the bound shows its 5xx
    body = {"session_id": "127.0.0.1:1", "address": 1 << 64, "size": tensor.nbytes,
            "tensors": [{"name": name, "dtype": "float32", "shape": list(tensor.shape), "offset": 0,
                         "nbytes": tensor.nbytes}]}
    answer = engine.client.post(MOONCAKE_PATH, json=body)
    assert answer.status_code == 400
    assert "address: Input should be less than 18446744073709551616" in answer.json()["detail"]
    answer = engine.client.post(MOONCAKE_PATH, json={**body, "address": 0, "size": 1 << 63})
    assert answer.status_code == 400 and "size: Input should be less than 9223372036854775808" in answer.json()["detail"]
    answer = engine.client.post(MOONCAKE_PATH, json={**body, "address": 0, "session_id": "no port"})
    assert answer.status_code == 400 and "session_id: String should match pattern" in answer.json()["detail"]
    answer = engine.client.post(MOONCAKE_PATH, json={**body, "address": 0})
    assert answer.status_code == 400 and "sha256: Field required" in answer.json()["detail"]
    digest = "0" * 64
    answer = engine.client.post(MOONCAKE_PATH, json={**body, "address": 0, "size": 1 << 62, "sha256": digest})
    assert answer.status_code == 400 and "cannot pull the bucket over Mooncake" in answer.json()["message"]
