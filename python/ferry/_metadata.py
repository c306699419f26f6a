"""Decoding of engine metadata (the bytes of ``Engine.metadata()``), for tools and
the UCCL compatibility layer.

Layout (little endian, see src/core/metadata.h): ``"FRYM"``, u16 format version,
u16 protocol version, u64 engine id, str16 hostname, str16 host id (the kernel's boot
id unless ``engine.host_id`` overrides it), u16 transport count, then per
transport str16 name + u32 length + blob, then a u32 crc32 of everything before.
The tcp blob is text: ``"ip:port"`` or ``"[ipv6]:port"``, comma separated when the
engine listens on a wildcard address.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

from ._errors import InvalidArgument

_MAGIC = b"FRYM"


@dataclass
class MetadataInfo:
    engine_id: int
    format_version: int
    protocol_version: int
    hostname: str
    host_id: str = ""
    transports: dict = field(default_factory=dict)  # name -> blob (bytes)

    @property
    def tcp_addresses(self) -> list[tuple[str, int]]:
        """[(ip, port), ...] the engine's tcp transport listens on."""
        blob = self.transports.get("tcp", b"")
        out = []
        for item in blob.decode("utf-8", "replace").split(","):
            item = item.strip()
            if not item:
                continue
            host, _, port = item.rpartition(":")
            if host.startswith("[") and host.endswith("]"):
                host = host[1:-1]
            try:
                out.append((host, int(port)))
            except ValueError as exc:
                raise InvalidArgument(f"bad tcp address {item!r} in engine metadata") from exc
        return out


def parse_metadata(data: bytes) -> MetadataInfo:
    """Decode engine metadata; raises ferry.InvalidArgument if it is malformed."""
    data = bytes(data)
    if len(data) < 4 + 2 + 2 + 8 + 2 + 2 + 2 + 4 or data[:4] != _MAGIC:
        raise InvalidArgument("not Ferry engine metadata (bad magic or too short)")
    body, (crc,) = data[:-4], struct.unpack("<I", data[-4:])
    if zlib.crc32(body) & 0xFFFFFFFF != crc:
        raise InvalidArgument("engine metadata checksum mismatch")
    pos = 4

    def take(n: int) -> bytes:
        nonlocal pos
        if pos + n > len(body):
            raise InvalidArgument("truncated engine metadata")
        chunk = body[pos:pos + n]
        pos += n
        return chunk

    fmt_version, proto = struct.unpack("<HH", take(4))
    (engine_id,) = struct.unpack("<Q", take(8))
    (n,) = struct.unpack("<H", take(2))
    hostname = take(n).decode("utf-8", "replace")
    (n,) = struct.unpack("<H", take(2))
    host_id = take(n).decode("utf-8", "replace")
    (count,) = struct.unpack("<H", take(2))
    transports = {}
    for _ in range(count):
        (n,) = struct.unpack("<H", take(2))
        name = take(n).decode("utf-8", "replace")
        (blen,) = struct.unpack("<I", take(4))
        transports[name] = take(blen)
    return MetadataInfo(engine_id, fmt_version, proto, hostname, host_id, transports)
