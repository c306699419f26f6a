"""NIXL's metadata exchange: agents send, fetch and invalidate each other's
metadata either peer to peer over a socket (the agent's listener thread, NIXL's
``enable_listen_thread``) or through a central store (NIXL's etcd mode, here
Ferry's etcd directory, ``ferry.directory``).

Both directions are asynchronous, as in NIXL: ``send_local_metadata`` and
``fetch_remote_metadata`` queue work for one background thread per agent and
return; ``check_remote_metadata`` tells when a fetched agent has arrived.

Socket messages (Ferry's own, both ends are ferry.compat.nixl agents):
``FNXS`` | u8 op | u32 body length | body. Ops: 1 metadata (body: metadata
bytes, to load), 2 fetch (body: u16 name length, name, label; answered by a
metadata message whose body is empty when the asked agent is not this one),
4 invalidate (body: the agent name to forget).
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import struct
import threading
import time

from ._types import nixlInvalidParamError, nixlNotSupportedError

_log = logging.getLogger("ferry.compat.nixl")
_MAGIC = b"FNXS"
_HDR = struct.Struct("<4sBI")
OP_METADATA, OP_FETCH, OP_INVALIDATE = 1, 2, 4
_MAX_BODY = 256 << 20


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise nixlInvalidParamError(f"{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise nixlInvalidParamError(f"{name}={raw!r} must be positive")
    return value


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _send_msg(sock: socket.socket, op: int, body: bytes) -> None:
    sock.sendall(_HDR.pack(_MAGIC, op, len(body)) + body)


def _recv_msg(sock: socket.socket):
    magic, op, length = _HDR.unpack(_recv_exact(sock, _HDR.size))
    if magic != _MAGIC:
        raise ConnectionError(f"not a ferry.compat.nixl metadata message (magic {magic!r})")
    if length > _MAX_BODY:
        raise ConnectionError(f"metadata message of {length} bytes exceeds {_MAX_BODY}")
    return op, _recv_exact(sock, length)


def etcd_url_from_env() -> str | None:
    """Ferry's directory URL for NIXL's etcd settings: NIXL_ETCD_ENDPOINTS
    (``http://host:port[,...]``) and NIXL_ETCD_NAMESPACE (default ``/nixl/agents/``);
    FERRY_NIXL_DIRECTORY (an ``etcd://`` URL) overrides both."""
    url = os.environ.get("FERRY_NIXL_DIRECTORY")
    if url:
        return url
    endpoints = os.environ.get("NIXL_ETCD_ENDPOINTS", "").strip()
    if not endpoints:
        return None
    hosts = []
    for one in filter(None, (e.strip() for e in endpoints.split(","))):
        for scheme in ("http://", "https://"):
            if one.startswith(scheme):
                one = one[len(scheme):]
        hosts.append(one.rstrip("/"))
    prefix = os.environ.get("NIXL_ETCD_NAMESPACE", "/nixl/agents/").strip("/") or "nixl"
    return f"etcd://{','.join(hosts)}/{prefix}"


class Exchange:
    """One agent's side of the metadata exchange. ``agent`` offers: ``name``,
    ``local_metadata(label)``, ``engine_metadata()``, ``load_metadata(bytes)`` and
    ``forget_agent(name)``."""

    MD_KEY = "nixl-md"

    def __init__(self, agent, listen: bool, port: int):
        self._agent = agent
        self._timeout = _env_seconds("FERRY_NIXL_EXCHANGE_TIMEOUT", 30.0)
        self._work: queue.Queue = queue.Queue()
        self._worker = None
        self._server = None
        self._closed = threading.Event()
        self._directory = None
        self._dir_mu = threading.Lock()
        self.port = 0
        if listen:
            self._server = socket.create_server(("", int(port)), reuse_port=False)
            self._server.settimeout(0.2)
            self.port = self._server.getsockname()[1]
            threading.Thread(target=self._serve, name=f"nixl-listen-{agent.name}",
                             daemon=True).start()

    # --- the listener --------------------------------------------------------------
    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(self._timeout)
                try:
                    self._answer(conn)
                except Exception as exc:  # a bad peer must not stop the listener
                    _log.warning("agent '%s': metadata exchange message refused: %s",
                                 self._agent.name, exc)

    def _answer(self, conn: socket.socket) -> None:
        op, body = _recv_msg(conn)
        if op == OP_METADATA:
            self._agent.load_metadata(body)
        elif op == OP_FETCH:
            (nlen,) = struct.unpack_from("<H", body)
            name = body[2:2 + nlen].decode()
            label = body[2 + nlen:].decode()
            md = self._agent.local_metadata(label) if name == self._agent.name else b""
            _send_msg(conn, OP_METADATA, md)
        elif op == OP_INVALIDATE:
            self._agent.forget_agent(body.decode(), quiet=True)
        else:
            raise ConnectionError(f"unknown metadata exchange op {op}")

    # --- the background sender -----------------------------------------------------
    def _submit(self, what: str, fn) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name=f"nixl-md-{self._agent.name}",
                                            daemon=True)
            self._worker.start()
        self._work.put((what, fn))

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            what, fn = item
            try:
                fn()
            except Exception as exc:
                _log.error("agent '%s': %s failed: %s", self._agent.name, what, exc)

    def _connect(self, ip: str, port: int) -> socket.socket:
        """Connects, retrying while the peer's listener is not up yet."""
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                return socket.create_connection((ip, int(port)), timeout=self._timeout)
            except (ConnectionRefusedError, socket.timeout, OSError) as exc:
                if time.monotonic() >= deadline or self._closed.is_set():
                    raise ConnectionError(f"no metadata listener at {ip}:{port} within "
                                          f"{self._timeout:g} s ({exc})") from None
                time.sleep(0.05)

    def send_to_peer(self, ip: str, port: int, md: bytes) -> None:
        def send():
            with self._connect(ip, port) as s:
                _send_msg(s, OP_METADATA, md)
        self._submit(f"sending metadata to {ip}:{port}", send)

    def fetch_from_peer(self, name: str, ip: str, port: int, label: str) -> None:
        def fetch():
            with self._connect(ip, port) as s:
                raw = name.encode()
                _send_msg(s, OP_FETCH, struct.pack("<H", len(raw)) + raw + label.encode())
                op, body = _recv_msg(s)
            if op != OP_METADATA or not body:
                raise ConnectionError(f"the listener at {ip}:{port} is not agent '{name}'")
            self._agent.load_metadata(body)
        self._submit(f"fetching agent '{name}' from {ip}:{port}", fetch)

    def invalidate_at_peer(self, ip: str, port: int) -> None:
        def invalidate():
            with self._connect(ip, port) as s:
                _send_msg(s, OP_INVALIDATE, self._agent.name.encode())
        self._submit(f"invalidating at {ip}:{port}", invalidate)

    # --- the central store (etcd) ----------------------------------------------------
    def _store(self):
        with self._dir_mu:
            if self._directory is None:
                url = etcd_url_from_env()
                if url is None:
                    raise nixlNotSupportedError(
                        "metadata exchange without ip_addr goes through a central store: set "
                        "NIXL_ETCD_ENDPOINTS (http://host:port) or FERRY_NIXL_DIRECTORY "
                        "(etcd://host:port/prefix), or pass ip_addr and port")
                from ... import directory
                self._directory = directory.open(url)
                self._directory.publish_engine(self._agent.name, self._agent.engine_metadata())
            return self._directory

    @classmethod
    def _key(cls, label: str) -> str:
        return f"{cls.MD_KEY}.{label}" if label else cls.MD_KEY

    def publish(self, md: bytes, label: str = "") -> None:
        """Puts metadata (full, or partial under a label) into the store, now."""
        self._store().publish(self._agent.name, self._key(label), md)

    def fetch_from_store(self, name: str, label: str) -> None:
        store = self._store()

        def fetch():
            md = store.lookup(name, self._key(label), timeout=self._timeout)
            self._agent.load_metadata(md)
        self._submit(f"fetching agent '{name}' (label '{label}') from {store!r}", fetch)

    def withdraw(self) -> None:
        with self._dir_mu:
            d, self._directory = self._directory, None
        if d is not None:
            d.close()

    def close(self) -> None:
        self._closed.set()
        if self._server is not None:
            self._server.close()
        if self._worker is not None:
            # Let queued sends (an invalidation at teardown) reach the peer first.
            self._work.put(None)
            self._worker.join(timeout=5.0)
        self.withdraw()
