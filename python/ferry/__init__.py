"""Ferry: a point-to-point transfer engine.

Move bytes between memory regions of different processes with one-sided
WRITE/READ, batched scatter-gather and completion notifications::

    import ferry, numpy as np

    engine = ferry.Engine()                      # listens on 127.0.0.1:<free port>
    buf = np.zeros(1 << 20, dtype=np.uint8)
    region = engine.register(buf)                # keeps `buf` alive
    desc = region.advertise()                    # 64 bytes: send to the peer
    meta = engine.metadata()                     # bytes: send to the peer

    # on the peer:
    peer = other_engine.connect(meta)
    peer.write([(src_region, 0, 4096)], [(desc, 0, 4096)], notify=b"done")

See docs/python.md for the guide, and ``ferry.compat.uccl`` for a drop-in
replacement of UCCL's ``p2p.Endpoint``.
"""
from __future__ import annotations

from . import _ferry
from ._ferry import (
    ACCESS_READ,
    ACCESS_READ_WRITE,
    ACCESS_WRITE,
    DESCRIPTOR_SIZE,
    Descriptor,
    Engine,
    MemoryKind,
    Peer,
    Region,
    StatusCode,
    Transfer,
    protocol_version,
    cuda_available,
    cuda_device_count,
    cuda_unavailable_reason,
    version,
)
from ._gpu import CopyStream, copy_blocks
from ._errors import (
    ERROR_CLASSES,
    Busy,
    Cancelled,
    FerryError,
    InternalError,
    InvalidArgument,
    NotFound,
    NotSupported,
    OutOfRange,
    PeerDisconnected,
    PermissionDenied,
    ProtocolError,
    Timeout,
    error_for,
)

from ._metadata import MetadataInfo, parse_metadata
from . import directory  # engines found by name: ferry.directory.attach / open (docs/directory.md)

_ferry._set_error_classes({int(code): cls for code, cls in ERROR_CLASSES.items()})

# The library's version (CMakeLists.txt's project() line, the one place it is
# written); the wheel's version is the same number.
__version__ = version()

__all__ = [
    "ACCESS_READ", "ACCESS_READ_WRITE", "ACCESS_WRITE", "DESCRIPTOR_SIZE",
    "Descriptor", "Engine", "MemoryKind", "Peer", "Region", "StatusCode", "Transfer",
    "protocol_version", "version",
    "cuda_available", "cuda_device_count", "cuda_unavailable_reason", "CopyStream", "copy_blocks",
    "FerryError", "Busy", "Cancelled", "InternalError", "InvalidArgument", "NotFound",
    "NotSupported", "OutOfRange", "PeerDisconnected", "PermissionDenied", "ProtocolError",
    "Timeout", "error_for", "MetadataInfo", "parse_metadata",
]
