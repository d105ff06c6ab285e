"""The mooncake transport's own rules. Its syncs into real engines (conformance suite, check mode,
rejected buckets, unreachable engines) run with every other transport in
``packages/miles-weights/tests/test_transports_e2e.py``."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from miles.config import ConfigError, build_config
from miles.context import context_for
from miles_contracts import Process
from miles_mooncake.settings import MooncakeSection
from miles_mooncake.transport import MooncakeTransport
from miles_weights.errors import WeightSyncError


class SGLangLike(BaseHTTPRequestHandler):
    """Answers /server_info as SGLang does (no ``engine`` key) and records every request: a stand-in
    for a real SGLang server, which needs CUDA."""

    seen: list[str] = []

    def do_GET(self) -> None:
        self.seen.append(self.path)
        body = json.dumps({"tp_size": 2, "version": "0.5.13.post1"}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


def test_engines_without_a_mooncake_route_are_refused_before_anything_pauses():
    server = ThreadingHTTPServer(("127.0.0.1", 0), SGLangLike)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with MooncakeTransport() as transport, pytest.raises(WeightSyncError, match="broadcast") as caught:
            transport.push([("w", torch.ones(4))], targets=[url], version=1)
        assert url in str(caught.value)
        assert SGLangLike.seen == ["/server_info"]  # asked what it is; never paused
    finally:
        server.shutdown()


def test_the_mooncake_section_and_transport_are_registered():
    kernel = context_for().kernel
    cfg = build_config({"weights": {"transport": "mooncake"}, "mooncake": {"protocol": "rdma", "device_name": "mlx5_0"}},
                       kernel=kernel)
    spec = kernel.weight_transports().get("mooncake")
    assert not spec.needs_shared_gpu  # engines pull over the network: any placement
    transport = spec.create(context_for(cfg, Process.trainer_rank(0), kernel=kernel))
    try:
        assert isinstance(transport, MooncakeTransport)
        assert (transport.protocol, transport.device_name) == ("rdma", "mlx5_0")
    finally:
        transport.close()
    assert MooncakeSection().protocol == "tcp"
    with pytest.raises(ConfigError, match="protocol"):
        build_config({"mooncake": {"protocol": "udp"}}, kernel=kernel)
