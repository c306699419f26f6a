"""UCCL's small types: ``FloatType`` (the compression hint of ``reg``) and the
errors that UCCL raises as ``RuntimeError`` (kept Ferry errors as well)."""
from __future__ import annotations

import enum

from ..._errors import InvalidArgument, NotFound

UINT64_MAX = (1 << 64) - 1


class FloatType(enum.IntEnum):
    """Element type hint passed to ``Endpoint.reg`` (UCCL compresses with it; Ferry
    accepts and ignores it). Values are UCCL's."""

    kUndefined = 0
    kFloat16 = 1
    kBFloat16 = 2
    kFloat32 = 3
    kFloat8E4M3FN = 4
    kFloat8E5M2 = 5


class InvalidConnId(NotFound, RuntimeError):
    """A conn_id this endpoint does not know (never made, or removed).

    A ``ferry.NotFound`` and, as UCCL raises it, a ``RuntimeError``; the message
    starts with UCCL's words "Invalid conn_id"."""


class BadArgument(InvalidArgument, RuntimeError):
    """A malformed argument where UCCL raises ``RuntimeError`` (a non-tensor in
    ``register_memory``, undecodable descriptor bytes, an unknown op name)."""
