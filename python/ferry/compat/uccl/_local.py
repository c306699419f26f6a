"""Same-host rendezvous for ``connect_local`` / ``accept_local``.

UCCL pairs two endpoints of one host through shared-memory rings named after
their GPUs. Here each endpoint listens on an abstract Unix socket named after
itself (``ferry-uccl-<uid>-<local name>``) and, if no other endpoint of this
user took it first, after its GPU: by PCI bus id (``ferry-uccl-<uid>-bdf-<bus
id>``, the GPU identity ``parse_metadata`` gives, the same in processes with
different ``CUDA_VISIBLE_DEVICES``) and by index (``ferry-uccl-<uid>-gpu<N>``,
for callers that pass a GPU index). ``connect_local`` exchanges Ferry engine metadata over
it, connects the two engines (which then pick the same-host transports, shm for
host memory and cuda_ipc for GPU memory where the build has it) and waits until
the listening side has queued the connection for ``accept_local``.

Frames: u32 length + payload. Client -> server ``H`` + envelope (its GPU, name
and engine metadata); server -> client ``W`` + envelope, or ``E`` + reason;
client -> server ``C`` once its engine is connected (or ``E`` + reason); server
-> client ``A`` once the connection is queued.
"""
from __future__ import annotations

import os
import re
import select
import socket
import struct
import threading
import time

from ..._errors import InvalidArgument, NotFound, PeerDisconnected, Timeout
from ..._metadata import parse_metadata as _parse_engine_metadata
from . import _envelope

_HANDSHAKE_TIMEOUT = 30.0
_MAX_FRAME = 1 << 16


def socket_name(name: str) -> str:
    return f"\0ferry-uccl-{os.getuid()}-{name}"


def gpu_alias(gpu: int) -> str:
    return f"gpu{int(gpu)}"


