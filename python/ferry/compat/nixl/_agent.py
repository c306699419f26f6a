"""``nixlAgent`` on Ferry: what NIXL's native agent does, method for method
(the names ``nixl._bindings`` gives them), over one ``ferry.Engine``.

Every NIXL backend name that moves memory between agents (UCX, LIBFABRIC, UCCL,
MOONCAKE, and FERRY itself) is served by that engine, which picks its transport
per peer (shm for host memory on one host, cuda_ipc for GPU memory on one host,
tcp or fabric across hosts). POSIX is offered for ``query_memory`` of files only.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import struct
import threading
import weakref

import numpy as np

from ... import _errors
from ._descs import nixlRegDList, nixlRemoteDList, nixlXferDList
from ._exchange import Exchange
from ._metadata import decode as decode_metadata, encode as encode_metadata
from ._regions import Region, RegionTable
from ._types import (
    MEM_NAMES,
    NIXL_INIT_AGENT,
    nixl_mem_t,
    nixl_status_t,
    nixl_thread_sync_t,
    nixl_xfer_op_t,
    nixlBackendError,
    nixlInvalidParamError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotSupportedError,
    as_name,
    as_payload,
    from_ferry,
)
from ._xfer import XferRequest

_log = logging.getLogger("ferry.compat.nixl")

# Backends served by the Ferry engine, and the memory they carry.
TRANSFER_BACKENDS = ("UCX", "FERRY", "LIBFABRIC", "UCCL", "MOONCAKE")
_TRANSFER_MEMS = ["DRAM", "VRAM"]
# POSIX: query_memory of files, nothing else.
PLUGINS = {name: _TRANSFER_MEMS for name in TRANSFER_BACKENDS}
PLUGINS["POSIX"] = ["FILE"]

_NOTIF_MAGIC = b"FNX1"
_NOTIF_HEAD = struct.Struct("<4sH")


class nixlAgentConfig:
    """NIXL's agent configuration. Positional order as NIXL's constructors:
    useProgThread, useListenThread, listenPort, syncMode, pthrDelay, lthrDelay,
    etcdWatchTimeout, captureTelemetry. Ferry's engine always progresses on its own
    I/O threads: ``useProgThread`` and the delays are accepted and unused."""

    _FIELDS = ("useProgThread", "useListenThread", "listenPort", "syncMode", "pthrDelay",
               "lthrDelay", "etcdWatchTimeout", "captureTelemetry")

    def __init__(self, *args):
        if len(args) > len(self._FIELDS):
            raise TypeError(f"nixlAgentConfig takes at most {len(self._FIELDS)} arguments")
        self.useProgThread = True
        self.useListenThread = False
        self.listenPort = 0
        self.syncMode = int(nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT)
        self.pthrDelay = 0
        self.lthrDelay = 100000
        self.etcdWatchTimeout = 5000000
        self.captureTelemetry = False
        for field, value in zip(self._FIELDS, args):
            setattr(self, field, int(value) if field == "syncMode" else value)


def _telemetry_enabled(config: nixlAgentConfig) -> bool:
    """NIXL_TELEMETRY_ENABLE, when set, decides; else the config's captureTelemetry."""
    env = os.environ.get("NIXL_TELEMETRY_ENABLE")
    if env is not None:
        return env.strip().lower() in ("y", "yes", "1", "true", "on")
    return bool(config.captureTelemetry)


class _RemoteAgent:
    __slots__ = ("name", "engine_md", "regions", "peer")

    def __init__(self, name: str, engine_md: bytes):
        self.name = name
        self.engine_md = engine_md
        self.regions = RegionTable(f"agent '{name}'")
        self.peer = None


