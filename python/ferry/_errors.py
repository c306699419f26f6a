"""Exception classes: one per engine status code, all subclasses of FerryError.

Every exception carries the engine's message (``str(exc)`` / ``exc.message``)
and its status code (``exc.code``, a :class:`ferry.StatusCode`).
"""
from __future__ import annotations

from ._ferry import StatusCode


class FerryError(Exception):
    """Base class of every error the Ferry engine reports."""

    code: StatusCode = StatusCode.Internal

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        return self.message


class InvalidArgument(FerryError, ValueError):
    """The caller passed something malformed."""
    code = StatusCode.InvalidArgument


class NotFound(FerryError, LookupError):
    """A region, peer or transfer does not exist (or no longer does)."""
    code = StatusCode.NotFound


class PermissionDenied(FerryError):
    """Key mismatch, or the access (read/write) was not granted."""
    code = StatusCode.PermissionDenied


class OutOfRange(FerryError, IndexError):
    """[offset, offset+length) lies outside the region or the advertised range."""
    code = StatusCode.OutOfRange


class PeerDisconnected(FerryError, ConnectionError):
    """The peer closed, died or stopped answering."""
    code = StatusCode.PeerDisconnected


class Timeout(FerryError, TimeoutError):
    """A wait ran out of time."""
    code = StatusCode.Timeout


class Cancelled(FerryError):
    """The transfer was cancelled."""
    code = StatusCode.Cancelled


class NotSupported(FerryError, NotImplementedError):
    """A feature missing in this build, on this machine or on this transport."""
    code = StatusCode.NotSupported


class Busy(FerryError):
    """Transient: retry later."""
    code = StatusCode.Busy


class ProtocolError(FerryError):
    """The peer sent something that breaks the wire contract."""
    code = StatusCode.ProtocolError


class InternalError(FerryError):
    """A bug or an unexpected system failure."""
    code = StatusCode.Internal


for _cls in (FerryError, InvalidArgument, NotFound, PermissionDenied, OutOfRange,
             PeerDisconnected, Timeout, Cancelled, NotSupported, Busy, ProtocolError,
             InternalError):
    _cls.__module__ = "ferry"
del _cls

ERROR_CLASSES = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, PermissionDenied, OutOfRange, PeerDisconnected,
                Timeout, Cancelled, NotSupported, Busy, ProtocolError, InternalError)
}


def error_for(code, message: str = "") -> FerryError:
    """The exception instance for a status code (for code that maps codes itself)."""
    return ERROR_CLASSES.get(StatusCode(code), FerryError)(message)
