"""UCCL P2P ``Endpoint`` on top of Ferry.

Change ``from uccl import p2p`` to ``from ferry.compat.uccl import p2p``: the
method names, arguments and return tuples are UCCL's, including the same-host
calls (``connect_local``, ``accept_local``, ``advertise_ipc``, ``write_ipc``,
``read_ipc``, ``writev_ipc``, ``readv_ipc`` and their async forms), the
descriptor API (``register_memory``, ``deregister_memory``,
``get_serialized_descs``, ``deserialize_descs``, ``transfer``) and ``FloatType``.
Every call runs on one ``ferry.Engine`` (``ep.engine``), which picks the
transport per peer: for a peer of this host, shm for host memory and cuda_ipc
for GPU memory where the build has it, tcp otherwise. Differences (all listed
in docs/uccl_compat.md), in short:

* Failures raise ``ferry.FerryError`` subclasses carrying the engine's message
  instead of returning ``ok=False`` (or printing); a returned ``ok`` is True.
  ``remove_remote_endpoint`` returns False for an unknown conn_id, as UCCL does;
  calls with such a conn_id raise ``InvalidConnId`` (a ``ferry.NotFound`` and a
  ``RuntimeError``, as UCCL's).
* Transfer ids are Ferry's generation-safe ids: polling a finished id again raises
  ``ferry.NotFound`` saying so, never reads freed memory.
* Connections are bidirectional (the accepting side may also initiate).
* Metadata bytes are Ferry engine metadata in a small envelope (GPU index, its
  PCI bus id and the same-host name), not UCCL's ip/port/BDF record; use
  ``Endpoint.parse_metadata``, which gives the GPU's PCI bus id as UCCL's does.
* The *_ipc calls take Ferry descriptors (64 bytes) and work on any connection.
"""
from __future__ import annotations

import queue
import socket
import threading
import time
import weakref

from ... import _ferry
from ..._errors import InvalidArgument, NotFound, NotSupported, Timeout
from ..._metadata import parse_metadata as _parse_ferry_metadata
from . import _envelope, _local, _peer_info
from ._types import UINT64_MAX, BadArgument, FloatType, InvalidConnId
from ._xfer_desc import XferDesc, as_desc, deserialize, serialize

__all__ = ["Endpoint", "FloatType", "XferDesc", "InvalidConnId", "BadArgument", "get_oob_ip"]

# UCCL's enum also puts its values at module level (export_values).
kUndefined = FloatType.kUndefined
kFloat16 = FloatType.kFloat16
kBFloat16 = FloatType.kBFloat16
kFloat32 = FloatType.kFloat32
kFloat8E4M3FN = FloatType.kFloat8E4M3FN
kFloat8E5M2 = FloatType.kFloat8E5M2

# How long accept() waits for the hello (GPU index) of a peer that sent none yet
# before answering gpu -1, counted from when our side lists the peer's network
# connection: a connecting endpoint sends it as soon as its connect returns, a bare
# Ferry engine never (nothing in engine metadata tells the two apart).
_ACCEPT_HELLO_WAIT = 2.0  # s


def get_oob_ip() -> str:
    """This host's address for out-of-band exchange (UCCL helper): the source
    address of the default route, else the host name's address, else 127.0.0.1."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent: only the route is looked up
        ip = s.getsockname()[0]
        if ip and not ip.startswith("0."):
            return ip
    except OSError:
        pass
    finally:
        s.close()
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip and not ip.startswith("[") else f"{ip}:{port}"


class _Conn:
    __slots__ = ("peer", "local", "remote_gpu", "ip", "post")

    def __init__(self, peer, local, remote_gpu, ip=""):
        self.peer, self.local, self.remote_gpu, self.ip = peer, local, remote_gpu, ip
        self.post = peer._post_addresses  # bound once: looked up on every transfer call


class _Mr:
    """One mr_id: a Ferry region, shared (reference-counted) between register_memory
    descriptors whose ranges it contains."""

    __slots__ = ("region", "cached")

    def __init__(self, region, cached):
        self.region, self.cached = region, cached


def _gpu_bdf(gpu: int) -> str:
    """The PCI bus id of this process's GPU ``gpu`` ("" for none, or without CUDA)."""
    if gpu < 0:
        return ""
    gpus = _ferry.gpus()
    return gpus[gpu]["pci_bus_id"] if gpu < len(gpus) else ""


