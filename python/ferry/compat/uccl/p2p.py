"""UCCL P2P ``Endpoint`` on top of Ferry.

Change ``from uccl import p2p`` to ``from ferry.compat.uccl import p2p``: the
method names, arguments and return tuples are UCCL's. Differences (all listed in
docs/uccl_compat.md), in short:

* Failures raise ``ferry.FerryError`` subclasses carrying the engine's message
  instead of returning ``ok=False`` (or printing); a returned ``ok`` is always True.
* Transfer ids are Ferry's generation-safe ids: polling a finished id again raises
  ``ferry.NotFound`` saying so, never reads freed memory.
* ``conn_id`` is the peer engine's 64-bit id, the same on both sides' view of one
  connection; connections are bidirectional (the accepting side may also initiate).
* Metadata bytes are Ferry engine metadata (not UCCL's 10/22-byte layout); use
  ``Endpoint.parse_metadata``.
* The IPC (same-host CUDA) calls raise ``ferry.NotSupported``: Ferry's cuda_ipc
  transport is not in this build.
"""
from __future__ import annotations

import collections
import socket
import time

from ... import _ferry
from ..._errors import InvalidArgument, NotFound, NotSupported
from ..._metadata import parse_metadata as _parse_ferry_metadata

__all__ = ["Endpoint", "get_oob_ip"]

_IPC_MISSING = (
    "{name}: same-host GPU transfers need Ferry's cuda_ipc transport, which this build "
    "does not provide; use {alt} (over tcp) instead"
)


