"""What Endpoint.accept() learns about a peer: its GPU index from the hello that a
connecting UCCL endpoint sends, and its ip from the connection that really reaches it.

A peer shows up in ``Engine.peers()`` as soon as any transport reaches it -- often
shm, which has no ip -- and our side records its tcp connection a moment after the
connecting side's ``connect`` returned (the handshake's last reply is sent first).
So the ip comes from the tcp connection once it is listed, and the hello says
whether the sender's tcp is up, i.e. whether ours is to be waited for.
"""
from __future__ import annotations

import ipaddress
import struct

HELLO = b"\0ferry-uccl-hello\0"
_TCP_UP = 1  # hello flag: the sender's tcp transport is connected to the receiver


def hello(gpu: int, tcp_up: bool) -> bytes:
    """The hello payload: GPU index (i32) and flags (u8)."""
    return HELLO + struct.pack("<iB", gpu, _TCP_UP if tcp_up else 0)


def parse_hello(payload: bytes):
    """(gpu, tcp_up) of a hello, else None. tcp_up is None for the older form
    (GPU index alone), which says nothing about tcp."""
    if not payload.startswith(HELLO):
        return None
    rest = payload[len(HELLO):]
    if len(rest) == 4:
        return struct.unpack("<i", rest)[0], None
    if len(rest) == 5:
        gpu, flags = struct.unpack("<iB", rest)
        return gpu, bool(flags & _TCP_UP)
    return None


def tcp_connected(transports) -> bool:
    """transports: ``Engine.peer_transports(pid)``."""
    return any(t["transport"] == "tcp" and t["connected"] for t in transports)


def network_ip(transports) -> str | None:
    """The peer's ip as a connected network transport reports it: tcp's, else another
    one's (fabric: "fi_sockaddr_in://ip:port"); None while only same-host
    transports (shm: "pid … via …") reach it."""
    other = None
    for t in transports:
        ip = _ip_of(t["via"]) if t["connected"] else None
        if ip is None:
            continue
        if t["transport"] == "tcp":
            return ip
        other = other or ip
    return other


def _ip_of(via: str) -> str | None:
    host, sep, port = via.split("://", 1)[-1].rpartition(":")
    if not sep or not port.isdigit():
        return None
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return host