class _Prepped:
    """A descriptor list prepared by prep_xfer_dlist: each descriptor's region
    (index into ``regions``), offset in it and length, found once."""

    __slots__ = ("agent", "mem", "regions", "index", "offsets", "lengths", "descs", "addresses")

    def __init__(self, agent, mem, regions, index, offsets, lengths, addresses):
        self.agent = agent          # None: local side; else the remote agent's name
        self.mem = mem
        self.regions = regions
        self.index = index
        self.offsets = offsets
        self.lengths = lengths
        self.addresses = addresses  # the descriptors' own addresses (the local side's column)
        # The remote regions' Ferry descriptors, once (handed to each prepare call).
        self.descs = [r.handle for r in regions] if agent is not None else None

    @property
    def count(self) -> int:
        return int(self.lengths.size)


def _expand_strided(arr: np.ndarray) -> np.ndarray:
    """NIXL 1.5's N x 5 (address, length, device, stride, count) rows as N' x 3."""
    arr = np.asarray(arr, dtype=np.uint64)
    counts = arr[:, 4].astype(np.int64)
    rows = np.repeat(arr[:, :3], counts, axis=0)
    step = np.concatenate([np.arange(c, dtype=np.uint64) for c in counts]) if len(arr) else \
        np.zeros(0, np.uint64)
    rows[:, 0] += step * np.repeat(arr[:, 3], counts)
    return rows