def get_oob_ip() -> str:
    """Best guess of this host's address for out-of-band exchange (UCCL helper)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip and not ip.startswith("[") else f"{ip}:{port}"


class Endpoint:
    """UCCL-compatible endpoint backed by one ``ferry.Engine``.

    ``Endpoint(local_gpu_idx=None, num_cpus=None, *, listen="0.0.0.0:0", **options)``:
    ``listen`` and ``options`` (e.g. ``tcp_streams=4``) go to ``ferry.Engine``.
    """

    _COMPLETED_MEMORY = 1 << 16  # finished transfer ids remembered for clear errors

    def __init__(self, local_gpu_idx: int | None = None, num_cpus: int | None = None, *,
                 listen: str = "0.0.0.0:0", options: dict | None = None, **engine_options):
        self.local_gpu_idx = -1 if local_gpu_idx is None else int(local_gpu_idx)
        self.num_cpus = num_cpus
        self._engine = _ferry.Engine(listen, options, **engine_options)
        self._regions: dict[int, _ferry.Region] = {}
        self._peers: dict[int, _ferry.Peer] = {}
        self._by_metadata: dict[bytes, int] = {}
        self._accepted: set[int] = set()
        self._transfers: dict[int, _ferry.Transfer] = {}
        self._completed: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._passive = False

    # ------------------------------------------------------------------ misc
    @property
    def engine(self):
        """The underlying ``ferry.Engine`` (for Ferry-only features)."""
        return self._engine

    def __repr__(self) -> str:
        return f"<ferry.compat.uccl.p2p.Endpoint {self._engine!r}>"

    def close(self) -> None:
        self._transfers.clear()
        self._regions.clear()
        self._peers.clear()
        self._engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ addressing
    def get_metadata(self) -> bytes:
        return self._engine.metadata()

    get_endpoint_metadata = get_metadata  # older UCCL name

    @staticmethod
    def parse_metadata(metadata: bytes):
        """(ip, port, gpu) of Ferry engine metadata; gpu is -1 (not carried)."""
        info = _parse_ferry_metadata(metadata)
        addrs = info.tcp_addresses
        if not addrs:
            raise InvalidArgument("the engine metadata has no tcp address")
        ip, port = addrs[0]
        return ip, port, -1

    # ----------------------------------------------------------- connections
    def _peer(self, conn_id: int) -> _ferry.Peer:
        p = self._peers.get(conn_id)
        if p is None:
            if conn_id not in self._engine.peers():
                raise NotFound(f"conn_id {conn_id:#x} is not a connected peer of this endpoint")
            p = self._peers[conn_id] = self._engine.peer(conn_id)
        return p

    def connect(self, remote_ip_addr: str, remote_gpu_idx: int = 0, remote_port: int = -1,
                *, remote_gpu=None):
        del remote_gpu_idx, remote_gpu  # Ferry picks the memory from the descriptors
        if remote_port is None or int(remote_port) < 0:
            raise InvalidArgument(
                "connect(): Ferry has no well-known port; pass remote_port "
                "(from Endpoint.parse_metadata) or use add_remote_endpoint(metadata)")
        peer = self._engine.connect(_host_port(remote_ip_addr, int(remote_port)))
        self._peers[peer.id] = peer
        return True, peer.id

    def add_remote_endpoint(self, metadata_bytes: bytes):
        key = bytes(metadata_bytes)
        conn_id = self._by_metadata.get(key)
        if conn_id is not None:
            return True, conn_id
        peer = self._engine.connect(key)
        self._peers[peer.id] = peer
        self._by_metadata[key] = peer.id
        return True, peer.id

    def remove_remote_endpoint(self, conn_id: int) -> bool:
        self._peers.pop(conn_id, None)
        for k in [k for k, v in self._by_metadata.items() if v == conn_id]:
            del self._by_metadata[k]
        return True

    def accept(self, timeout: float | None = None):
        """Block until a peer not yet handed out connects: (True, ip, gpu, conn_id).

        ip is the peer's address as this engine sees the connection; Ferry's
        handshake carries no GPU index, so gpu is -1.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for pid in self._engine.peers():
                if pid not in self._accepted and pid not in self._peers:
                    self._accepted.add(pid)
                    self._peers[pid] = self._engine.peer(pid)
                    return True, self._peer_ip(pid), -1, pid
            if deadline is not None and time.monotonic() >= deadline:
                from ..._errors import Timeout
                raise Timeout(f"accept(): no new peer within {timeout} s")
            time.sleep(0.002)

    def _peer_ip(self, pid: int) -> str:
        try:
            address = self._engine.peer_address(pid)
        except NotFound:  # gone again already: no address to give
            return ""
        host, _, _port = address.rpartition(":")
        return host.strip("[]")

    def start_passive_accept(self) -> bool:
        # Ferry's engine accepts every incoming connection on its own threads.
        self._passive = True
        return True

    # --------------------------------------------------------------- memory
    def reg(self, ptr: int, size: int, floatType=None):  # noqa: N803 (UCCL's name)
        del floatType
        region = self._engine.register_ptr(int(ptr), int(size))
        self._regions[region.id] = region
        return True, region.id

    def regv(self, ptrs, sizes):
        if len(ptrs) != len(sizes):
            raise InvalidArgument("regv(): ptrs and sizes must have the same length")
        ids = []
        try:
            for p, s in zip(ptrs, sizes):
                ids.append(self.reg(p, s)[1])
        except BaseException:
            for i in ids:
                self.dereg(i)
            raise
        return True, ids

    def dereg(self, mr_id: int) -> bool:
        region = self._regions.pop(mr_id, None)
        if region is None:
            raise NotFound(f"dereg(): mr_id {mr_id} is not registered")
        region.deregister()
        return True

    def _region(self, mr_id: int) -> _ferry.Region:
        region = self._regions.get(mr_id)
        if region is None:
            raise NotFound(f"mr_id {mr_id} is not registered with this endpoint")
        return region

    def advertise(self, *args, **kwargs):
        """advertise(mr_id, ptr, size) or UCCL's older advertise(conn_id, mr_id, ptr, size)
        -> (True, 64-byte descriptor)."""
        if len(args) + len(kwargs) == 4:
            args = args[1:] if args else args
            kwargs.pop("conn_id", None)
        mr_id, ptr, size = _pick(args, kwargs, ("mr_id", "ptr", "size"),
                                 aliases={"addr": "ptr", "len": "size"})
        region = self._region(mr_id)
        offset = int(ptr) - region.address
        if offset < 0:
            raise InvalidArgument(f"advertise(): address {int(ptr):#x} is below mr {mr_id}")
        return True, region.advertise(offset, int(size))

    def advertisev(self, *args, **kwargs):
        """advertisev(mr_id_v, ptr_v, size_v, num_iovs) or the older form with a leading
        conn_id -> (True, [64-byte descriptors])."""
        if len(args) + len(kwargs) == 5:
            args = args[1:] if args else args
            kwargs.pop("conn_id", None)
        mr_id_v, ptr_v, size_v, num_iovs = _pick(
            args, kwargs, ("mr_id_v", "ptr_v", "size_v", "num_iovs"),
            aliases={"mr_id_list": "mr_id_v", "addr_list": "ptr_v", "len_list": "size_v"})
        _check_len(num_iovs, mr_id_v, ptr_v, size_v)
        out = []
        for mr_id, ptr, size in zip(mr_id_v, ptr_v, size_v):
            out.append(self.advertise(mr_id, ptr, size)[1])
        return True, out

    # ------------------------------------------------------------ transfers
    def _post(self, op, conn_id, mr_ids, ptrs, sizes, metas, async_):
        if not self._regions.keys() >= set(mr_ids):
            missing = sorted(set(mr_ids) - self._regions.keys())
            raise NotFound(f"{op}: mr_id(s) {missing[:8]} are not registered with this endpoint")
        t = self._peer(conn_id)._post_addresses(op, ptrs, sizes, metas, async_=async_)
        if not async_:
            return True
        self._transfers[t.id] = t
        return True, t.id

    def write(self, conn_id, mr_id, ptr, size, meta):
        return self._post("write", conn_id, (mr_id,), [ptr], [size], meta, False)

    def read(self, conn_id, mr_id, ptr, size, meta):
        return self._post("read", conn_id, (mr_id,), [ptr], [size], meta, False)

    def write_async(self, conn_id, mr_id, ptr, size, meta):
        return self._post("write", conn_id, (mr_id,), [ptr], [size], meta, True)

    def read_async(self, conn_id, mr_id, ptr, size, meta):
        return self._post("read", conn_id, (mr_id,), [ptr], [size], meta, True)

    def writev(self, conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs):
        _check_len(num_iovs, mr_id_v, ptr_v, size_v, meta_blob_v)
        return self._post("write", conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, False)

    def readv(self, conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs):
        _check_len(num_iovs, mr_id_v, ptr_v, size_v, meta_blob_v)
        return self._post("read", conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, False)

    def writev_async(self, conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs):
        _check_len(num_iovs, mr_id_v, ptr_v, size_v, meta_blob_v)
        return self._post("write", conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, True)

    def readv_async(self, conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs):
        _check_len(num_iovs, mr_id_v, ptr_v, size_v, meta_blob_v)
        return self._post("read", conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, True)

    def poll_async(self, transfer_id: int):
        """(True, is_done). A failed transfer raises its error (once, when it finishes);
        an id already reported done, or never issued, raises ferry.NotFound."""
        t = self._transfers.get(transfer_id)
        if t is None:
            if transfer_id in self._completed:
                raise NotFound(f"poll_async(): transfer {transfer_id} already completed and was "
                               "reported done by an earlier poll_async")
            raise NotFound(f"poll_async(): unknown transfer id {transfer_id}")
        if not t.done():
            return True, False
        del self._transfers[transfer_id]
        self._completed[transfer_id] = None
        if len(self._completed) > self._COMPLETED_MEMORY:
            self._completed.popitem(last=False)
        t.wait()  # raises the transfer's error, if any
        return True, True

    def wait_async(self, transfer_id: int, timeout: float | None = None) -> bool:
        """Ferry extension: block (GIL released, Ctrl-C-able) until the transfer is done."""
        t = self._transfers.get(transfer_id)
        if t is None:
            return self.poll_async(transfer_id)[1]
        try:
            t.wait(timeout)
        finally:
            if t.done():
                self._transfers.pop(transfer_id, None)
                self._completed[transfer_id] = None
        return True

    # ------------------------------------------------- unsupported (for now)
    def _ipc(name, alt):  # noqa: N805 - factory used in the class body
        def method(self, *args, **kwargs):
            raise NotSupported(_IPC_MISSING.format(name=name, alt=alt))
        method.__name__ = name
        method.__doc__ = f"Not supported: {name} needs the cuda_ipc transport (raises ferry.NotSupported)."
        return method

    write_ipc = _ipc("write_ipc", "write")
    read_ipc = _ipc("read_ipc", "read")
    writev_ipc = _ipc("writev_ipc", "writev")
    readv_ipc = _ipc("readv_ipc", "readv")
    write_ipc_async = _ipc("write_ipc_async", "write_async")
    read_ipc_async = _ipc("read_ipc_async", "read_async")
    writev_ipc_async = _ipc("writev_ipc_async", "writev_async")
    readv_ipc_async = _ipc("readv_ipc_async", "readv_async")
    advertise_ipc = _ipc("advertise_ipc", "advertise")
    advertisev_ipc = _ipc("advertisev_ipc", "advertisev")
    send_ipc = _ipc("send_ipc", "write")
    recv_ipc = _ipc("recv_ipc", "read")
    send_ipc_async = _ipc("send_ipc_async", "write_async")
    recv_ipc_async = _ipc("recv_ipc_async", "read_async")
    connect_local = _ipc("connect_local", "add_remote_endpoint")
    accept_local = _ipc("accept_local", "accept")
    del _ipc

    def _two_sided(name):  # noqa: N805
        def method(self, *args, **kwargs):
            raise NotSupported(
                f"{name}: Ferry is one-sided; two-sided send/recv is not provided. Advertise "
                "the receive buffer and use write (with a notification) instead")
        method.__name__ = name
        return method

    send = _two_sided("send")
    recv = _two_sided("recv")
    sendv = _two_sided("sendv")
    recvv = _two_sided("recvv")
    send_async = _two_sided("send_async")
    recv_async = _two_sided("recv_async")
    del _two_sided


def _check_len(num_iovs, *lists):
    n = int(num_iovs)
    for lst in lists:
        if isinstance(lst, (bytes, bytearray)):
            continue
        if len(lst) != n:
            raise InvalidArgument(
                f"all input lists must have length num_iovs={n} (one has {len(lst)})")


def _pick(args, kwargs, names, aliases=None):
    aliases = aliases or {}
    kw = {aliases.get(k, k): v for k, v in kwargs.items()}
    if len(args) > len(names):
        raise TypeError(f"expected at most {len(names)} arguments")
    out = list(args) + [None] * (len(names) - len(args))
    for i, name in enumerate(names):
        if name in kw:
            if i < len(args):
                raise TypeError(f"argument {name!r} given twice")
            out[i] = kw.pop(name)
        elif out[i] is None and i >= len(args):
            raise TypeError(f"missing argument {name!r}")
    if kw:
        raise TypeError(f"unexpected arguments {sorted(kw)}")
    return out
