"""The bytes of ``Endpoint.get_metadata()``: Ferry engine metadata wrapped with
what UCCL's metadata also carries, the endpoint's GPU and its same-host name.

Layout (little endian), ours: ``"FUCL"``, u8 version (2), i32 local GPU index
(-1: none; the endpoint's own numbering), u8 length + local name (ASCII; the
endpoint's same-host name), u16 length + the Ferry engine metadata, u8 length +
the GPU's PCI bus id (ASCII, ``"0000:18:00.0"``, empty without a GPU), then
zeros up to a multiple of 64 bytes, so that two endpoints of one host have
metadata of one length (UCCL's benchmark receives the peer's metadata into a
buffer as long as its own).

The PCI bus id is the GPU identity ``parse_metadata`` returns, as UCCL's does:
processes launched with different ``CUDA_VISIBLE_DEVICES`` number GPUs
differently, but agree on what the bus id names. Version 1 (no bus id) is read.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from ..._errors import InvalidArgument

_MAGIC = b"FUCL"
_VERSION = 2
_VERSION_NO_BDF = 1
_ALIGN = 64


@dataclass
class Envelope:
    gpu: int
    local_name: str
    engine_metadata: bytes
    gpu_bdf: str = ""  # the GPU's PCI bus id; "" without a GPU (or from version 1)


def wrap(gpu: int, local_name: str, engine_metadata: bytes, gpu_bdf: str = "") -> bytes:
    name = local_name.encode("ascii")
    bdf = gpu_bdf.encode("ascii")
    body = (_MAGIC + struct.pack("<Bi", _VERSION, gpu) + struct.pack("<B", len(name)) + name
            + struct.pack("<H", len(engine_metadata)) + engine_metadata
            + struct.pack("<B", len(bdf)) + bdf)
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
        if version not in (_VERSION, _VERSION_NO_BDF):
            raise InvalidArgument(f"endpoint metadata version {version} (this build reads "
                                  f"{_VERSION_NO_BDF} and {_VERSION})")
        (nlen,) = struct.unpack_from("<B", data, 9)
        name = data[10:10 + nlen]
        (mlen,) = struct.unpack_from("<H", data, 10 + nlen)
        start = 12 + nlen
        meta = data[start:start + mlen]
        end, bdf = start + mlen, b""
        if version == _VERSION:
            (blen,) = struct.unpack_from("<B", data, end)
            bdf = data[end + 1:end + 1 + blen]
            if len(bdf) != blen:
                raise InvalidArgument("endpoint metadata is truncated")
            end += 1 + blen
    except struct.error:
        raise InvalidArgument("endpoint metadata is truncated") from None
    if len(name) != nlen or len(meta) != mlen:
        raise InvalidArgument("endpoint metadata is truncated")
    if data[end:].strip(b"\0"):
        raise InvalidArgument("endpoint metadata has trailing bytes")
    return Envelope(gpu, name.decode("ascii", "replace"), meta, bdf.decode("ascii", "replace"))