class nixlAgent:
    """The agent under ``nixl._api.nixl_agent`` (its ``.agent`` attribute)."""

    _handle_ids = itertools.count(0x1000)

    def __init__(self, name, config: nixlAgentConfig | None = None):
        if not isinstance(name, str) or not name:
            raise ValueError("a NIXL agent needs a non-empty name")
        config = config or nixlAgentConfig()
        self.name = name
        self.config = config
        self.telemetry = _telemetry_enabled(config)
        self._mu = threading.RLock()
        from ... import Engine
        listen = os.environ.get("FERRY_NIXL_LISTEN", "0.0.0.0:0")
        try:
            self.engine = Engine(listen)
        except _errors.FerryError as exc:
            raise from_ferry(exc, f"agent '{name}': starting its Ferry engine on {listen}")
        self._local = RegionTable(f"this agent '{name}'")
        self._remotes: dict[str, _RemoteAgent] = {}
        self._backends: dict[int, str] = {}
        self._prepped: dict[int, _Prepped] = {}
        self._xfers: dict[int, XferRequest] = {}
        # The last released handles, to say "was released" rather than "unknown".
        self._released_xfers: collections.deque = collections.deque(maxlen=4096)
        self._notif_new: dict[str, list] = {}
        self._partial: dict[str, bytes] = {}
        try:
            self.exchange = Exchange(_AgentView(self), bool(config.useListenThread),
                                     int(config.listenPort))
        except OSError as exc:
            self.engine.close()
            raise nixlBackendError(f"agent '{name}': its metadata listener cannot listen on port "
                                   f"{config.listenPort}: {exc}") from None
        self._closed = False

    # --- plugins and backends ---------------------------------------------------------
    def getAvailPlugins(self) -> list:
        return list(PLUGINS)

    def _plugin(self, name: str) -> list:
        if name not in PLUGINS:
            raise nixlNotFoundError(f"no NIXL plugin named '{name}'; ferry.compat.nixl offers "
                                    f"{', '.join(PLUGINS)}")
        return PLUGINS[name]

    def getPluginParams(self, name: str):
        return {}, list(self._plugin(name))

    def createBackend(self, name: str, params=None) -> int:
        self._plugin(name)
        handle = next(self._handle_ids)
        self._backends[handle] = name
        return handle

    def getBackendParams(self, handle: int):
        name = self._backend_name(handle)
        return {"ferry_engine_id": f"0x{self.engine.id:016x}"}, list(PLUGINS[name])

    def _backend_name(self, handle: int) -> str:
        try:
            return self._backends[int(handle)]
        except (KeyError, TypeError, ValueError):
            raise nixlNotFoundError(f"backend handle {handle!r} was not created by agent "
                                    f"'{self.name}'") from None

    def _check_backends(self, backends, mem=None) -> None:
        for h in backends or ():
            name = self._backend_name(h)
            if mem is not None and MEM_NAMES[mem] not in PLUGINS[name]:
                raise nixlNotSupportedError(f"backend {name} does not carry {MEM_NAMES[mem]} "
                                            f"memory (it offers {', '.join(PLUGINS[name])})")

    # --- memory -----------------------------------------------------------------------
    def registerMem(self, descs: nixlRegDList, backends=()) -> nixl_status_t:
        if not isinstance(descs, nixlRegDList):
            raise nixlInvalidParamError(f"register_memory needs a nixlRegDList, not "
                                        f"{type(descs).__name__}")
        mem = self._transfer_mem(descs, "register")
        self._check_backends(backends, mem)
        added = []
        try:
            for i in range(descs.descCount()):
                addr, length, dev, meta = descs[i]
                where = f"registering descriptor {i} ({MEM_NAMES[mem]} [0x{addr:x}, +{length}) " \
                        f"device {dev})"
                if length == 0:
                    raise nixlInvalidParamError(f"{where}: the length is 0")
                try:
                    region = self.engine.register_ptr(addr, length)
                    desc = region.advertise()
                except _errors.FerryError as exc:
                    raise from_ferry(exc, where) from None
                r = Region(mem, addr, length, dev, (region, desc), meta)
                self._local.add(r)
                added.append(r)
        except BaseException:
            for r in added:  # all or nothing, as NIXL
                self._local.remove(r.key)
                r.handle[0].deregister()
            raise
        return nixl_status_t.NIXL_SUCCESS

    def deregisterMem(self, descs: nixlRegDList, backends=()) -> nixl_status_t:
        if not isinstance(descs, nixlRegDList):
            raise nixlInvalidParamError(f"deregister_memory needs a nixlRegDList, not "
                                        f"{type(descs).__name__}")
        mem = self._transfer_mem(descs, "deregister")
        keys = []
        for i in range(descs.descCount()):
            addr, length, dev, _ = descs[i]
            key = (int(mem), addr, length, dev)
            if self._local.find_exact(key) is None:
                raise nixlNotFoundError(
                    f"deregistering descriptor {i} ({MEM_NAMES[mem]} [0x{addr:x}, +{length}) "
                    f"device {dev}): agent '{self.name}' has no such registration")
            keys.append(key)
        for key in keys:
            r = self._local.remove(key)
            if r is not None:
                r.handle[0].deregister()
        return nixl_status_t.NIXL_SUCCESS

    def _transfer_mem(self, descs, what: str) -> nixl_mem_t:
        if not isinstance(descs, (nixlRegDList, nixlXferDList)):
            raise nixlInvalidParamError(f"{what}: expected a descriptor list, got "
                                        f"{type(descs).__name__}")
        mem = descs.getType()
        if mem not in (nixl_mem_t.DRAM_SEG, nixl_mem_t.VRAM_SEG):
            raise nixlNotSupportedError(f"{what}: {MEM_NAMES[mem]} memory is not supported by "
                                        "ferry.compat.nixl (DRAM and VRAM are)")
        return mem

    def queryMem(self, descs: nixlRegDList, backend: int):
        name = self._backend_name(backend)
        if name != "POSIX" or descs.getType() != nixl_mem_t.FILE_SEG:
            raise nixlNotSupportedError(f"query_memory: backend {name} with "
                                        f"{MEM_NAMES[descs.getType()]} memory is not supported "
                                        "(POSIX with FILE is)")
        out = []
        for i in range(descs.descCount()):
            path = descs[i][3]
            try:
                st = os.stat(path)
            except OSError:
                out.append(None)
                continue
            out.append({"size": str(st.st_size), "mode": str(st.st_mode),
                        "mtime": str(int(st.st_mtime))})
        return out

    # --- metadata ---------------------------------------------------------------------
    def _region_rows(self, regions):
        return [(r.mem, r.address, r.length, r.device, r.handle[1]) for r in regions]

    def getLocalMD(self) -> bytes:
        return encode_metadata(self.name, self.engine.metadata(),
                               self._region_rows(self._local.all()), full=True)

    def getLocalPartialMD(self, descs: nixlRegDList, inc_conn_info=False, backends=()) -> bytes:
        picked = []
        if descs is not None and descs.descCount():
            mem = self._transfer_mem(descs, "partial metadata")
            regions, idx, _ = self._local.locate(mem, descs._arr, "partial metadata")
            picked = [regions[int(i)] for i in dict.fromkeys(idx.tolist())]
        return encode_metadata(self.name, self.engine.metadata() if inc_conn_info else None,
                               self._region_rows(picked), full=False)

    def loadRemoteMD(self, metadata) -> bytes:
        md = decode_metadata(metadata)
        if md.name == self.name:
            raise nixlInvalidParamError(f"agent '{self.name}' was given its own metadata")
        with self._mu:
            rec = self._remotes.get(md.name)
            if rec is None:
                if md.engine is None:
                    raise nixlInvalidParamError(
                        f"partial metadata of agent '{md.name}' carries no connection info and "
                        f"the agent is not known to '{self.name}' yet: send it with "
                        "inc_conn_info=True first")
                rec = self._remotes[md.name] = _RemoteAgent(md.name, md.engine)
            elif md.engine is not None and md.engine != rec.engine_md:
                rec.engine_md, rec.peer = md.engine, None  # restarted: connect anew
            if md.full:
                rec.regions = RegionTable(f"agent '{md.name}'")
            for r in md.regions:
                rec.regions.add_or_replace(r)
        return md.name.encode()

    def invalidateRemoteMD(self, name) -> nixl_status_t:
        name = as_name(name)
        with self._mu:
            if self._remotes.pop(name, None) is None:
                _log.warning("agent '%s': remove_remote_agent('%s'): no such agent", self.name,
                             name)
                return nixl_status_t.NIXL_ERR_NOT_FOUND
        return nixl_status_t.NIXL_SUCCESS

    def checkRemoteMD(self, name, descs=None) -> nixl_status_t:
        rec = self._remotes.get(as_name(name))
        if rec is None:
            return nixl_status_t.NIXL_ERR_NOT_FOUND
        if descs is not None and descs.descCount():
            try:
                rec.regions.locate(descs.getType(), descs._arr, "remote")
            except nixlNotFoundError:
                return nixl_status_t.NIXL_ERR_NOT_FOUND
        return nixl_status_t.NIXL_SUCCESS

    def _remote(self, name, what: str) -> _RemoteAgent:
        name = as_name(name)
        rec = self._remotes.get(name)
        if rec is None:
            known = ", ".join(f"'{n}'" for n in self._remotes) or "none"
            raise nixlNotFoundError(f"{what}: unknown remote agent '{name}' (agent '{self.name}' "
                                    f"has metadata of: {known}; add_remote_agent or "
                                    "fetch_remote_metadata first)")
        return rec

    def _peer(self, rec: _RemoteAgent):
        peer = rec.peer
        if peer is None:
            try:
                peer = rec.peer = self.engine.connect(rec.engine_md)
            except _errors.FerryError as exc:
                raise from_ferry(exc, f"agent '{self.name}' connecting to agent '{rec.name}'")
        return peer

    def makeConnection(self, name, backends=()) -> nixl_status_t:
        self._peer(self._remote(name, "make_connection"))
        return nixl_status_t.NIXL_SUCCESS

    # metadata exchange (socket peers or the etcd directory)
    def sendLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        if ip_addr:
            self.exchange.send_to_peer(ip_addr, port, self.getLocalMD())
        else:
            self._store_call("send_local_metadata", self.exchange.publish, self.getLocalMD())

    def _store_call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except _errors.FerryError as exc:
            raise from_ferry(exc, f"agent '{self.name}': {what} through etcd") from None

    def sendLocalPartialMD(self, descs, inc_conn_info=False, backends=(), ip_addr="", port=0,
                           label="") -> None:
        md = self.getLocalPartialMD(descs, inc_conn_info, backends)
        if ip_addr:
            self.exchange.send_to_peer(ip_addr, port, md)
        else:
            self._store_call("send_partial_agent_metadata", self.exchange.publish, md, label)

    def fetchRemoteMD(self, name, ip_addr: str = "", port: int = 0, label: str = "") -> None:
        name = as_name(name)
        if ip_addr:
            self.exchange.fetch_from_peer(name, ip_addr, port, label)
        else:
            self._store_call("fetch_remote_metadata", self.exchange.fetch_from_store, name, label)

    def invalidateLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        if ip_addr:
            self.exchange.invalidate_at_peer(ip_addr, port)
        else:
            self.exchange.withdraw()

    # --- descriptor lists and transfer requests -----------------------------------------
    def _resolve(self, agent_name, descs: nixlXferDList, side: str) -> _Prepped:
        if not isinstance(descs, nixlXferDList):
            raise nixlInvalidParamError(f"{side} descriptors must be a nixlXferDList, not "
                                        f"{type(descs).__name__}")
        mem = self._transfer_mem(descs, f"{side} descriptors")
        return self._resolve_rows(agent_name, mem, descs._arr, side)

    def _resolve_rows(self, agent_name, mem, arr, side: str) -> _Prepped:
        if agent_name is None:
            regions, idx, offsets = self._local.locate(mem, arr, side)
            return _Prepped(None, mem, regions, idx, offsets, arr[:, 1].copy(), arr[:, 0].copy())
        name = as_name(agent_name)
        if name == self.name:
            raise nixlNotSupportedError(f"loopback transfers (agent '{name}' to itself) are not "
                                        "supported by ferry.compat.nixl")
        rec = self._remote(name, f"{side} descriptors")
        regions, idx, offsets = rec.regions.locate(mem, arr, f"{side} (agent '{name}')")
        return _Prepped(name, mem, regions, idx, offsets, arr[:, 1].copy(), arr[:, 0].copy())

    def prepXferDlist(self, agent_name, descs, *rest) -> int:
        """(agent_name, nixlXferDList[, backends]) or, NIXL 1.5's strided form,
        (agent_name, mem_type, N x 5 array[, backends])."""
        local = agent_name in (NIXL_INIT_AGENT, b"", "NIXL_INIT_AGENT")
        if isinstance(descs, nixlXferDList):
            p = self._resolve(None if local else agent_name, descs, "prepared")
        else:
            mem = nixl_mem_t(descs)
            arr, rest = rest[0], rest[1:]
            p = self._resolve_rows(None if local else agent_name, mem, _expand_strided(arr),
                                   "prepared")
        handle = next(self._handle_ids)
        with self._mu:
            self._prepped[handle] = p
        return handle

    def releasedDlistH(self, handle) -> nixl_status_t:
        with self._mu:
            if self._prepped.pop(int(handle), None) is None:
                raise nixlNotFoundError(f"prepared descriptor list handle 0x{int(handle):x} is "
                                        f"not live in agent '{self.name}' (released already, or "
                                        "from another agent)")
        return nixl_status_t.NIXL_SUCCESS

    def _prepped_side(self, handle, want_local: bool) -> _Prepped:
        p = self._prepped.get(int(handle)) if isinstance(handle, (int, np.integer)) else None
        side = "local" if want_local else "remote"
        if p is None:
            raise nixlInvalidParamError(f"{side} side handle {handle!r} is not a live prepared "
                                        f"descriptor list of agent '{self.name}'")
        if (p.agent is None) != want_local:
            got = "local" if p.agent is None else f"remote (agent '{p.agent}')"
            raise nixlInvalidParamError(f"the {side} side handle is a {got} prepared list")
        return p

    @staticmethod
    def _indices(values, count: int, side: str) -> np.ndarray:
        arr = np.asarray(values)
        if arr.ndim != 1:
            raise nixlInvalidParamError(f"{side} indices must be one-dimensional, not {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise nixlInvalidParamError(f"{side} indices must be integers, not {arr.dtype}")
        arr = arr.astype(np.intp, copy=False)
        bad = np.flatnonzero((arr < 0) | (arr >= count))
        if bad.size:
            i = int(bad[0])
            raise nixlInvalidParamError(f"{side} index {int(arr[i])} (position {i}) is outside "
                                        f"the prepared list of {count} descriptor(s)")
        return arr

    def makeXferReq(self, op, local_side, local_indices, remote_side, remote_indices,
                    notif_msg=b"", backends=(), skip_desc_merge=False) -> int:
        op = nixl_xfer_op_t(op)
        lp = self._prepped_side(local_side, True)
        rp = self._prepped_side(remote_side, False)
        li = self._indices(local_indices, lp.count, "local")
        ri = self._indices(remote_indices, rp.count, "remote")
        if li.size != ri.size:
            raise nixlInvalidParamError(f"{li.size} local and {ri.size} remote indices: they pair "
                                        "one to one")
        return self._request(op, lp, li, rp, ri, notif_msg)

    def createXferReq(self, op, local_descs, remote_descs, remote_agent, notif_msg=b"",
                      backends=()) -> int:
        op = nixl_xfer_op_t(op)
        lp = self._resolve(None, local_descs, "local")
        rp = self._resolve(remote_agent, remote_descs, "remote")
        if lp.count != rp.count:
            raise nixlInvalidParamError(f"{lp.count} local and {rp.count} remote descriptors: "
                                        "they pair one to one")
        return self._request(op, lp, None, rp, None, notif_msg)

    def _request(self, op, lp: _Prepped, li, rp: _Prepped, ri, notif_msg) -> int:
        pick = (lambda a, i: a if i is None else a[i])
        lengths = pick(lp.lengths, li)
        r_lengths = pick(rp.lengths, ri)
        if lengths.size == 0:
            raise nixlInvalidParamError("a transfer needs at least one descriptor")
        bad = np.flatnonzero(lengths != r_lengths)
        if bad.size:
            i = int(bad[0])
            raise nixlInvalidParamError(f"descriptor pair {i}: local length {int(lengths[i])} "
                                        f"but remote length {int(r_lengths[i])}")
        rec = self._remote(rp.agent, "transfer")
        req = XferRequest(self, op, rp.agent, self._peer(rec), pick(lp.addresses, li), lengths,
                          rp.descs, pick(rp.index, ri), pick(rp.offsets, ri),
                          as_payload(notif_msg or b""))
        handle = next(self._handle_ids)
        with self._mu:
            self._xfers[handle] = req
        return handle

    def _xfer(self, handle, what: str) -> XferRequest:
        req = self._xfers.get(int(handle)) if isinstance(handle, (int, np.integer)) else None
        if req is None:
            state = "was released" if handle in self._released_xfers else \
                "is not a transfer handle of this agent"
            raise nixlNotFoundError(f"{what}: transfer handle {handle!r} {state} (agent "
                                    f"'{self.name}')")
        return req

    def request(self, handle):
        """The XferRequest behind a live handle, or None (for nixl_xfer_handle's fast path)."""
        return self._xfers.get(int(handle))

    def postXferReq(self, handle, notif_msg=b"") -> nixl_status_t:
        return self._xfer(handle, "transfer").post(as_payload(notif_msg or b""))

    def getXferStatus(self, handle) -> nixl_status_t:
        return self._xfer(handle, "check_xfer_state").status()

    def getXferTelemetry(self, handle):
        req = self._xfer(handle, "get_xfer_telemetry")
        if not self.telemetry:
            raise nixlNoTelemetryError(f"agent '{self.name}' does not capture telemetry "
                                       "(nixl_agent_config(capture_telemetry=True) or "
                                       "NIXL_TELEMETRY_ENABLE=y)")
        return req.telemetry()

    def queryXferBackend(self, handle) -> int:
        self._xfer(handle, "query_xfer_backend")
        for h, name in self._backends.items():
            if name in TRANSFER_BACKENDS:
                return h
        raise nixlNotFoundError(f"agent '{self.name}' has no transfer backend")

    def estimateXferCost(self, handle):
        self._xfer(handle, "estimate_xfer_cost")
        raise nixlNotSupportedError("estimate_xfer_cost is not supported by ferry.compat.nixl")

    def releaseXferReq(self, handle) -> nixl_status_t:
        with self._mu:
            req = self._xfer(handle, "release_xfer_handle")
            del self._xfers[int(handle)]
            self._released_xfers.append(int(handle))
        req.cancel()  # an active transfer is cancelled, as NIXL attempts
        return nixl_status_t.NIXL_SUCCESS

    def prepMemView(self, *args, **kwargs):
        raise nixlNotSupportedError("prep_mem_view needs UCX's GPU device API, which "
                                    "ferry.compat.nixl does not have")

    def releaseMemView(self, *args, **kwargs):
        raise nixlNotSupportedError("release_mem_view: no memory views under ferry.compat.nixl")

    # --- notifications ----------------------------------------------------------------
    def frame_notif(self, msg: bytes) -> bytes:
        """A notification carries the sender's name: the target need not know us."""
        raw = self.name.encode()
        return _NOTIF_HEAD.pack(_NOTIF_MAGIC, len(raw)) + raw + msg

    def _drain(self) -> None:
        for peer_id, payload in self.engine.notifications():
            payload = bytes(payload)
            if payload[:4] == _NOTIF_MAGIC and len(payload) >= _NOTIF_HEAD.size:
                _, n = _NOTIF_HEAD.unpack_from(payload)
                sender = payload[_NOTIF_HEAD.size:_NOTIF_HEAD.size + n].decode(errors="replace")
                msg = payload[_NOTIF_HEAD.size + n:]
            else:  # from a plain ferry.Engine
                sender, msg = f"ferry-engine-{peer_id:016x}", payload
            self._notif_new.setdefault(sender, []).append(msg)

    def getNotifs(self, notif_map=None, backends=()) -> dict:
        notif_map = {} if notif_map is None else notif_map
        with self._mu:
            self._drain()
            new, self._notif_new = self._notif_new, {}
        for sender, msgs in new.items():
            notif_map.setdefault(sender, []).extend(msgs)
        return notif_map

    def genNotif(self, remote_agent, msg, backends=()) -> nixl_status_t:
        rec = self._remote(remote_agent, "send_notif")
        try:
            self._peer(rec).notify(self.frame_notif(as_payload(msg)))
        except _errors.FerryError as exc:
            raise from_ferry(exc, f"send_notif to agent '{rec.name}'") from None
        return nixl_status_t.NIXL_SUCCESS

    # --- life cycle -------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.exchange.close()
        for req in list(self._xfers.values()):
            req.cancel()
        self._xfers.clear()
        self.engine.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<ferry.compat.nixl agent '{self.name}' engine 0x{self.engine.id:016x}>"


class _AgentView:
    """What the exchange threads may call, through a weak reference: an agent
    nobody holds any more is collected (and closed) although its listener runs."""

    def __init__(self, agent: nixlAgent):
        self._ref = weakref.ref(agent)
        self.name = agent.name

    def _agent(self) -> nixlAgent:
        agent = self._ref()
        if agent is None:
            raise RuntimeError(f"agent '{self.name}' is gone")
        return agent

    def local_metadata(self, label: str) -> bytes:
        return self._agent().getLocalMD()

    def engine_metadata(self) -> bytes:
        return self._agent().engine.metadata()

    def load_metadata(self, md: bytes) -> None:
        self._agent().loadRemoteMD(md)

    def forget_agent(self, name: str, quiet: bool = False) -> None:
        agent = self._agent()
        with agent._mu:
            agent._remotes.pop(name, None)
