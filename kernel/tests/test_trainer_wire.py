"""Frames between the driver and trainer ranks: tensors and batches arrive bit-exact, and a peer
cannot make the reader unpickle, allocate without bound, or build anything off the allow-list."""

from __future__ import annotations

import json
import socket
import struct
from pathlib import Path

import pytest
import torch
from miles.trainer import wire
from miles_contracts import TrainBatch, TransferReport


@pytest.fixture()
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100, (3, 7), generator=gen)
    return TrainBatch(
        tokens=tokens, attention_mask=torch.ones_like(tokens), loss_mask=torch.rand(3, 7, generator=gen),
        rollout_logprobs=-torch.rand(3, 7, generator=gen), rewards=torch.tensor([1.0, 0.0, 0.5]),
        group_ids=torch.tensor([0, 0, 1]), rollout_ids=torch.tensor([0, 1, 2]),
        advantages=torch.randn(3, 7, generator=gen).to(torch.bfloat16),
        extras={"experts": torch.randint(0, 8, (3, 7, 2, 2), dtype=torch.int32, generator=gen)},
    )


def test_a_batch_and_nested_values_arrive_bit_exact(pair) -> None:
    a, b = pair
    batch = _batch()
    value = {"batch": batch, "path": Path("/tmp/x"), "flags": [True, None, 1.5, "s"], "$tensor": 3,
             "empty": torch.zeros(0, 4), "mask": torch.tensor([True, False]), "scalar": torch.tensor(2.5)}
    wire.send(a, {"kind": "call", "id": 7, "method": "train_step"}, value)
    got = wire.receive(b)
    assert got["kind"] == "call" and got["id"] == 7
    out = got["value"]
    assert out["path"] == Path("/tmp/x") and out["flags"] == [True, None, 1.5, "s"] and out["$tensor"] == 3
    assert isinstance(out["batch"], TrainBatch)
    for name in ("tokens", "attention_mask", "loss_mask", "rollout_logprobs", "rewards", "group_ids", "advantages"):
        sent, received = getattr(batch, name), getattr(out["batch"], name)
        assert received.dtype == sent.dtype and torch.equal(received, sent), name
    assert out["batch"].old_logprobs is None
    assert torch.equal(out["batch"].extras["experts"], batch.extras["experts"])
    assert out["empty"].shape == (0, 4) and torch.equal(out["mask"], value["mask"]) and out["scalar"].item() == 2.5


def test_one_frame_goes_to_several_peers_and_a_report_round_trips() -> None:
    report = TransferReport(version=3, num_tensors=2, num_bytes=10, seconds=0.5)
    frame = wire.Frame({"kind": "reply"}, {"report": report, "t": torch.arange(5)})
    for _ in range(2):
        a, b = socket.socketpair()
        frame.send(a)
        got = wire.receive(b)["value"]
        assert got["report"] == report and torch.equal(got["t"], torch.arange(5))
        a.close()
        b.close()


def _raw(sock: socket.socket, header: dict, payload: bytes = b"", magic: bytes = wire.MAGIC) -> None:
    body = json.dumps(header).encode()
    sock.sendall(struct.pack("!4sIQ", magic, len(body), len(payload)) + body + payload)


@pytest.mark.parametrize(("header", "payload", "match"), [
    ({"value": {"$dc": "Popen", "fields": {}}}, b"", "unknown dataclass 'Popen'"),
    ({"value": {"$tensor": 0}, "tensors": [["object", [1], 0, 8]]}, bytes(8), "unknown dtype"),
    ({"value": {"$tensor": 0}, "tensors": [["float32", [4], 0, 16]]}, bytes(8), "outside the payload"),
    ({"value": {"$tensor": 1}, "tensors": [["float32", [2], 0, 8]]}, bytes(8), "out of range"),
])
def test_what_the_reader_refuses(pair, header, payload, match) -> None:
    a, b = pair
    _raw(a, header, payload)
    with pytest.raises(wire.WireError, match=match):
        wire.receive(b)


