"""NIXL's enums, constants and exception classes, as ``nixl._bindings`` has them.

The values are Ferry's own; code compares them by name (``nixl._bindings.DRAM_SEG``),
never by number.
"""
from __future__ import annotations

import enum

from ... import _errors

NIXL_INIT_AGENT = ""          # the agent name that means "local side" in prep_xfer_dlist
DEFAULT_COMM_PORT = 8888       # NIXL's default metadata listener port
HAVE_UCX_GPU_DEVICE_API = False  # no UCX device API under Ferry (prep_mem_view)


class nixl_mem_t(enum.IntEnum):
    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


class nixl_xfer_op_t(enum.IntEnum):
    NIXL_READ = 0
    NIXL_WRITE = 1


class nixl_status_t(enum.IntEnum):
    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9
    NIXL_ERR_REMOTE_DISCONNECT = -10
    NIXL_ERR_CANCELED = -11
    NIXL_ERR_NO_TELEMETRY = -12


class nixl_thread_sync_t(enum.IntEnum):
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 3


class nixl_cost_t(enum.IntEnum):
    NIXL_COST_ANALYTICAL_BACKEND = 0


# NIXL's names for memory types as they appear in strings (getPluginParams etc.).
MEM_NAMES = {nixl_mem_t.DRAM_SEG: "DRAM", nixl_mem_t.VRAM_SEG: "VRAM",
             nixl_mem_t.BLK_SEG: "BLOCK", nixl_mem_t.OBJ_SEG: "OBJ",
             nixl_mem_t.FILE_SEG: "FILE"}


# --- exceptions: one per NIXL status, as nixl._bindings registers them --------------

class nixlError(Exception):
    """Base of the NIXL exceptions raised by ferry.compat.nixl (NIXL has none;
    each of its classes derives from Exception). ``status`` is the NIXL status;
    the message is Ferry's and names the thing."""

    status = nixl_status_t.NIXL_ERR_UNKNOWN


def _error(name: str, status: nixl_status_t):
    return type(name, (nixlError,), {"status": status, "__module__": __name__})


nixlNotPostedError = _error("nixlNotPostedError", nixl_status_t.NIXL_ERR_NOT_POSTED)
nixlInvalidParamError = _error("nixlInvalidParamError", nixl_status_t.NIXL_ERR_INVALID_PARAM)
nixlBackendError = _error("nixlBackendError", nixl_status_t.NIXL_ERR_BACKEND)
nixlNotFoundError = _error("nixlNotFoundError", nixl_status_t.NIXL_ERR_NOT_FOUND)
nixlMismatchError = _error("nixlMismatchError", nixl_status_t.NIXL_ERR_MISMATCH)
nixlNotAllowedError = _error("nixlNotAllowedError", nixl_status_t.NIXL_ERR_NOT_ALLOWED)
nixlRepostActiveError = _error("nixlRepostActiveError", nixl_status_t.NIXL_ERR_REPOST_ACTIVE)
nixlUnknownError = _error("nixlUnknownError", nixl_status_t.NIXL_ERR_UNKNOWN)
nixlNotSupportedError = _error("nixlNotSupportedError", nixl_status_t.NIXL_ERR_NOT_SUPPORTED)
nixlRemoteDisconnectError = _error("nixlRemoteDisconnectError",
                                   nixl_status_t.NIXL_ERR_REMOTE_DISCONNECT)
nixlCancelledError = _error("nixlCancelledError", nixl_status_t.NIXL_ERR_CANCELED)
nixlNoTelemetryError = _error("nixlNoTelemetryError", nixl_status_t.NIXL_ERR_NO_TELEMETRY)

# Ferry's error classes -> the NIXL class a NIXL user catches for the same failure.
_FROM_FERRY = [
    (_errors.InvalidArgument, nixlInvalidParamError),
    (_errors.NotFound, nixlNotFoundError),
    (_errors.OutOfRange, nixlInvalidParamError),
    (_errors.PermissionDenied, nixlNotAllowedError),
    (_errors.PeerDisconnected, nixlRemoteDisconnectError),
    (_errors.Cancelled, nixlCancelledError),
    (_errors.NotSupported, nixlNotSupportedError),
    (_errors.Timeout, nixlBackendError),
]


def from_ferry(exc: BaseException, context: str = "") -> nixlError:
    """The NIXL exception for a Ferry error, keeping Ferry's message (which names
    the region, peer and offset) behind ``context``."""
    cls = nixlBackendError
    for ferry_cls, nixl_cls in _FROM_FERRY:
        if isinstance(exc, ferry_cls):
            cls = nixl_cls
            break
    text = f"{context}: {exc}" if context else str(exc)
    return cls(f"{text} [{type(exc).__name__}]")


def as_name(name) -> str:
    """Agent names arrive as str or bytes (add_remote_agent returns bytes)."""
    if isinstance(name, (bytes, bytearray)):
        return bytes(name).decode()
    if isinstance(name, str):
        return name
    raise nixlInvalidParamError(f"an agent name must be str or bytes, not {type(name).__name__}")


def as_payload(msg) -> bytes:
    """Notification payloads: bytes, or str (encoded as UTF-8, as NIXL's binding does)."""
    if isinstance(msg, str):
        return msg.encode()
    if isinstance(msg, (bytes, bytearray, memoryview)):
        return bytes(msg)
    raise nixlInvalidParamError(f"a notification message must be bytes or str, not "
                                f"{type(msg).__name__}")
