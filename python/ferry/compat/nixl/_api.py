"""``nixl._api`` on Ferry: ``nixl_agent`` and ``nixl_agent_config`` with NIXL 1.5's
method names, arguments, return values and states ("DONE", "PROC", "ERR"), over
``_bindings.nixlAgent`` (a Ferry engine underneath).

What differs from NIXL is listed in docs/nixl_compat.md; in short: errors carry
Ferry's message naming the descriptor, region or agent; metadata is Ferry's and
loads only into ferry.compat.nixl agents; every transfer backend name is served
by the one Ferry engine of the agent.
"""
from __future__ import annotations

import logging
import pickle
import sys
from typing import Optional

import numpy as np

from . import _bindings
from ._types import DEFAULT_COMM_PORT, NIXL_INIT_AGENT, nixl_thread_sync_t
from ._types import as_payload as _as_payload

__all__ = ["DEFAULT_COMM_PORT", "nixl_agent", "nixl_agent_config", "nixl_backend_handle",
           "nixl_prepped_dlist_handle", "nixl_thread_sync_t", "nixl_xfer_handle"]

logger = logging.getLogger("nixl.api")

# Backends are known to users by name; the handle is an int they never see.
nixl_backend_handle = int

_STATES = {_bindings.NIXL_SUCCESS: "DONE", _bindings.NIXL_IN_PROG: "PROC"}