def _contains(region, ptr: int, size: int) -> bool:
    return region.address <= ptr and ptr + size <= region.address + region.length


class Endpoint:
    """UCCL-compatible endpoint backed by one ``ferry.Engine``.

    ``Endpoint(local_gpu_idx=None, num_cpus=None, *, listen="0.0.0.0:0", **options)``:
    ``listen`` and ``options`` (e.g. ``tcp_streams=4``) go to ``ferry.Engine``.
    """

    _COMPLETED_MEMORY = 1 << 16  # finished transfer ids remembered for clear errors
    _IPC_LOCAL_KEPT = 4096  # *_ipc local ranges kept registered (see _register_ipc_local)

    def __init__(self, local_gpu_idx: int | None = None, num_cpus: int | None = None, *,
                 listen: str = "0.0.0.0:0", options: dict | None = None, **engine_options):
        self.local_gpu_idx = -1 if local_gpu_idx is None else int(local_gpu_idx)
        self.num_cpus = num_cpus
        self._engine = _ferry.Engine(listen, options, **engine_options)
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}
        self._next_conn = 0
        self._by_metadata: dict[bytes, int] = {}
        self._known_pids: set[int] = set()  # connected by us or handed out: not accept()ed
        self._reserved_pids: set[int] = set()  # mid connect_local handshake
        self._first_seen: dict[int, float] = {}  # pid -> when accept() first listed it
        self._network_seen: dict[int, float] = {}  # pid -> when its network link was listed
        self._hellos: dict[int, tuple] = {}  # pid -> (gpu, tcp_up) from _peer_info.parse_hello
        self._notifications: list = []  # others' notifications drained by accept()
        self._local_queue: queue.Queue = queue.Queue()
        self._mrs: dict[int, _Mr] = {}
        self._next_mr = 0
        self._cache: list[_Mr] = []  # register_memory registrations, reusable
        self._ipc_regions: dict[tuple[int, int], _ferry.Region] = {}
        self._transfers: dict[int, object] = {}  # transfer id -> ferry Transfer in flight
        self._completed: dict[int, None] = {}  # ids reported done, oldest first
        self._ipc_local: dict[tuple[int, int], tuple] = {}  # (ptr, size) -> (Region, owned)
        self._passive = False
        gpu = f"-gpu{self.local_gpu_idx}" if self.local_gpu_idx >= 0 else ""
        self._local_name = f"ferry-{self._engine.id:016x}{gpu}"
        self._gpu_bdf = _gpu_bdf(self.local_gpu_idx)
        self._metadata = _envelope.wrap(self.local_gpu_idx, self._local_name,
                                        self._engine.metadata(), self._gpu_bdf)
        me = weakref.ref(self)

        def alive():
            ep = me()
            if ep is None or ep._engine.closed:
                raise NotFound("the endpoint is closed")
            return ep

        def reserve(pid):
            ep = alive()
            with ep._lock:
                ep._reserved_pids.add(pid)

        def connected(env, pid):
            alive()._local_queue.put((env, pid))

        def release(pid):
            ep = me()
            if ep is not None:
                with ep._lock:
                    ep._reserved_pids.discard(pid)

        self._listener = _local.LocalListener(self._local_name, self.local_gpu_idx,
                                              lambda: alive()._metadata, reserve, connected,
                                              release, gpu_bdf=self._gpu_bdf)
        self._finalizer = weakref.finalize(self, self._listener.stop)

    # ------------------------------------------------------------------ misc
    @property
    def engine(self):
        """The underlying ``ferry.Engine`` (for Ferry-only features)."""
        return self._engine

    def __repr__(self) -> str:
        return f"<ferry.compat.uccl.p2p.Endpoint {self._local_name} {self._engine!r}>"

    def close(self) -> None:
        self._finalizer()
        self._transfers.clear()
        self._ipc_local.clear()
        self._mrs.clear()
        self._cache.clear()
        self._ipc_regions.clear()
        self._conns.clear()
        self._engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    get_oob_ip = staticmethod(get_oob_ip)

    def conn_id_of_rank(self, rank: int) -> int:
        """UCCL's rank table; nothing fills it in the P2P API (UCCL's neither), so
        this is always UINT64_MAX ("none")."""
        del rank
        return UINT64_MAX

    # ------------------------------------------------------------ addressing
    def get_metadata(self) -> bytes:
        """This endpoint's address: Ferry engine metadata in an envelope carrying the
        GPU index and the same-host name (``ep.engine.metadata()`` is the bare form)."""
        return self._metadata

    get_endpoint_metadata = get_metadata  # older UCCL name

    @staticmethod
    def parse_metadata(metadata: bytes):
        """(ip, port, gpu): the first tcp address and the endpoint's GPU identity, the
        string ``connect_local`` takes: as UCCL's, the GPU's PCI bus id ("0000:18:00.0",
        the same whatever each process's CUDA_VISIBLE_DEVICES); the endpoint's
        same-host name for an endpoint without a GPU ("" for bare Ferry engine metadata)."""
        env = _envelope.unwrap(metadata)
        addrs = _parse_ferry_metadata(env.engine_metadata).tcp_addresses
        if not addrs:
            raise InvalidArgument("the engine metadata has no tcp address")
        ip, port = addrs[0]
        return ip, port, env.gpu_bdf or env.local_name

    # ----------------------------------------------------------- connections
    def _new_conn(self, peer, local, remote_gpu, ip="") -> int:
        with self._lock:
            cid = self._next_conn
            self._next_conn += 1
            self._conns[cid] = _Conn(peer, local, remote_gpu, ip)
            self._known_pids.add(peer.id)
        return cid

    def _conn(self, conn_id, what: str) -> _Conn:
        c = self._conns.get(conn_id) if isinstance(conn_id, int) else None
        if c is None:
            raise InvalidConnId(f"Invalid conn_id {conn_id!r} in {what}: not a connection of "
                                "this endpoint (never made, or removed)")
        return c

    def _hello(self, peer) -> None:
        try:
            tcp_up = _peer_info.tcp_connected(peer.transports())
            peer.notify(_peer_info.hello(self.local_gpu_idx, tcp_up))
        except Exception:  # only costs the peer's accept() the GPU index
            pass

    def connect(self, remote_ip_addr: str, remote_gpu_idx=0, remote_port: int = -1, *,
                remote_gpu_bdf=None, remote_gpu=None):
        del remote_gpu_idx, remote_gpu_bdf, remote_gpu  # the memory kind is in descriptors
        if remote_port is None or int(remote_port) < 0:
            raise InvalidArgument(
                "connect(): Ferry has no well-known port; pass remote_port "
                "(from Endpoint.parse_metadata) or use add_remote_endpoint(metadata)")
        peer = self._engine.connect(_host_port(remote_ip_addr, int(remote_port)))
        cid = self._new_conn(peer, False, -1, remote_ip_addr)
        self._hello(peer)
        return True, cid

    def add_remote_endpoint(self, metadata_bytes: bytes):
        key = bytes(metadata_bytes)
        cid = self._by_metadata.get(key)
        if cid is not None and cid in self._conns:
            return True, cid
        env = _envelope.unwrap(key)
        peer = self._engine.connect(env.engine_metadata)
        cid = self._new_conn(peer, False, env.gpu)
        self._by_metadata[key] = cid
        self._hello(peer)
        return True, cid

    def remove_remote_endpoint(self, conn_id: int) -> bool:
        """Forget a connection: True, or False (as UCCL) for an unknown or already
        removed conn_id. The engines stay connected for other conn_ids."""
        with self._lock:
            if self._conns.pop(conn_id, None) is None:
                return False
            for k in [k for k, v in self._by_metadata.items() if v == conn_id]:
                del self._by_metadata[k]
        return True

    def _drain_hellos(self) -> None:
        for pid, payload in self._engine.notifications():
            hello = _peer_info.parse_hello(payload)
            if hello is not None:
                self._hellos[pid] = hello
            else:
                self._notifications.append((pid, payload))

    def accept(self, timeout: float | None = None):
        """Block until a peer not yet handed out connects: (True, ip, gpu, conn_id).

        ip is the peer's address on the network connection this engine has with it
        ("" when only same-host transports such as shm reach it); gpu is the peer
        endpoint's local_gpu_idx (-1 for a bare Ferry engine, which sends none). A
        peer is handed out once both are known; at the timeout, with what is known.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._drain_hellos()
            now = time.monotonic()
            waiting = []
            for pid in self._engine.peers():
                with self._lock:
                    if pid in self._known_pids or pid in self._reserved_pids:
                        continue
                try:
                    transports = self._engine.peer_transports(pid)
                except NotFound:  # gone again
                    continue
                ip = _peer_info.network_ip(transports)
                if self._accept_ready(pid, transports, ip, now):
                    return self._hand_out(pid, ip)
                waiting.append((pid, ip))
            if deadline is not None and now >= deadline:
                if waiting:  # connected, but its hello or tcp address is late
                    return self._hand_out(*waiting[0])
                raise Timeout(f"accept(): no new peer within {timeout} s")
            time.sleep(0.002)

    def _accept_ready(self, pid: int, transports, ip, now: float) -> bool:
        first = self._first_seen.setdefault(pid, now)
        tcp = _peer_info.tcp_connected(transports)
        hello = self._hellos.get(pid)
        if hello is not None:
            tcp_up = hello[1]
            if tcp_up is None:  # older hello: no word on tcp, wait for it a while
                return tcp or now - first >= _ACCEPT_HELLO_WAIT
            return tcp or not tcp_up  # its tcp is up: ours lists it a moment later
        # No hello yet: wait for one, counting from when the connection is complete
        # here (the sender's connect returns, and it sends, after the last transport).
        since = self._network_seen.setdefault(pid, now) if ip is not None else first
        return now - since >= _ACCEPT_HELLO_WAIT

    def _hand_out(self, pid: int, ip):
        hello = self._hellos.get(pid)
        gpu = -1 if hello is None else hello[0]
        ip = ip or ""
        cid = self._new_conn(self._engine.peer(pid), False, gpu, ip)
        return True, ip, gpu, cid

    def notifications(self) -> list:
        """Ferry extension: notifications received (accept() takes them off the engine
        to find peers' GPU indices; the others are kept here)."""
        self._drain_hellos()
        out, self._notifications = self._notifications, []
        return out

    def start_passive_accept(self) -> bool:
        # Ferry's engine accepts every incoming connection on its own threads.
        self._passive = True
        return True

    # ------------------------------------------------------------ same host
    def connect_local(self, remote_gpu_bdf=None, *, remote_gpu_idx=None, timeout: float = 5.0):
        """Connect to an endpoint of this host: (True, conn_id).

        ``remote_gpu_bdf`` is the GPU identity from ``parse_metadata`` of the peer's
        metadata (unique per endpoint) or, as in UCCL's older API (also as
        ``remote_gpu_idx=``), a GPU index: the endpoint of this host created first
        for that GPU. The peer's engine connects to ours; it need not call
        ``accept_local`` for transfers to work.
        """
        if (remote_gpu_bdf is None) == (remote_gpu_idx is None):
            raise InvalidArgument("connect_local(): pass one of remote_gpu_bdf, remote_gpu_idx")
        target = remote_gpu_bdf if remote_gpu_idx is None else int(remote_gpu_idx)
        theirs, peer = _local.connect(_local.resolve(target), self._metadata,
                                      self._engine.connect, timeout)
        return True, self._new_conn(peer, True, theirs.local_name)

    def accept_local(self, timeout: float | None = None):
        """Block until an endpoint of this host connect_local()s to this one:
        (True, its GPU identity string, conn_id)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.1 if deadline is None else min(0.1, max(0.0, deadline - time.monotonic()))
            try:
                env, pid = self._local_queue.get(timeout=wait)
                break
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise Timeout(f"accept_local(): no same-host endpoint connected within "
                                  f"{timeout} s") from None
        # The connecting side's engine has connected; ours lists it a moment later.
        until = time.monotonic() + 10.0
        while pid not in self._engine.peers():
            if time.monotonic() >= until:
                raise NotFound(f"accept_local(): the engine of {env.local_name} connected "
                               "and went away again")
            time.sleep(0.001)
        cid = self._new_conn(self._engine.peer(pid), True, env.local_name)
        with self._lock:
            self._reserved_pids.discard(pid)
        return True, env.gpu_bdf or env.local_name, cid

    # --------------------------------------------------------------- memory
    def _add_mr(self, region, cached: bool) -> int:
        mr = _Mr(region, cached)
        mr_id = self._next_mr
        self._next_mr += 1
        self._mrs[mr_id] = mr
        return mr_id

    def region(self, mr_id: int):
        """Ferry extension: the ``ferry.Region`` behind an mr_id."""
        return self._mr(mr_id).region

    def reg(self, ptr: int, size: int, floatType=FloatType.kUndefined):  # noqa: N803
        del floatType  # UCCL's compression hint; Ferry does not compress
        region = self._engine.register_ptr(int(ptr), int(size))
        return True, self._add_mr(region, False)

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

    def _release_mr(self, mr_id: int) -> None:
        mr = self._mrs.pop(mr_id)
        shared = [m for m in self._mrs.values() if m.region is mr.region]
        if not shared:
            if mr in self._cache:
                self._cache.remove(mr)
            mr.region.deregister()

    def dereg(self, mr_id: int) -> bool:
        self._mr(mr_id, "dereg()")
        self._release_mr(mr_id)
        return True

    def _mr(self, mr_id: int, what: str = "") -> _Mr:
        mr = self._mrs.get(mr_id)
        if mr is None:
            raise NotFound(f"{what + ': ' if what else ''}mr_id {mr_id} is not registered with "
                           "this endpoint")
        return mr

    def advertise(self, *args, **kwargs):
        """advertise(mr_id, ptr, size) or UCCL's older advertise(conn_id, mr_id, ptr, size)
        -> (True, 64-byte descriptor)."""
        if len(args) + len(kwargs) == 4:
            args = args[1:] if args else args
            kwargs.pop("conn_id", None)
        mr_id, ptr, size = _pick(args, kwargs, ("mr_id", "ptr", "size"),
                                 aliases={"addr": "ptr", "len": "size"})
        region = self._mr(mr_id, "advertise()").region
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

    # ------------------------------------------------ descriptor (NIXL-style) API
    def register_memory(self, tensor_list):
        """Register tensors (objects with data_ptr(), numel(), element_size()): one
        XferDesc each. A tensor inside one already registered here reuses that
        registration (same lkeys/rkeys); every call gets a distinct mr_id."""
        spans = []
        for i, t in enumerate(tensor_list):
            try:
                ptr = int(t.data_ptr())
                size = int(t.numel()) * int(t.element_size())
            except (AttributeError, TypeError) as exc:
                raise BadArgument(f"register_memory(): item {i} ({type(t).__name__}) is not a "
                                  f"tensor (needs data_ptr(), numel(), element_size()): {exc}"
                                  ) from None
            spans.append((ptr, size))
        out, made = [], []
        try:
            for ptr, size in spans:
                base = next((m for m in self._cache if m.region.registered
                             and _contains(m.region, ptr, size)), None)
                if base is None:
                    region = self._engine.register_ptr(ptr, size)
                    mr_id = self._add_mr(region, True)
                    self._cache.append(self._mrs[mr_id])
                else:
                    region = base.region
                    mr_id = self._add_mr(region, True)
                made.append(mr_id)
                blob = region.advertise(ptr - region.address, size)
                # UCCL's NIC keys: here the Ferry region's id (equal where shared).
                keys = [region.id & 0xFFFFFFFF]
                out.append(XferDesc(ptr, size, mr_id, keys, keys, blob))
        except BaseException:
            for mr_id in made:
                self._release_mr(mr_id)
            raise
        return out

    def deregister_memory(self, desc_list) -> None:
        """Release register_memory descriptors (a registration goes when no
        descriptor uses it any more). Unknown mr_ids raise ferry.NotFound and
        release nothing."""
        descs = [as_desc(d, f"deregister_memory(): item {i}") for i, d in enumerate(desc_list)]
        ids = [d.mr_id for d in descs if d.mr_id != UINT64_MAX]
        unknown = [m for m in ids if m not in self._mrs]
        if unknown or len(set(ids)) != len(ids):
            raise NotFound(f"deregister_memory(): mr_id(s) {sorted(set(unknown))[:8] or ids} "
                           "not registered here (or listed twice)")
        for mr_id in ids:
            self._release_mr(mr_id)

    @staticmethod
    def get_serialized_descs(desc_list) -> bytes:
        return serialize(desc_list)

    @staticmethod
    def deserialize_descs(serialized_bytes) -> list:
        return deserialize(serialized_bytes)

    def transfer(self, conn_id: int, op_name: str, local_desc_list, remote_desc_list):
        """Start ``op_name`` ("write" or "read") of local_desc[i].size bytes between
        local_desc[i] and remote_desc[i]: (True, transfer_id) for poll_async."""
        if len(local_desc_list) != len(remote_desc_list):
            raise BadArgument("transfer(): local and remote descriptors must have the same "
                              f"size ({len(local_desc_list)} vs {len(remote_desc_list)})")
        if op_name not in ("write", "read"):
            raise BadArgument(f"transfer(): Invalid op_name: {op_name!r} (\"write\" or \"read\")")
        conn = self._conn(conn_id, "transfer()")
        if not local_desc_list:
            raise BadArgument("transfer(): no descriptors")
        local = [as_desc(d, f"transfer(): local item {i}") for i, d in enumerate(local_desc_list)]
        remote = [as_desc(d, f"transfer(): remote item {i}")
                  for i, d in enumerate(remote_desc_list)]
        for i, d in enumerate(remote):
            if not d.ferry:
                raise BadArgument(f"transfer(): remote item {i} carries no Ferry descriptor "
                                  "(use deserialize_descs of the peer's get_serialized_descs)")
        for i, d in enumerate(local):
            if d.mr_id not in self._mrs:
                raise NotFound(f"transfer(): local item {i}: mr_id {d.mr_id} is not registered "
                               "with this endpoint")
        t = conn.peer._post_addresses(op_name, [d.addr for d in local], [d.size for d in local],
                                      [d.ferry for d in remote], async_=True)
        self._transfers[t.id] = t
        return True, t.id

    # ------------------------------------------------------------ transfers
    def _covering(self, ptr: int, size: int):
        region = self._ipc_regions.get((ptr, size))
        if region is not None and region.registered:
            return region
        for mr in self._mrs.values():
            if mr.region.registered and _contains(mr.region, ptr, size):
                return mr.region
        for region in self._ipc_regions.values():
            if region.registered and _contains(region, ptr, size):
                return region
        return None

    def _register_ipc_local(self, ptrs, sizes) -> None:
        """*_ipc calls: the local memory need not be registered by the caller. Each
        (ptr, size) is looked up once, then found in one dict lookup per call: a range
        inside an mr_id or an advertise_ipc registration uses that one; any other is
        registered here and kept (registering and releasing it on every call cost more
        than the transfer: UCCL's --write-ipc loop at 4 KB went from 18 to 12 us)."""
        cache = self._ipc_local
        if len(ptrs) == 1:  # the common case: one lookup, no loop
            hit = cache.get((ptrs[0], sizes[0]))
            if hit is not None and hit[0].registered:
                return
        for p, s in zip(ptrs, sizes):
            hit = cache.get((p, s))
            if hit is not None and hit[0].registered:
                continue
            p, s = int(p), int(s)
            region = self._covering(p, s)
            owned = region is None
            if owned:
                if len(cache) >= self._IPC_LOCAL_KEPT and not self._transfers:
                    self._drop_ipc_local()
                region = self._engine.register_ptr(p, s)
            cache[(p, s)] = (region, owned)

    def _drop_ipc_local(self) -> None:
        cache, self._ipc_local = self._ipc_local, {}
        _release([region for region, owned in cache.values() if owned])

    def _post(self, op, what, conn_id, mr_ids, ptrs, sizes, metas, async_):
        conn = self._conns.get(conn_id) if type(conn_id) is int else None
        if conn is None:
            conn = self._conn(conn_id, what)
        if mr_ids is None:
            self._register_ipc_local(ptrs, sizes)
        elif not (mr_ids[0] in self._mrs if len(mr_ids) == 1
                  else all(map(self._mrs.__contains__, mr_ids))):
            missing = sorted({m for m in mr_ids if m not in self._mrs})
            raise NotFound(f"{what}: mr_id(s) {missing[:8]} are not registered "
                           "with this endpoint")
        # Positional: nanobind matches keywords by name on every call.
        t = conn.post(op, ptrs, sizes, metas, None, None, None, async_)
        if not async_:
            return True
        tid = t.id
        self._transfers[tid] = t
        return True, tid

    # The one-block calls check what _post checks inline when all is well (a known conn_id
    # and mr_id, a kept *_ipc range) and go through _post otherwise, which raises the
    # errors: a Python frame and the mr check's generality cost ~0.3 us a call.
    def _one(self, op, what, conn_id, mr_id, ptr, size, meta, async_):
        conn = self._conns.get(conn_id) if type(conn_id) is int else None
        if conn is None or mr_id not in self._mrs:
            return self._post(op, what, conn_id, (mr_id,), [ptr], [size], meta, async_)
        t = conn.post(op, [ptr], [size], meta, None, None, None, async_)
        if not async_:
            return True
        tid = t.id
        self._transfers[tid] = t
        return True, tid

    def write(self, conn_id, mr_id, ptr, size, meta):
        return self._one("write", "write()", conn_id, mr_id, ptr, size, meta, False)

    def read(self, conn_id, mr_id, ptr, size, meta):
        return self._one("read", "read()", conn_id, mr_id, ptr, size, meta, False)

    def write_async(self, conn_id, mr_id, ptr, size, meta):
        return self._one("write", "write_async()", conn_id, mr_id, ptr, size, meta, True)

    def read_async(self, conn_id, mr_id, ptr, size, meta):
        return self._one("read", "read_async()", conn_id, mr_id, ptr, size, meta, True)

    def _vec(self, op, what, conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs, async_):
        # One iov in lists (UCCL's default benchmark mode): the one-block path.
        if (num_iovs == 1 and type(meta_blob_v) is list and len(meta_blob_v) == 1
                and len(mr_id_v) == 1 and len(ptr_v) == 1 and len(size_v) == 1):
            return self._one(op, what, conn_id, mr_id_v[0], ptr_v[0], size_v[0],
                             meta_blob_v[0], async_)
        _check_len(num_iovs, mr_id_v, ptr_v, size_v, meta_blob_v)
        return self._post(op, what, conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, async_)

    def writev(self, conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs):
        return self._vec("write", "writev()", conn_id, mr_id_v, ptr_v, size_v, meta_blob_v,
                         num_iovs, False)

    def readv(self, conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs):
        return self._vec("read", "readv()", conn_id, mr_id_v, ptr_v, size_v, meta_blob_v,
                         num_iovs, False)

    def writev_async(self, conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs):
        return self._vec("write", "writev_async()", conn_id, mr_id_v, ptr_v, size_v,
                         meta_blob_v, num_iovs, True)

    def readv_async(self, conn_id, mr_id_v, ptr_v, size_v, meta_blob_v, num_iovs):
        return self._vec("read", "readv_async()", conn_id, mr_id_v, ptr_v, size_v,
                         meta_blob_v, num_iovs, True)

    # ----------------------------------------------------- same-host (IPC) calls
    def advertise_ipc(self, conn_id, ptr: int, size: int):
        """(True, 64-byte Ferry descriptor) of [ptr, ptr+size), which need not be
        registered. conn_id is not used (UCCL ignores it too): any peer may use it."""
        del conn_id
        ptr, size = int(ptr), int(size)
        region = self._covering(ptr, size)
        if region is None:
            region = self._ipc_regions[(ptr, size)] = self._engine.register_ptr(ptr, size)
        return True, region.advertise(ptr - region.address, size)

    def advertisev_ipc(self, conn_id, ptr_v, size_v):
        if len(ptr_v) != len(size_v):
            raise InvalidArgument(f"advertisev_ipc(): ptr_v and size_v differ in length "
                                  f"({len(ptr_v)} vs {len(size_v)})")
        return True, [self.advertise_ipc(conn_id, p, s)[1] for p, s in zip(ptr_v, size_v)]

    def _one_ipc(self, op, what, conn_id, ptr, size, info, async_):
        conn = self._conns.get(conn_id) if type(conn_id) is int else None
        hit = self._ipc_local.get((ptr, size))
        if conn is None or hit is None or not hit[0].registered:
            return self._post(op, what, conn_id, None, [ptr], [size], info, async_)
        t = conn.post(op, [ptr], [size], info, None, None, None, async_)
        if not async_:
            return True
        tid = t.id
        self._transfers[tid] = t
        return True, tid

    def write_ipc(self, conn_id, ptr, size, info):
        return self._one_ipc("write", "write_ipc()", conn_id, ptr, size, info, False)

    def read_ipc(self, conn_id, ptr, size, info):
        return self._one_ipc("read", "read_ipc()", conn_id, ptr, size, info, False)

    def write_ipc_async(self, conn_id, ptr, size, info):
        return self._one_ipc("write", "write_ipc_async()", conn_id, ptr, size, info, True)

    def read_ipc_async(self, conn_id, ptr, size, info):
        return self._one_ipc("read", "read_ipc_async()", conn_id, ptr, size, info, True)

    def writev_ipc(self, conn_id, ptr_v, size_v, info_v):
        _check_len(len(ptr_v), size_v, info_v)
        return self._post("write", "writev_ipc()", conn_id, None, ptr_v, size_v, info_v, False)

    def readv_ipc(self, conn_id, ptr_v, size_v, info_v):
        _check_len(len(ptr_v), size_v, info_v)
        return self._post("read", "readv_ipc()", conn_id, None, ptr_v, size_v, info_v, False)

    def writev_ipc_async(self, conn_id, ptr_v, size_v, info_v):
        _check_len(len(ptr_v), size_v, info_v)
        return self._post("write", "writev_ipc_async()", conn_id, None, ptr_v, size_v, info_v,
                          True)

    def readv_ipc_async(self, conn_id, ptr_v, size_v, info_v):
        _check_len(len(ptr_v), size_v, info_v)
        return self._post("read", "readv_ipc_async()", conn_id, None, ptr_v, size_v, info_v,
                          True)

    # ------------------------------------------------------------ completion
    def _finish(self, transfer_id: int) -> None:
        del self._transfers[transfer_id]
        completed = self._completed
        completed[transfer_id] = None
        if len(completed) > self._COMPLETED_MEMORY:
            del completed[next(iter(completed))]  # the oldest (dicts keep insertion order)

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
        self._finish(transfer_id)
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
                self._finish(transfer_id)
        return True

    # ---------------------------------------------------------- not provided
    def _two_sided(name):  # noqa: N805 - factory used in the class body
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
    send_ipc = _two_sided("send_ipc")
    recv_ipc = _two_sided("recv_ipc")
    send_ipc_async = _two_sided("send_ipc_async")
    recv_ipc_async = _two_sided("recv_ipc_async")
    del _two_sided


def _release(regions) -> None:
    for r in regions:
        try:
            r.deregister()
        except Exception:
            pass


def _check_len(num_iovs, *lists):
    n = num_iovs if type(num_iovs) is int else int(num_iovs)
    for lst in lists:
        # A bytes item is one descriptor for every iov, whatever its length.
        if len(lst) != n and not isinstance(lst, (bytes, bytearray)):
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
