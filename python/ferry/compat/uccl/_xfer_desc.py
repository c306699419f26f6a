"""``XferDesc``: the descriptor of UCCL's ``register_memory`` / ``transfer`` API,
and its byte form (``get_serialized_descs`` / ``deserialize_descs``).

A descriptor names ``[addr, addr+size)`` of the registering process. ``mr_id`` is
that endpoint's handle (distinct per ``register_memory`` call), ``lkeys`` /
``rkeys`` identify the underlying Ferry region (equal for two descriptors served
by one cached registration), and ``ferry`` holds the 64-byte Ferry descriptor a
peer needs to reach the range. Attribute access (UCCL's current API) and item
access (``desc["addr"]``, UCCL's older dict form) both work.

Byte layout (little endian), ours: ``"FXD1"``, u32 count, then per descriptor
u64 addr, u64 size, u64 mr_id, u16 n + n x u32 lkeys, u16 n + n x u32 rkeys,
u16 length + Ferry descriptor bytes (0 or 64).
"""
from __future__ import annotations

import struct

from ..._ferry import DESCRIPTOR_SIZE
from ._types import UINT64_MAX, BadArgument

_MAGIC = b"FXD1"
_FIELDS = ("addr", "size", "mr_id", "lkeys", "rkeys")


class XferDesc:
    """One registered range: ``addr``, ``size``, ``mr_id``, ``lkeys``, ``rkeys``
    (UCCL's fields) and ``ferry`` (the Ferry descriptor bytes, b"" if none)."""

    __slots__ = ("addr", "size", "mr_id", "lkeys", "rkeys", "ferry")

    def __init__(self, addr: int = 0, size: int = 0, mr_id: int = UINT64_MAX,
                 lkeys=None, rkeys=None, ferry: bytes = b""):
        self.addr = int(addr)
        self.size = int(size)
        self.mr_id = int(mr_id)
        self.lkeys = list(lkeys or [])
        self.rkeys = list(rkeys or [])
        self.ferry = bytes(ferry)

    # UCCL's older API returned dicts: keep item access working.
    def __getitem__(self, name: str):
        if name not in _FIELDS and name != "ferry":
            raise KeyError(name)
        return getattr(self, name)

    def __contains__(self, name: object) -> bool:
        return name in _FIELDS or name == "ferry"

    def keys(self):
        return list(_FIELDS)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, XferDesc):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in self.__slots__)

    __hash__ = None  # mutable, like UCCL's

    def __repr__(self) -> str:
        return f"<XferDesc addr={self.addr} size={self.size} mr_id={self.mr_id}>"


def as_desc(obj, what: str) -> XferDesc:
    """An XferDesc from an XferDesc or a dict with UCCL's keys."""
    if isinstance(obj, XferDesc):
        return obj
    if isinstance(obj, dict):
        try:
            return XferDesc(obj["addr"], obj["size"], obj.get("mr_id", UINT64_MAX),
                            obj.get("lkeys"), obj.get("rkeys"), obj.get("ferry", b""))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadArgument(f"{what}: not a transfer descriptor ({exc})") from None
    raise BadArgument(f"{what}: expected an XferDesc (from register_memory or "
                      f"deserialize_descs), got {type(obj).__name__}")


def serialize(descs) -> bytes:
    descs = [as_desc(d, f"get_serialized_descs(): item {i}") for i, d in enumerate(descs)]
    out = [_MAGIC, struct.pack("<I", len(descs))]
    for d in descs:
        if len(d.lkeys) > 0xFFFF or len(d.rkeys) > 0xFFFF:
            raise BadArgument("get_serialized_descs(): too many keys in a descriptor")
        out.append(struct.pack("<QQQ", d.addr, d.size, d.mr_id & UINT64_MAX))
        out.append(struct.pack(f"<H{len(d.lkeys)}I", len(d.lkeys), *d.lkeys))
        out.append(struct.pack(f"<H{len(d.rkeys)}I", len(d.rkeys), *d.rkeys))
        out.append(struct.pack("<H", len(d.ferry)) + d.ferry)
    return b"".join(out)


def deserialize(data) -> list[XferDesc]:
    data = bytes(data)
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if pos + n > len(data):
            raise BadArgument(f"deserialize_descs(): truncated at byte {pos} of {len(data)} "
                              f"(reading {what})")
        chunk = data[pos:pos + n]
        pos += n
        return chunk

    if take(4, "the magic") != _MAGIC:
        raise BadArgument("deserialize_descs(): not Ferry transfer descriptors (bad magic; "
                          "pass the bytes of get_serialized_descs() of a ferry.compat.uccl "
                          "endpoint)")
    (count,) = struct.unpack("<I", take(4, "the count"))
    if count > len(data):  # each takes far more than one byte
        raise BadArgument(f"deserialize_descs(): count {count} exceeds the data")
    out = []
    for i in range(count):
        addr, size, mr_id = struct.unpack("<QQQ", take(24, f"descriptor {i}"))
        keys = []
        for name in ("lkeys", "rkeys"):
            (n,) = struct.unpack("<H", take(2, f"descriptor {i} {name}"))
            keys.append(list(struct.unpack(f"<{n}I", take(4 * n, f"descriptor {i} {name}"))))
        (blen,) = struct.unpack("<H", take(2, f"descriptor {i} length"))
        if blen not in (0, DESCRIPTOR_SIZE):
            raise BadArgument(f"deserialize_descs(): descriptor {i} has a {blen}-byte Ferry "
                              f"descriptor (expected {DESCRIPTOR_SIZE})")
        blob = take(blen, f"descriptor {i} Ferry descriptor")
        out.append(XferDesc(addr, size, mr_id, keys[0], keys[1], blob))
    if pos != len(data):
        raise BadArgument(f"deserialize_descs(): {len(data) - pos} trailing bytes after "
                          f"{count} descriptors")
    return out
