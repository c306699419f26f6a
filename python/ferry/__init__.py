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

See docs/python.md for the guide, ``ferry.compat.uccl`` for a drop-in
replacement of UCCL's ``p2p.Endpoint`` and ``ferry.compat.nixl`` for NIXL's
Python agent API (docs/nixl_compat.md).
"""
from __future__ import annotations

from . import _ferry
from ._ferry import (
    ACCESS_READ,
    ACCESS_READ_WRITE,
    ACCESS_WRITE,
    DESCRIPTOR_SIZE,
    Descriptor,
    Engine as _NativeEngine,
    MemoryKind,
    Peer,
    PreparedTransfer,
    Region,
    StatusCode,
    Transfer,
    protocol_version,
    cuda_available,
    cuda_device_count,
    cuda_unavailable_reason,
    gpu_ordinal,
    gpus,
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
# Engines found by name: ferry.directory.attach / open (docs/directory.md).
from . import directory
from . import directory as directory_module  # Engine's `directory` argument hides the name



class Engine(_NativeEngine):
    """A Ferry engine (see _ferry.Engine for every method).

    ``directory=`` and ``name=`` publish the engine under a name: an
    ``"etcd://host:port/prefix"`` URL is handled by the C++ engine; a
    torch.distributed store (or any object with set/get/check) goes through
    ``ferry.directory``. Either way ``connect("prefill-0")`` finds a peer by
    name, ``publish(key, descriptor)`` and ``lookup(name, key)`` exchange
    descriptors, and the entries vanish with the engine.
    """

    def __init__(self, listen="127.0.0.1:0", options=None, *, directory=None, name=None, **opts):
        self._named = None
        if directory is None or isinstance(directory, str):
            if directory is not None:
                opts["directory"] = directory
            if name is not None:
                opts["name"] = name
            super().__init__(listen, options, **opts)
            return
        if not name:
            raise InvalidArgument("Engine(directory=<store>) needs name= as well")
        super().__init__(listen, options, **opts)
        self._named = directory_module.attach(self, directory, name)

    @property
    def name(self) -> str:
        return self._named.name if self._named else super().name

    def connect(self, target, timeout: float = 0.0):
        if self._named and isinstance(target, str) and ":" not in target:
            return self._named.connect(target, timeout=timeout)
        return super().connect(target, timeout)

    def publish(self, key: str, descriptor) -> None:
        if self._named:
            self._named.publish(key, bytes(descriptor))
        else:
            super().publish(key, descriptor)

    def lookup(self, name: str, key: str, timeout: float = 0.0) -> bytes:
        if self._named:
            return self._named.lookup(name, key, timeout=timeout)
        return super().lookup(name, key, timeout)

    def close(self) -> None:
        if self._named:
            self._named.close()
            self._named = None
        super().close()

    def __exit__(self, *exc) -> None:
        self.close()


_ferry._set_error_classes({int(code): cls for code, cls in ERROR_CLASSES.items()})

# The library's version (CMakeLists.txt's project() line, the one place it is
# written); the wheel's version is the same number.
__version__ = version()

__all__ = [
    "ACCESS_READ", "ACCESS_READ_WRITE", "ACCESS_WRITE", "DESCRIPTOR_SIZE",
    "Descriptor", "Engine", "MemoryKind", "Peer", "PreparedTransfer", "Region", "StatusCode", "Transfer",
    "protocol_version", "version",
    "cuda_available", "cuda_device_count", "cuda_unavailable_reason", "gpus", "gpu_ordinal", "CopyStream", "copy_blocks",
    "FerryError", "Busy", "Cancelled", "InternalError", "InvalidArgument", "NotFound",
    "NotSupported", "OutOfRange", "PeerDisconnected", "PermissionDenied", "ProtocolError",
    "Timeout", "error_for", "MetadataInfo", "parse_metadata",
]