def test_a_pickle_is_not_a_frame_and_headers_are_bounded(pair) -> None:
    import pickle

    a, b = pair
    a.sendall(pickle.dumps({"kind": "hello"}).ljust(16, b"\0"))
    with pytest.raises(wire.WireError, match="not a Miles trainer frame"):
        wire.receive(b)
    c, d = socket.socketpair()
    c.sendall(struct.pack("!4sIQ", wire.MAGIC, 1 << 30, 0))  # announces 1 GiB of header, sends none
    with pytest.raises(wire.WireError, match="frame too large"):
        wire.receive(d, max_header=64 << 10)
    c.close()
    d.close()


def test_a_closed_peer_between_frames_and_mid_frame(pair) -> None:
    a, b = pair
    _raw(a, {"value": 1})
    a.sendall(wire.MAGIC)  # half a prefix
    a.close()
    assert wire.receive(b)["value"] == 1
    with pytest.raises(wire.WireError, match="mid-frame"):
        wire.receive(b)
    c, d = socket.socketpair()
    c.close()
    with pytest.raises(wire.PeerClosed):
        wire.receive(d)
    d.close()


def test_values_that_cannot_cross_are_refused_before_sending() -> None:
    with pytest.raises(TypeError, match="cannot send a set"):
        wire.Frame({"kind": "call"}, {"x": {1, 2}})
    with pytest.raises(TypeError, match="only str keys"):
        wire.Frame({"kind": "call"}, {1: 2})


def test_an_unauthenticated_peer_cannot_make_the_reader_allocate_or_recurse(pair) -> None:
    a, b = pair
    a.sendall(struct.pack("!4sIQ", wire.MAGIC, 2, 1 << 40))  # a tiny header announcing 1 TiB of payload
    with pytest.raises(wire.WireError, match=r"payload 1099511627776 \(limit 0\)"):
        wire.receive(b, max_header=64 << 10, max_payload=0)
    c, d = socket.socketpair()
    nested = b"[" * 60_000  # nested past the JSON parser's recursion limit
    c.sendall(struct.pack("!4sIQ", wire.MAGIC, len(nested), 0) + nested)
    with pytest.raises(wire.WireError, match="not JSON: RecursionError"):
        wire.receive(d, max_header=64 << 10, max_payload=0)
    c.close()
    d.close()


def test_the_handshake_admits_each_rank_once_and_only_with_the_secret() -> None:
    from miles.placement import Node, Placement, Slot
    from miles.trainer.group import TrainerGroup

    node = Node("n", "127.0.0.1", ())
    group = TrainerGroup(executor=None, placement=Placement((Slot(node), Slot(node)), (), (), colocated=False),
                         config_data={})

    listener = socket.create_server(("127.0.0.1", 0))

    def tcp_pair() -> tuple[socket.socket, socket.socket]:  # the ranks connect over TCP (TCP_NODELAY)
        client = socket.create_connection(listener.getsockname())
        return client, listener.accept()[0]

    def hello(**fields) -> int | None:
        a, b = tcp_pair()
        try:
            wire.send(a, {"kind": "hello", **fields})
            return group._authenticate(b)
        finally:
            a.close()
            b.close()

    secret = group._secret
    assert hello(secret="wrong", rank=0) is None
    assert hello(rank=0) is None
    assert hello(secret=secret, rank=2) is None  # a world of 2
    assert hello(secret=secret, rank="0") is None
    assert hello(secret=secret, rank=1) == 1
    group._socks[1] = None  # rank 1 joined
    assert hello(secret=secret, rank=1) is None  # not twice
    a, b = tcp_pair()
    a.sendall(struct.pack("!4sIQ", wire.MAGIC, 2, 1 << 40))
    assert group._authenticate(b) is None  # refused before allocating, the accept loop goes on
    a.close()
    b.close()
    listener.close()