def _torch_tensor(obj) -> bool:
    """True for a torch.Tensor; torch is looked up, never imported (a tensor
    exists only if its user imported torch already)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _tensor_row(t):
    """(address, length, device, memory type) of a contiguous tensor, else None."""
    if not t.is_contiguous():
        logger.error("Please use a list of contiguous Tensors (got one of shape %s, strides %s)",
                     tuple(t.shape), tuple(t.stride()))
        return None
    dev = t.get_device()
    return (t.data_ptr(), t.numel() * t.element_size(), max(dev, 0),
            "VRAM" if dev >= 0 else "DRAM")


class nixl_prepped_dlist_handle:
    """A prepared descriptor list (from prep_xfer_dlist). release() frees it;
    dropping the last reference does too."""

    __slots__ = ("_handle", "_agent", "_released")

    def __init__(self, agent, value: int):
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._agent.releasedDlistH(self._handle)

    def __del__(self):
        if not getattr(self, "_released", True):
            try:
                self.release()
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle(0x{self._handle:x}, released={self._released})"


class nixl_xfer_handle:
    """A transfer request (from initialize_xfer or make_prepped_xfer). release()
    frees it, cancelling it if it is still running."""

    __slots__ = ("_handle", "_agent", "_released", "_req")

    def __init__(self, agent, value: int):
        self._handle = int(value)
        self._agent = agent
        self._released = False
        # The request itself, so that transfer / check_xfer_state (called in tight
        # polling loops) skip the handle lookup; None for a foreign agent object.
        find = getattr(agent, "request", None)
        self._req = find(self._handle) if find is not None else None

    def release(self) -> None:
        if not self._released:
            self._agent.releaseXferReq(self._handle)
            self._released = True

    def __del__(self):
        if not getattr(self, "_released", True):
            try:
                self.release()
            except Exception:
                pass

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(0x{self._handle:x}, released={self._released})"


class nixl_agent_config:
    """NIXL's agent options. Under Ferry, ``enable_prog_thread`` and
    ``num_threads`` are accepted and have no effect (the engine progresses on its
    own I/O threads); ``enable_listen_thread`` starts the metadata listener on
    ``listen_port`` (0: a free port); ``capture_telemetry`` enables
    get_xfer_telemetry (NIXL_TELEMETRY_ENABLE overrides it)."""

    def __init__(self, enable_prog_thread: bool = True, enable_listen_thread: bool = False,
                 listen_port: int = DEFAULT_COMM_PORT, capture_telemetry: bool = False,
                 num_threads: int = 0, backends: Optional[list] = None,
                 sync_mode: Optional[nixl_thread_sync_t] = None):
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError("sync_mode must be a nixl_thread_sync_t "
                            f"(got {type(sync_mode).__name__!r})")
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.backends = ["UCX"] if backends is None else list(backends)
        self.sync_mode = sync_mode


class nixl_agent:
    """A NIXL agent on Ferry. ``agent_name`` must be unique among the agents
    that talk to each other; ``nixl_conf`` defaults to ``nixl_agent_config()``."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None,
                 instantiate_all: bool = False):
        if nixl_conf is not None and instantiate_all:
            logger.warning("instantiate_all is ignored when a config is given")
            instantiate_all = False
        conf = nixl_conf or nixl_agent_config()
        sync = conf.sync_mode  # (NIXL_THREAD_SYNC_NONE is 0: test for None, not for truth)
        if sync is None:
            sync = (nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if conf.enable_listen
                    else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE)
        native_conf = _bindings.nixlAgentConfig()
        native_conf.useProgThread = conf.enable_pthread
        native_conf.useListenThread = conf.enable_listen
        native_conf.listenPort = conf.port
        native_conf.syncMode = sync.value
        native_conf.captureTelemetry = conf.capture_telemetry
        self.agent = _bindings.nixlAgent(agent_name, native_conf)
        self.name = agent_name
        self.notifs: dict = {}
        self.backends: dict = {}
        self.backend_mems: dict = {}
        self.backend_options: dict = {}
        self.plugin_list = self.agent.getAvailPlugins()
        self.plugin_b_options: dict = {}
        self.plugin_mem_types: dict = {}
        wanted = self.plugin_list if instantiate_all else conf.backends
        for name in wanted:
            if name in self.plugin_list:
                self.create_backend(name, {})
            else:
                logger.warning("Skipping backend %s: no such plugin (ferry.compat.nixl offers %s)",
                               name, ", ".join(self.plugin_list))
        self.nixl_mems = {"DRAM": _bindings.DRAM_SEG, "VRAM": _bindings.VRAM_SEG,
                          "FILE": _bindings.FILE_SEG, "BLOCK": _bindings.BLK_SEG,
                          "OBJ": _bindings.OBJ_SEG, "cpu": _bindings.DRAM_SEG,
                          "cuda": _bindings.VRAM_SEG}
        self.nixl_ops = {"WRITE": _bindings.NIXL_WRITE, "READ": _bindings.NIXL_READ}
        logger.info("Initialized NIXL agent %s on Ferry", agent_name)

    # --- Ferry additions ---------------------------------------------------------------
    @property
    def engine(self):
        """The ferry.Engine under this agent."""
        return self.agent.engine

    def close(self) -> None:
        """Stops the listener, cancels running transfers, closes the engine."""
        self.agent.close()

    # --- plugins and backends ------------------------------------------------------------
    def _handles(self, backends) -> list:
        return [self.backends[b] for b in backends or ()]

    def get_plugin_list(self) -> list:
        return self.plugin_list

    def _plugin_params(self, name: str) -> None:
        if name in self.plugin_list and name not in self.plugin_mem_types:
            self.plugin_b_options[name], self.plugin_mem_types[name] = \
                self.agent.getPluginParams(name)

    def get_plugin_mem_types(self, backend: str) -> list:
        self._plugin_params(backend)
        if backend not in self.plugin_mem_types:
            logger.warning("Plugin %s is not available", backend)
        return self.plugin_mem_types.get(backend, [])

    def get_plugin_params(self, backend: str) -> dict:
        self._plugin_params(backend)
        if backend not in self.plugin_b_options:
            logger.warning("Plugin %s is not available", backend)
        return self.plugin_b_options.get(backend, {})

    def get_backend_mem_types(self, backend: str) -> list:
        if backend not in self.backend_mems:
            logger.warning("Backend %s is not instantiated", backend)
        return self.backend_mems.get(backend, [])

    def get_backend_params(self, backend: str) -> dict:
        if backend not in self.backend_options:
            logger.warning("Backend %s is not instantiated", backend)
        return self.backend_options.get(backend, {})

    def create_backend(self, backend: str, initParams: Optional[dict] = None) -> None:
        handle = self.agent.createBackend(backend, dict(initParams or {}))
        self.backends[backend] = handle
        self.backend_options[backend], self.backend_mems[backend] = \
            self.agent.getBackendParams(handle)

    # --- descriptor lists ------------------------------------------------------------------
    def get_xfer_descs(self, descs, mem_type: Optional[str] = None):
        """A nixlXferDList from: a list of (address, length, device) tuples or an
        N x 3 numpy array (with mem_type), a contiguous tensor, a list of tensors on
        one device, or a nixlXferDList (returned as is). None, with the reason
        logged, for anything else."""
        return self._dlist(descs, mem_type, _bindings.nixlXferDList, 3)

    def get_reg_descs(self, descs, mem_type: Optional[str] = None):
        """A nixlRegDList from: a list of (address, length, device, meta) tuples or
        an N x 3 numpy array (with mem_type), a contiguous tensor, a list of tensors
        on one device, or a nixlRegDList (returned as is)."""
        return self._dlist(descs, mem_type, _bindings.nixlRegDList, 4)

    def _dlist(self, descs, mem_type, cls, width: int):
        other = _bindings.nixlRegDList if cls is _bindings.nixlXferDList else _bindings.nixlXferDList
        if isinstance(descs, cls):
            return descs
        if isinstance(descs, other):
            logger.error("%s given where a %s is needed", other.__name__, cls.__name__)
            return None
        if isinstance(descs, np.ndarray):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            mem = self.nixl_mems[mem_type]
            if descs.ndim != 2 or descs.shape[1] != 3:
                logger.error("Nx3 shape required for a descriptor list from a numpy array "
                             "(got %s)", descs.shape)
                return None
            return cls(mem, descs)
        if _torch_tensor(descs):
            row = _tensor_row(descs)
            return None if row is None else self._from_rows(cls, [row], width)
        if isinstance(descs, (list, tuple)) and descs and _torch_tensor(descs[0]):
            device = descs[0].device
            rows = []
            for t in descs:
                if t.device != device:
                    logger.error("Tensors on different devices (%s and %s) in one list",
                                 device, t.device)
                    return None
                row = _tensor_row(t)
                if row is None:
                    return None
                rows.append(row)
            return self._from_rows(cls, rows, width)
        if isinstance(descs, (list, tuple)) and (not descs or isinstance(descs[0], tuple)):
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
                return None
            mem = self.nixl_mems[mem_type]
            if descs and len(descs[0]) != width:
                logger.error("%d-tuple list needed for a %s", width, cls.__name__)
                return None
            return cls(mem, list(descs))
        logger.error("Cannot make a %s from %s", cls.__name__, type(descs).__name__)
        return None

    def _from_rows(self, cls, rows, width: int):
        mem = self.nixl_mems[rows[0][3]]
        if width == 3:
            return cls(mem, np.array([r[:3] for r in rows], dtype=np.uint64))
        return cls(mem, [(a, ln, dev, "") for a, ln, dev, _ in rows])

    def get_remote_descs(self, descs, mem_type: Optional[str] = None):
        """A nixlRemoteDList from (address, length, device, agent name) tuples."""
        if isinstance(descs, _bindings.nixlRemoteDList):
            return descs
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
            if mem_type is None:
                logger.error("Please specify a mem type")
                return None
            if len(descs[0]) != 4:
                logger.error("4-tuple list (addr, len, dev_id, agent_name) needed")
                return None
            return _bindings.nixlRemoteDList(self.nixl_mems[mem_type], list(descs))
        return None

    def get_serialized_descs(self, descs) -> bytes:
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes):
        return pickle.loads(serialized_descs)

    # --- memory -------------------------------------------------------------------------
    def register_memory(self, reg_list, mem_type: Optional[str] = None, backends=()):
        """Registers the ranges with the agent's Ferry engine; returns the
        nixlRegDList (for deregister_memory)."""
        descs = self.get_reg_descs(reg_list, mem_type)
        if descs is None:
            raise _bindings.nixlInvalidParamError(
                f"register_memory: {type(reg_list).__name__} is not memory this API can register "
                "(see the error logged just before)")
        self.agent.registerMem(descs, self._handles(backends))
        return descs

    def deregister_memory(self, dereg_list, backends=()) -> None:
        self.agent.deregisterMem(dereg_list, self._handles(backends))

    def query_memory(self, reg_list, backend: str, mem_type: Optional[str] = None) -> list:
        descs = self.get_reg_descs(reg_list, mem_type)
        if backend not in self.backends:
            raise ValueError(f"Backend '{backend}' not found. Available backends: "
                             f"{list(self.backends)}")
        return self.agent.queryMem(descs, self.backends[backend])

    # --- transfers ----------------------------------------------------------------------
    def make_connection(self, remote_agent: str, backends=()) -> None:
        self.agent.makeConnection(remote_agent, self._handles(backends))

    def prep_xfer_dlist(self, agent_name: str, xfer_list, mem_type: Optional[str] = None,
                        backends=()) -> nixl_prepped_dlist_handle:
        """Prepares descriptors once for make_prepped_xfer: local ones with
        agent_name "" or "NIXL_INIT_AGENT", a remote agent's with its name. An
        N x 5 numpy array is NIXL 1.5's strided form (address, length, device,
        stride, count) and needs mem_type."""
        local = agent_name in ("", "NIXL_INIT_AGENT", NIXL_INIT_AGENT)
        name = NIXL_INIT_AGENT if local else agent_name
        handles = self._handles(backends)
        if isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            value = self.agent.prepXferDlist(name, self.nixl_mems[mem_type], xfer_list, handles)
        else:
            descs = self.get_xfer_descs(xfer_list, mem_type)
            if descs is None:
                raise _bindings.nixlInvalidParamError(
                    f"prep_xfer_dlist: {type(xfer_list).__name__} is not a descriptor list "
                    "(see the error logged just before)")
            value = self.agent.prepXferDlist(name, descs, handles)
        return nixl_prepped_dlist_handle(self.agent, value)

    def make_prepped_xfer(self, operation: str, local_xfer_side, local_indices,
                          remote_xfer_side, remote_indices, notif_msg: bytes = b"",
                          backends=(), skip_desc_merge: bool = False) -> nixl_xfer_handle:
        """A transfer of the prepared descriptors chosen by index, local_indices[i]
        paired with remote_indices[i]."""
        op = self.nixl_ops[operation]
        value = self.agent.makeXferReq(op, local_xfer_side._handle, local_indices,
                                       remote_xfer_side._handle, remote_indices, notif_msg,
                                       self._handles(backends), skip_desc_merge)
        return nixl_xfer_handle(self.agent, value)

    def initialize_xfer(self, operation: str, local_descs, remote_descs, remote_agent: str,
                        notif_msg: bytes = b"", backends=()) -> nixl_xfer_handle:
        """A transfer of local_descs[i] to/from remote_descs[i] of remote_agent."""
        op = self.nixl_ops[operation]
        value = self.agent.createXferReq(op, local_descs, remote_descs, remote_agent, notif_msg,
                                         self._handles(backends))
        return nixl_xfer_handle(self.agent, value)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Posts the transfer: "DONE" if it completed within the call, else "PROC"."""
        req = handle._req
        if req is not None and not handle._released and handle._agent is self.agent:
            return _STATES.get(req.post(notif_msg if isinstance(notif_msg, bytes)
                                        else _as_payload(notif_msg)), "ERR")
        return _STATES.get(self.agent.postXferReq(handle._handle, notif_msg), "ERR")

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """ "DONE" or "PROC"; a failed transfer raises its error (as NIXL's binding)."""
        req = handle._req
        if req is not None and not handle._released and handle._agent is self.agent:
            return _STATES.get(req.status(), "ERR")
        return _STATES.get(self.agent.getXferStatus(handle._handle), "ERR")

    def get_xfer_telemetry(self, handle: nixl_xfer_handle):
        return self.agent.getXferTelemetry(handle._handle)

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle):
        return self.agent.estimateXferCost(req_handle._handle)

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        backend = self.agent.queryXferBackend(handle._handle)
        return next(name for name, h in self.backends.items() if h == backend)

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    def prep_mem_view(self, dlist, *, backends=None) -> int:
        return self.agent.prepMemView(dlist, self._handles(backends))

    def release_mem_view(self, mvh: int) -> None:
        self.agent.releaseMemView(mvh)

    # --- notifications ------------------------------------------------------------------
    def get_new_notifs(self, backends=()) -> dict:
        """{remote agent name: [message, ...]} of what arrived since the last call."""
        return self.agent.getNotifs({}, self._handles(backends))

    def update_notifs(self, backends=()) -> dict:
        """Adds what arrived to self.notifs (kept until check_remote_xfer_done
        consumes it) and returns it."""
        self.notifs = self.agent.getNotifs(self.notifs, self._handles(backends))
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: bytes, backends=(),
                               tag_is_prefix: bool = True) -> bool:
        """True once a message from remote_agent_name starting with (or, with
        tag_is_prefix=False, containing) lookup_tag arrived; that one message is
        consumed."""
        self.update_notifs(backends)
        if isinstance(remote_agent_name, (bytes, bytearray)):
            remote_agent_name = bytes(remote_agent_name).decode()
        msgs = self.notifs.get(remote_agent_name, [])
        for i, msg in enumerate(msgs):
            if msg.startswith(lookup_tag) if tag_is_prefix else lookup_tag in msg:
                del msgs[i]
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes,
                   backend: Optional[str] = None) -> None:
        self.agent.genNotif(remote_agent_name, notif_msg,
                            [] if backend is None else [self.backends[backend]])

    # --- metadata -----------------------------------------------------------------------
    def get_agent_metadata(self) -> bytes:
        return self.agent.getLocalMD()

    def get_partial_agent_metadata(self, descs, inc_conn_info: bool = False,
                                   backends=()) -> bytes:
        return self.agent.getLocalPartialMD(descs, inc_conn_info, self._handles(backends))

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Loads an agent's metadata; returns its name (bytes, as NIXL)."""
        return self.agent.loadRemoteMD(metadata)

    def remove_remote_agent(self, agent: str) -> None:
        self.agent.invalidateRemoteMD(agent)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.agent.sendLocalMD(ip_addr, port)

    def send_partial_agent_metadata(self, descs, inc_conn_info: bool = False, backends=(),
                                    ip_addr: str = "", port: int = DEFAULT_COMM_PORT,
                                    label: str = "") -> None:
        self.agent.sendLocalPartialMD(descs, inc_conn_info, self._handles(backends), ip_addr,
                                      port, label)

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "",
                              port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        self.agent.fetchRemoteMD(remote_agent, ip_addr, port, label)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.agent.invalidateLocalMD(ip_addr, port)

    def check_remote_metadata(self, agent: str, descs=None) -> bool:
        return self.agent.checkRemoteMD(agent, descs) == _bindings.NIXL_SUCCESS