# A PCI bus id as UCCL prints one: domain:bus:device.function ("0000:18:00.0").
_BDF = re.compile(r"^(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def bdf_alias(bdf: str) -> str:
    """One spelling per GPU: lower case, 4-digit domain (nvidia-smi prints 8)."""
    parts = bdf.lower().split(":")
    domain = parts[0][-4:] if len(parts) == 3 else "0000"
    return f"bdf-{domain}:{parts[-2]}:{parts[-1]}"


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("<I", len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise PeerDisconnected("connect_local: the other endpoint closed the same-host "
                                   "rendezvous socket mid-handshake")
        buf += chunk
    return buf


def _recv(sock: socket.socket) -> bytes:
    (n,) = struct.unpack("<I", _recv_exact(sock, 4))
    if n > _MAX_FRAME:
        raise InvalidArgument(f"connect_local: oversized rendezvous frame ({n} bytes)")
    return _recv_exact(sock, n)


class LocalListener:
    """Accepts same-host rendezvous connections on a thread of its own.

    ``reserve(engine_id)`` is called before the reply (so ``accept()`` never
    hands the peer out as a remote connection), ``connected(envelope)`` once the
    peer's engine is connected, ``release(engine_id)`` if the handshake fails.
    ``welcome()`` gives this endpoint's envelope (or raises to refuse).
    """

    def __init__(self, name: str, gpu: int, welcome, reserve, connected, release, gpu_bdf=""):
        self.name = name
        self.aliases: list[str] = []
        self._welcome, self._reserve = welcome, reserve
        self._connected, self._release = connected, release
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        self._socks.append(self._bind(name, required=True))
        for alias in ([bdf_alias(gpu_bdf)] if gpu_bdf else []) + ([gpu_alias(gpu)] if gpu >= 0 else []):
            s = self._bind(alias, required=False)
            if s is not None:
                self._socks.append(s)
                self.aliases.append(alias)
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="ferry-uccl-local",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(name: str, required: bool):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.bind(socket_name(name))
        except OSError:
            s.close()
            if required:
                raise
            return None  # another endpoint of this host answers for this GPU
        s.listen(64)
        return s

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select(self._socks + [self._wake_r], [], [])
            except (OSError, ValueError):
                return
            for s in ready:
                if s is self._wake_r or self._stop.is_set():
                    continue
                try:
                    conn, _ = s.accept()
                except OSError:
                    continue
                threading.Thread(target=self._handshake, args=(conn,),
                                 name="ferry-uccl-local-hs", daemon=True).start()

    def _handshake(self, conn: socket.socket) -> None:
        engine_id = None
        with conn:
            try:
                conn.settimeout(_HANDSHAKE_TIMEOUT)
                hello = _recv(conn)
                if hello[:1] != b"H":
                    return
                peer = _envelope.unwrap(hello[1:])
                engine_id = _parse_engine_metadata(peer.engine_metadata).engine_id
                try:
                    mine = self._welcome()
                except Exception as exc:  # closed endpoint: tell the caller why
                    _send(conn, b"E" + str(exc).encode())
                    return
                self._reserve(engine_id)
                _send(conn, b"W" + mine)
                reply = _recv(conn)
                if reply[:1] != b"C":
                    raise PeerDisconnected(reply[1:].decode(errors="replace"))
                self._connected(peer, engine_id)
                engine_id = None  # handed over
                _send(conn, b"A")
            except Exception:
                pass  # the connecting side reports the failure
            finally:
                if engine_id is not None:
                    self._release(engine_id)

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass
        self._thread.join(timeout=2)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def resolve(target) -> str:
    """The rendezvous name for connect_local's argument: a GPU index (int or digits,
    UCCL's older form) or the GPU identity string of ``parse_metadata``."""
    if isinstance(target, bool):
        raise InvalidArgument("connect_local(): expected a GPU index or the GPU identity "
                              "string from Endpoint.parse_metadata")
    if isinstance(target, int):
        return gpu_alias(target)
    if isinstance(target, (bytes, bytearray)):
        target = bytes(target).decode("ascii", "replace")
    if not isinstance(target, str) or not target:
        raise InvalidArgument(f"connect_local(): bad remote GPU {target!r}: expected a GPU "
                              "index or the identity string from Endpoint.parse_metadata")
    if target.lstrip("-").isdigit():
        return gpu_alias(int(target))
    if _BDF.match(target):
        return bdf_alias(target)
    if "\0" in target or len(target) > 90:
        raise InvalidArgument(f"connect_local(): bad remote GPU identity {target!r}")
    return target


def connect(target_name: str, mine: bytes, connect_engine, timeout: float = 5.0):
    """Rendezvous with the endpoint answering for ``target_name``; returns (its
    envelope, the Ferry peer). ``connect_engine(metadata)`` connects our engine."""
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.connect(socket_name(target_name))
            break
        except (ConnectionRefusedError, FileNotFoundError):
            s.close()
            if time.monotonic() >= deadline:
                raise NotFound(
                    f"connect_local(): no Ferry UCCL endpoint of this host and user answers "
                    f"for {target_name!r} (waited {timeout:g} s); pass the GPU identity that "
                    f"Endpoint.parse_metadata returns for the peer's metadata, or a GPU index "
                    f"that a running endpoint was created with") from None
            time.sleep(0.01)
    with s:
        s.settimeout(_HANDSHAKE_TIMEOUT)
        try:
            _send(s, b"H" + mine)
            reply = _recv(s)
            if reply[:1] == b"E":
                raise PeerDisconnected(f"connect_local(): {target_name!r} refused: "
                                       f"{reply[1:].decode(errors='replace')}")
            if reply[:1] != b"W":
                raise PeerDisconnected(f"connect_local(): unexpected reply from {target_name!r}")
            theirs = _envelope.unwrap(reply[1:])
            try:
                peer = connect_engine(theirs.engine_metadata)
            except Exception as exc:
                _send(s, b"E" + str(exc).encode())
                raise
            _send(s, b"C")
            if _recv(s) != b"A":
                raise PeerDisconnected(f"connect_local(): {target_name!r} did not confirm")
        except socket.timeout:
            raise Timeout(f"connect_local(): {target_name!r} did not answer within "
                          f"{_HANDSHAKE_TIMEOUT:g} s") from None
    return theirs, peer
