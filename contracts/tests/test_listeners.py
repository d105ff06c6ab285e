"""Holding a listener bound to every interface to one address, on real sockets (Linux: all of
127.0.0.0/8 is this host, so 127.0.0.2 stands in for "another address of this host")."""

from __future__ import annotations

import socket

import pytest
from miles_contracts.wire.listeners import (
    ListenerError,
    hold_to_address,
    local_address,
    new_listeners,
    wildcard_listeners,
)


def _dual_stack_listener() -> socket.socket:
    """Bound as Mooncake's TCP data port is: ``::`` taking IPv4 too."""
    listener = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    listener.bind(("::", 0))
    listener.listen()
    return listener


def test_a_held_listener_takes_connections_to_its_address_only() -> None:
    before = wildcard_listeners()
    with _dual_stack_listener() as listener, socket.socket() as bound_to_one:
        bound_to_one.bind(("127.0.0.1", 0))  # already bound to one address: left alone
        bound_to_one.listen()
        port = listener.getsockname()[1]
        early = socket.create_connection(("127.0.0.2", port), timeout=30)  # taken before the filter
        accepted, _ = listener.accept()
        assert new_listeners(before) == [listener.fileno()]

        hold_to_address(new_listeners(before), local_address("127.0.0.1"))

        with early, accepted:
            accepted.settimeout(30)
            assert accepted.recv(1) == b""  # shut down: it was made to another address
        with socket.create_connection(("127.0.0.1", port), timeout=30):
            pass
        for elsewhere in ("127.0.0.2", "::1"):  # dropped at the first packet, never answered
            with pytest.raises(OSError):
                socket.create_connection((elsewhere, port), timeout=3).close()


def test_an_address_this_host_does_not_have_is_refused_with_the_reason() -> None:
    assert local_address("127.0.0.1") == "127.0.0.1"
    with pytest.raises(ListenerError, match="198.51.100.7 .*is not an address of this host"):
        local_address("198.51.100.7")  # a documentation address; the check sends no packet
