"""Hold a library's listening sockets to one local address, when the library binds every interface.

Mooncake's transfer engine listens on ``0.0.0.0`` / ``::`` whatever hostname it is given (its
handshake port and its TCP data port alike), and offers no setting to change that. A listening
socket can still be narrowed after the fact: a classic BPF socket filter (``SO_ATTACH_FILTER``)
that passes only packets addressed to the chosen address. The kernel runs it on every packet
before the TCP state machine, so a connection attempt to any other address of the host (another
interface, ``127.0.0.2``) is dropped at its first packet and never reaches ``accept``, which is what
``bind(address)`` would have given. Connections the library accepted before the filter was attached
are shut down when they were not made to that address. No privilege is needed; Linux only.

    before = wildcard_listeners()
    start_the_library()
    hold_to_address(new_listeners(before), "127.0.0.1")
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import stat
from collections.abc import Iterable, Iterator

SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>; the same on every architecture Mooncake builds for
_NETWORK_HEADER = 0xFFF00000  # SKF_NET_OFF: offsets from the IP header, whatever the socket's layer
# classic BPF opcodes (<linux/filter.h>)
_LOAD_BYTE, _LOAD_WORD, _SHIFT_RIGHT, _JUMP_IF_EQUAL, _RETURN = 0x30, 0x20, 0x74, 0x15, 0x06
_ACCEPT, _DROP = 0xFFFFFFFF, 0


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class ListenerError(RuntimeError):
    """A listening socket could not be held to its address (the message says which and why)."""


class _Instruction(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_Instruction))]


def local_address(host: str) -> str:
    """``host`` as an IP address of this machine; :class:`ListenerError` when it names none."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0]
    except socket.gaierror as exc:
        raise ListenerError(f"cannot resolve {host!r} ({exc}); give an IP address of this host") from exc
    address = str(sockaddr[0])
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))  # the kernel refuses an address no interface of this host has
    except OSError as exc:
        raise ListenerError(f"{host} ({address}) is not an address of this host ({exc.strerror}); give one "
                            "of its own addresses: 127.0.0.1, or its address on the network its peers share") from exc
    return address


def wildcard_listeners() -> dict[int, int]:
    """This process's listening TCP sockets bound to every interface: socket inode -> a descriptor."""
    return {inode: fd for inode, fd, sock in _sockets() if _is_wildcard_listener(sock)}


def new_listeners(before: dict[int, int]) -> list[int]:
    """Descriptors of the wildcard listeners opened since ``before`` (:func:`wildcard_listeners`)."""
    return [fd for inode, fd in wildcard_listeners().items() if inode not in before]


def hold_to_address(fds: Iterable[int], address: str) -> None:
    """Let the listening sockets ``fds`` take connections made to ``address`` only, and shut down the
    connections they already took to any other address."""
    ip = ipaddress.ip_address(address)
    for fd in fds:
        with _borrowed(fd) as sock:
            port = sock.getsockname()[1]
            try:
                _attach_address_filter(sock, ip)
            except OSError as exc:
                raise ListenerError(f"cannot hold the listener on port {port} to {address}: {exc}") from exc
        _shut_down_accepted(port, ip)


def _attach_address_filter(sock: socket.socket, ip: IPAddress) -> None:
    """Pass packets of ``ip``'s IP version whose destination is ``ip``; drop the rest."""
    words = [int.from_bytes(ip.packed[i: i + 4], "big") for i in range(0, len(ip.packed), 4)]
    destination = 16 if ip.version == 4 else 24  # the destination's offset in an IPv4 / IPv6 header
    drop = 3 + 2 * len(words) + 1  # index of the last instruction
    code = [(_LOAD_BYTE, 0, 0, _NETWORK_HEADER), (_SHIFT_RIGHT, 0, 0, 4),  # the version nibble
            (_JUMP_IF_EQUAL, 0, drop - 3, ip.version)]
    for i, word in enumerate(words):
        here = len(code)
        code += [(_LOAD_WORD, 0, 0, _NETWORK_HEADER + destination + 4 * i),
                 (_JUMP_IF_EQUAL, 0, drop - (here + 2), word)]
    code += [(_RETURN, 0, 0, _ACCEPT), (_RETURN, 0, 0, _DROP)]
    instructions = (_Instruction * len(code))(*(_Instruction(*c) for c in code))
    # the kernel copies the instructions during the call, while `instructions` is alive
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(_Program(len(code), instructions)))


def _sockets() -> Iterator[tuple[int, int, socket.socket]]:
    """This process's sockets: (inode, descriptor, a borrowed socket object closed after its turn)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            info = os.fstat(int(name))
            if not stat.S_ISSOCK(info.st_mode):
                continue
            borrowed = _borrowed(int(name))
        except OSError:  # closed since the listing (the listing's own descriptor, for one)
            continue
        with borrowed as sock:
            yield info.st_ino, int(name), sock


def _is_wildcard_listener(sock: socket.socket) -> bool:
    try:
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return False
        return _ip(sock.getsockname()[0]).is_unspecified
    except (OSError, ValueError, TypeError, IndexError):  # not an IP socket
        return False


def _shut_down_accepted(port: int, ip: IPAddress) -> None:
    """Connections accepted on ``port`` before its filter was attached, made to an address other than ``ip``."""
    for _, _, sock in _sockets():
        try:
            local = sock.getsockname()
            sock.getpeername()  # connected
            if local[1] == port and _ip(local[0]) != ip:
                sock.shutdown(socket.SHUT_RDWR)
        except (OSError, ValueError, TypeError, IndexError):  # not connected, or not an IP socket
            continue


def _ip(host: str) -> IPAddress:
    ip = ipaddress.ip_address(host.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # an IPv4 peer of a dual-stack socket
    return ip


class _borrowed:
    """A socket object over a duplicate of ``fd``: options and shutdown act on the shared socket, and
    closing it leaves the owner's descriptor open."""

    def __init__(self, fd: int) -> None:
        duplicate = os.dup(fd)
        try:
            self.sock = socket.socket(fileno=duplicate)
        except OSError:
            os.close(duplicate)
            raise

    def __enter__(self) -> socket.socket:
        return self.sock

    def __exit__(self, *exc: object) -> None:
        self.sock.close()
