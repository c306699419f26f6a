"""The bytes of ``Endpoint.get_metadata()``: Ferry engine metadata wrapped with
what UCCL's metadata also carries, the endpoint's GPU and its same-host name.

Layout (little endian), ours: ``"FUCL"``, u8 version (1), i32 local GPU index
(-1: none), u8 length + local name (ASCII; what ``parse_metadata`` returns as
the GPU identity and ``connect_local`` takes), u16 length + the Ferry engine
metadata, then zeros up to a multiple of 64 bytes, so that two endpoints of one
host have metadata of one length (UCCL's benchmark receives the peer's
metadata into a buffer as long as its own).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from ..._errors import InvalidArgument

_MAGIC = b"FUCL"
_VERSION = 1
_ALIGN = 64


@dataclass
class Envelope:
    gpu: int
    local_name: str
    engine_metadata: bytes


def wrap(gpu: int, local_name: str, engine_metadata: bytes) -> bytes:
    name = local_name.encode("ascii")
    body = (_MAGIC + struct.pack("<Bi", _VERSION, gpu) + struct.pack("<B", len(name)) + name
            + struct.pack("<H", len(engine_metadata)) + engine_metadata)
    return body + b"\0" * (-len(body) % _ALIGN)


def unwrap(data) -> Envelope:
    """Decode; plain Ferry engine metadata is accepted too (gpu -1, no name)."""
    data = bytes(data)
    if data[:4] != _MAGIC:
        if data[:4] == b"FRYM":
            return Envelope(-1, "", data)
        raise InvalidArgument(
            "not endpoint metadata of ferry.compat.uccl (bad magic; UCCL's own metadata "
            "cannot reach a Ferry endpoint)")
    try:
        version, gpu = struct.unpack_from("<Bi", data, 4)
        if version != _VERSION:
            raise InvalidArgument(f"endpoint metadata version {version} (expected {_VERSION})")
        (nlen,) = struct.unpack_from("<B", data, 9)
        name = data[10:10 + nlen]
        (mlen,) = struct.unpack_from("<H", data, 10 + nlen)
        start = 12 + nlen
        meta = data[start:start + mlen]
    except struct.error:
        raise InvalidArgument("endpoint metadata is truncated") from None
    if len(name) != nlen or len(meta) != mlen:
        raise InvalidArgument("endpoint metadata is truncated")
    if data[start + mlen:].strip(b"\0"):
        raise InvalidArgument("endpoint metadata has trailing bytes")
    return Envelope(gpu, name.decode("ascii", "replace"), meta)
