"""The bytes of ``get_agent_metadata`` / ``get_partial_agent_metadata``: the agent's
name, how to reach its Ferry engine, and for each registered region the 64-byte
Ferry descriptor that grants access to it.

Layout (little endian): ``FNXM`` | u16 version | u8 flags (bit 0: connection
info present; bit 1: all of the agent's regions, not a partial list) | u16 name length | name | [u32 length | Ferry engine metadata] |
u32 region count | per region: u8 memory type, 3 pad bytes, u32 device, u64
address, u64 length, 64-byte descriptor.
"""
from __future__ import annotations

import struct

from ._regions import Region
from ._types import nixl_mem_t, nixlInvalidParamError

MAGIC = b"FNXM"
VERSION = 1
_HEAD = struct.Struct("<4sHBH")
_U32 = struct.Struct("<I")
_REGION = struct.Struct("<B3xIQQ64s")


class AgentMetadata:
    __slots__ = ("name", "engine", "regions", "full")

    def __init__(self, name: str, engine: bytes | None, regions: list, full: bool):
        self.name = name
        self.full = full          # every region of the agent (replaces what was known)
        self.engine = engine      # None in partial metadata without connection info
        self.regions = regions    # [Region] whose handle is the descriptor bytes


def encode(name: str, engine: bytes | None, regions, full: bool) -> bytes:
    """`regions`: (mem, address, length, device, descriptor) for each region."""
    raw = name.encode()
    flags = (1 if engine is not None else 0) | (2 if full else 0)
    parts = [_HEAD.pack(MAGIC, VERSION, flags, len(raw)), raw]
    if engine is not None:
        parts += [_U32.pack(len(engine)), engine]
    regions = list(regions)
    parts.append(_U32.pack(len(regions)))
    for mem, address, length, device, desc in regions:
        parts.append(_REGION.pack(int(mem), int(device), int(address), int(length), bytes(desc)))
    return b"".join(parts)


def decode(data) -> AgentMetadata:
    data = bytes(data)

    def bad(why: str):
        return nixlInvalidParamError(f"agent metadata ({len(data)} bytes) is not Ferry NIXL "
                                     f"metadata: {why}")
    if len(data) < _HEAD.size:
        raise bad(f"shorter than its {_HEAD.size}-byte header")
    magic, version, flags, nlen = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise bad(f"magic {magic!r}, expected {MAGIC!r} (metadata of real NIXL cannot be "
                  "loaded by ferry.compat.nixl)")
    if version != VERSION:
        raise bad(f"version {version}, this build reads version {VERSION}")
    pos = _HEAD.size
    if pos + nlen > len(data):
        raise bad("truncated in the agent name")
    name = data[pos:pos + nlen].decode(errors="replace")
    pos += nlen
    engine = None
    if flags & 1:
        if pos + 4 > len(data):
            raise bad("truncated before the engine metadata")
        (elen,) = _U32.unpack_from(data, pos)
        pos += 4
        if pos + elen > len(data):
            raise bad("truncated in the engine metadata")
        engine = data[pos:pos + elen]
        pos += elen
    if pos + 4 > len(data):
        raise bad("truncated before the region count")
    (count,) = _U32.unpack_from(data, pos)
    pos += 4
    if pos + count * _REGION.size != len(data):
        raise bad(f"{count} regions need {count * _REGION.size} bytes, "
                  f"{len(data) - pos} are there")
    regions = []
    for _ in range(count):
        mem, device, address, length, desc = _REGION.unpack_from(data, pos)
        pos += _REGION.size
        try:
            mem = nixl_mem_t(mem)
        except ValueError:
            raise bad(f"unknown memory type {mem}") from None
        regions.append(Region(mem, address, length, device, desc))
    return AgentMetadata(name, engine, regions, bool(flags & 2))
