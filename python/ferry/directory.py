"""Engines find each other by name: a metadata directory over etcd or a
torch.distributed store.

Instead of moving ``engine.metadata()`` and every descriptor between processes
by hand, each engine publishes itself under a name, and its peers look it up::

    import ferry, numpy as np

    engine = ferry.Engine()
    me = ferry.directory.attach(engine, "etcd://10.0.0.5:2379/job-17", "decode-3")
    kv = np.zeros(1 << 30, dtype=np.uint8)
    region = engine.register(kv)
    me.publish("kv-pool", region, access="w")          # advertises it under a key

    # in another process
    me = ferry.directory.attach(engine, store, "prefill-0")  # a torch.distributed store
    peer = me.connect("decode-3", timeout=60)          # waits until decode-3 is there
    desc = me.lookup("decode-3", "kv-pool", timeout=60)
    peer.write(src_region, desc)

Back ends, chosen by what ``directory`` is:

* ``"etcd://host:port[,host:port...]/prefix"``: etcd v3 through its HTTP/JSON
  gateway, by the C++ ``ferry::Directory`` itself (one etcd client for both
  languages, so C++ and Python engines see each other; libcurl is loaded when
  the first directory opens). Entries
  live under a lease kept alive by a thread: a dead process's names vanish
  within ``ttl`` seconds.
* a ``torch.distributed`` store (``TCPStore``, ``FileStore``, ``HashStore``,
  ``PrefixStore``, or any object with ``set``/``get``/``check``, ideally
  ``compare_set`` or ``add``): leases are emulated by a heartbeat that renews
  an expiry time in the store every ``ttl/3`` seconds (wall clock: hosts'
  clocks must agree to well within ``ttl``). torch is never imported here.

Errors are ferry's exceptions: ``ferry.NotFound`` (no such name or key),
``ferry.Timeout`` (waited ``timeout`` seconds for it), ``ferry.PermissionDenied``
(a name held by another live engine, naming the holder),
``ferry.PeerDisconnected`` (the store is unreachable, naming the endpoint),
``ferry.InvalidArgument`` (a bad name, key or URL). docs/directory.md has the
key layout, the lease rules and why the etcd client speaks HTTP, not gRPC.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import re
import socket
import struct
import threading
import time
import weakref
from datetime import timedelta

from ._errors import (
    Busy,
    FerryError,
    InternalError,
    InvalidArgument,
    NotFound,
    NotSupported,
    PeerDisconnected,
    PermissionDenied,
    ProtocolError,
    Timeout,
)

# `open` is left out so that `from ferry.directory import *` does not hide the builtin.
__all__ = ["Directory", "EtcdDirectory", "StoreDirectory", "NamedEngine", "attach",
           "validate_name"]

_log = logging.getLogger("ferry.directory")
_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_MAX_NAME = 128


def validate_name(what: str, value) -> str:
    """The name or key itself, or ``ferry.InvalidArgument`` naming ``what``:
    1 … 128 characters of ``[A-Za-z0-9._-]``, not ``.`` or ``..``."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a str, not {type(value).__name__}")
    if not value:
        raise InvalidArgument(f"{what} is empty")
    if len(value) > _MAX_NAME:
        raise InvalidArgument(f"{what} '{value[:32]}…' is {len(value)} characters long; "
                              f"at most {_MAX_NAME}")
    if value in (".", ".."):
        raise InvalidArgument(f"{what} '{value}' is not allowed")
    if not _NAME.fullmatch(value):
        bad = next(c for c in value if not re.fullmatch(r"[A-Za-z0-9._-]", c))
        raise InvalidArgument(f"{what} {value!r} has {bad!r} at position {value.index(bad)}; "
                              f"only A-Z a-z 0-9 . _ - are allowed")
    return value


# Directories still open at interpreter exit are closed then, so that their
# names vanish at once rather than a ttl later. (Their keep-alive threads hold
# them, so an unreferenced open directory stays published until close() or exit.)
_open_directories: "weakref.WeakSet[Directory]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for d in list(_open_directories):
        try:
            d.close()
        except Exception:
            pass


def _default_holder() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _as_bytes(value, what: str) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise InvalidArgument(f"{what} must be bytes, not {type(value).__name__}")


class Directory:
    """What both back ends offer. Thread-safe; also a context manager
    (``close()`` on exit: held names are released at once)."""

    #: where the store is ("127.0.0.1:2379", "TCPStore"), for messages
    endpoint: str = ""
    prefix: str = ""

    def publish_engine(self, name: str, metadata: bytes) -> None:
        """Claims ``name`` and stores the engine metadata under it. A name held by
        another live engine raises ``ferry.PermissionDenied`` naming the holder
        (after waiting ``claim_wait`` seconds for it to be released);
        republishing one's own name replaces the metadata."""
        raise NotImplementedError

    def lookup_engine(self, name: str, timeout: float = 0.0) -> bytes:
        """The metadata published under ``name``: ``ferry.NotFound`` when absent,
        or with ``timeout`` > 0 waits for it and raises ``ferry.Timeout``."""
        raise NotImplementedError

    def _claim_waiting(self, name: str, try_claim, released_when: str) -> None:
        """Claims `name` with `try_claim()` (returns the holder, or "" when the
        name is ours), retrying for claim_wait seconds; PermissionDenied naming
        the holder after that (both back ends)."""
        deadline = time.monotonic() + self.claim_wait
        while who := try_claim():
            if time.monotonic() + 0.2 > deadline:
                waited = f" (waited {self.claim_wait:g} s for it)" if self.claim_wait else ""
                raise PermissionDenied(
                    f"engine name '{name}' is held by {who} in {self._where()}{waited}; it is "
                    f"released when that engine gives it up or {released_when}")
            time.sleep(0.2)

    def _check_held(self, name: str, key: str) -> None:
        """Publishing under `name` needs this directory to hold it (both back ends)."""
        with self._mu:
            if name in self._lost:
                raise PermissionDenied(f"publish of key '{key}' under engine name '{name}': "
                                       f"this directory lost the name ({self._lost[name]})")
            if name not in self._engines:
                raise InvalidArgument(f"publish of key '{key}' under engine name '{name}': "
                                      "this directory does not hold that name (publish_engine "
                                      "it first)")

    def publish(self, name: str, key: str, value: bytes) -> None:
        """Stores ``value`` (a descriptor, or any small bytes) under ``key`` of a
        name this directory holds (``publish_engine`` first)."""
        raise NotImplementedError

    def lookup(self, name: str, key: str, timeout: float = 0.0) -> bytes:
        raise NotImplementedError

    def unpublish_engine(self, name: str) -> None:
        """Gives a held name up, with every key under it."""
        raise NotImplementedError

    def engines(self) -> list[str]:
        """Names of the live engines, sorted."""
        raise NotImplementedError

    def health(self) -> None:
        """Raises why the directory cannot keep its entries alive now (store
        unreachable, a name lost to another engine); returns None when it can."""
        err = self._health_error()
        if err is not None:
            raise err

    @property
    def healthy(self) -> bool:
        return self._health_error() is None

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- shared by the back ends ------------------------------------------------

    def _health_error(self):
        with self._mu:
            if self._health is not None:
                return self._health
            if self._lost:
                name, why = next(iter(self._lost.items()))
                return PermissionDenied(f"engine name '{name}' was lost: {why}")
        return None

    def _poll(self, what: str, fetch, timeout: float):
        """fetch() -> value or None; retries transient store errors and absence
        until ``timeout`` (seconds) passes."""
        deadline = time.monotonic() + max(0.0, float(timeout))
        pause = 0.05
        while True:
            error = None
            try:
                value = fetch()
                if value is not None:
                    return value
            except (PeerDisconnected, Timeout, Busy) as exc:
                error = exc
            now = time.monotonic()
            if now >= deadline:
                if error is not None:
                    raise error
                if timeout > 0:
                    raise Timeout(f"no {what} appeared in {self._where()} within {timeout:g} s")
                raise NotFound(f"no {what} in {self._where()}")
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 0.5)

    def _where(self) -> str:
        return f"{self.kind} at {self.endpoint} (prefix {self.prefix})"

    def __repr__(self) -> str:
        return f"<ferry.directory.{type(self).__name__} {self._where()}>"


# ------------------------------------------------------------------------ etcd

class EtcdDirectory(Directory):
    """The etcd back end: a binding of the C++ ``ferry::Directory`` (one etcd
    client for both languages; key layout and lease rules in docs/directory.md).
    Its keep-alive thread runs in C++; a lost lease is granted anew and every
    entry put back, and a name taken meanwhile shows in ``health()``."""

    kind = "etcd"

    def __init__(self, url: str, *, ttl: int = 10, timeout: float = 3.0, claim_wait: float = 0.0,
                 holder: str | None = None, gateway_prefix: str | None = None):
        if not isinstance(url, str):
            raise InvalidArgument(f"directory URL must be a str, not {type(url).__name__}")
        if int(ttl) < 1:
            raise InvalidArgument(f"directory lease ttl {ttl} s: at least 1 s")
        self.ttl = int(ttl)
        self.timeout = float(timeout)
        self.claim_wait = float(claim_wait)
        self.holder = holder or _default_holder()
        from ._ferry import _Directory  # the native module; imported late like the engine
        self._native = _Directory.open(url, self.ttl, self.timeout, self.timeout,
                                       self.claim_wait, self.holder, gateway_prefix or "")
        self.prefix = self._native.prefix
        self._endpoint = self._native.endpoint
        _open_directories.add(self)

    @property
    def endpoint(self) -> str:
        return self._endpoint if self._native.closed else self._native.endpoint

    @property
    def lease_id(self) -> int:
        return 0 if self._native.closed else self._native.lease_id

    def publish_engine(self, name: str, metadata: bytes) -> None:
        validate_name("engine name", name)
        self._native.publish_engine(name, _as_bytes(metadata, "metadata"))

    def publish(self, name: str, key: str, value: bytes) -> None:
        validate_name("engine name", name)
        validate_name("key", key)
        self._native.publish(name, key, _as_bytes(value, "value"))

    def lookup_engine(self, name: str, timeout: float = 0.0) -> bytes:
        validate_name("engine name", name)
        return self._native.lookup_engine(name, float(timeout))

    def lookup(self, name: str, key: str, timeout: float = 0.0) -> bytes:
        validate_name("engine name", name)
        validate_name("key", key)
        return self._native.lookup(name, key, float(timeout))

    def unpublish_engine(self, name: str) -> None:
        validate_name("engine name", name)
        self._native.unpublish_engine(name)

    def engines(self) -> list[str]:
        return self._native.engines()

    def _health_error(self):
        try:
            self._native.health()
        except FerryError as exc:
            return exc
        return None

    def close(self) -> None:
        """Stops the keep-alive and revokes the lease: every entry vanishes now."""
        native = getattr(self, "_native", None)
        if native is not None:
            native.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# ----------------------------------------------------------- torch.distributed store

_EPOCH = struct.Struct("<Q")


class StoreDirectory(Directory):
    """The back end over a torch.distributed store (or any object with its
    ``set``/``get``/``check`` methods). Leases are emulated: each held name has
    a holder record ``{"epoch", "holder", "token", "expires"}`` that a thread
    renews every ``ttl/3`` s; a record past ``expires`` (wall clock) is dead,
    and every value carries the epoch of the claim it belongs to, so a dead
    engine's entries are never served. Claims are atomic with
    ``compare_set`` (TCPStore, FileStore, HashStore), else with ``add``.
    Keys are never deleted (a ``get`` of a deleted key would block until the
    store's timeout); a released name's record is marked released."""

    kind = "store"

    def __init__(self, store, *, prefix: str = "ferry", ttl: float = 10, timeout: float = 3.0,
                 claim_wait: float = 0.0, holder: str | None = None):
        for method in ("set", "get"):
            if not callable(getattr(store, method, None)):
                raise InvalidArgument(f"{type(store).__name__} is not a store: it has no "
                                      f"{method}() (a torch.distributed Store, or an etcd:// URL, "
                                      "is expected)")
        for segment in prefix.strip("/").split("/"):
            validate_name("store prefix segment", segment)
        if float(ttl) <= 0:
            raise InvalidArgument(f"directory lease ttl {ttl} s: must be positive")
        self.store = store
        self.prefix = prefix.strip("/")
        self.endpoint = self._describe(store)
        self.ttl = float(ttl)
        self.timeout = float(timeout)
        self.claim_wait = float(claim_wait)
        self.holder = holder or _default_holder()
        self.token = os.urandom(8).hex()
        self.lease_id = None
        self._store_mu = threading.RLock()  # one store call at a time
        self._mu = threading.Lock()
        self._publish_mu = threading.RLock()
        self._stop = threading.Event()
        self._records: dict[str, bytes] = {}   # held name -> holder record we wrote last
        self._engines: dict[str, bytes] = {}
        self._entries: dict[tuple[str, str], bytes] = {}
        self._lost: dict[str, str] = {}
        self._health = None
        self._thread = None
        self._closed = False
        self._exists(self._key("probe"))  # fails now, naming the store, if it is unreachable
        _open_directories.add(self)

    @staticmethod
    def _describe(store) -> str:
        name = type(store).__name__
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        return f"{name} {host}:{port}" if host and port else name

    def _key(self, *parts: str) -> str:
        return "/".join((self.prefix,) + parts)

    def _call(self, method: str, *args):
        fn = getattr(self.store, method, None)
        if fn is None:
            raise NotSupported(f"{self.endpoint} has no {method}()")
        try:
            with self._store_mu:
                return fn(*args)
        except FerryError:
            raise
        except Exception as exc:  # torch raises RuntimeError/DistStoreError/DistNetworkError
            if isinstance(exc, (TimeoutError, socket.timeout)) or "timeout" in str(exc).lower():
                raise Timeout(f"{self.endpoint} did not answer {method}({args[0]!r}): "
                              f"{exc}") from None
            raise PeerDisconnected(f"{self.endpoint} failed {method}({args[0]!r}): "
                                   f"{type(exc).__name__}: {exc}") from None

    def _exists(self, key: str) -> bool:
        if hasattr(self.store, "check"):
            return bool(self._call("check", [key]))
        try:
            self._call("wait", [key], timedelta(milliseconds=10))
            return True
        except Timeout:
            return False

    def _get(self, key: str):
        """The value, or None when absent (check first: get() blocks on absent keys)."""
        if not self._exists(key):
            return None
        value = self._call("get", key)
        return bytes(value) if not isinstance(value, bytes) else value

    # --- holder records ----------------------------------------------------------

    def _holder_key(self, name):
        return self._key("engines", name, "holder")

    def _record(self, name: str):
        raw = self._get(self._holder_key(name))
        if not raw:
            return None, raw
        try:
            return json.loads(raw), raw
        except ValueError:
            return None, raw

    @staticmethod
    def _live(record) -> bool:
        return bool(record) and not record.get("released") and record.get("expires", 0) > time.time()

    def _new_record(self, epoch: int, released: bool = False) -> bytes:
        return json.dumps({"epoch": epoch, "holder": self.holder, "token": self.token,
                           "expires": 0 if released else time.time() + self.ttl,
                           "released": released}).encode()

    def _swap(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        """Atomically replaces ``expected`` (None: absent) by ``desired``."""
        if hasattr(self.store, "compare_set"):
            current = self._call("compare_set", key, expected or b"", desired)
            return bytes(current) == desired
        if hasattr(self.store, "add"):
            # One winner per (key, value seen): a counter keyed by the hash of the value.
            import hashlib
            tag = hashlib.sha1(expected or b"").hexdigest()[:16]
            if self._call("add", f"{key}.claim.{tag}", 1) != 1:
                return False
            self._call("set", key, desired)
            return True
        self._call("set", key, desired)  # no atomic operation: last writer wins
        return True

    def _claim(self, name: str) -> str:
        """'' when this directory holds ``name`` now, else who does."""
        record, raw = self._record(name)
        if record and record.get("token") == self.token and not record.get("released"):
            desired = self._new_record(record["epoch"])
            if self._swap(self._holder_key(name), raw, desired):
                self._records[name] = desired
                return ""
            record, raw = self._record(name)
        if self._live(record) and record.get("token") != self.token:
            left = record["expires"] - time.time()
            return f"{record.get('holder', 'an engine')} (epoch {record.get('epoch')}, " \
                   f"{left:.1f} s left)"
        epoch = (record or {}).get("epoch", 0) + 1
        desired = self._new_record(epoch)
        if not self._swap(self._holder_key(name), raw if raw else None, desired):
            record, _ = self._record(name)
            return f"{(record or {}).get('holder', 'another engine')} (claimed it just now)"
        self._records[name] = desired
        if name not in self._engines and hasattr(self.store, "add"):
            index = self._call("add", self._key("names", "count"), 1)
            self._call("set", self._key("names", str(index)), name)
        return ""

    def _epoch(self, name: str) -> int:
        return json.loads(self._records[name])["epoch"]

    def _put(self, name: str, key: str, value: bytes) -> None:
        self._call("set", key, _EPOCH.pack(self._epoch(name)) + value)

    def _read(self, name: str, key: str):
        """The value under ``key`` if ``name`` is held by a live engine and the
        value belongs to that claim; else None."""
        record, _ = self._record(name)
        if not self._live(record):
            return None
        raw = self._get(key)
        if raw is None or len(raw) < _EPOCH.size or _EPOCH.unpack_from(raw)[0] != record["epoch"]:
            return None
        return raw[_EPOCH.size:]

    # --- the API ---------------------------------------------------------------------

    def publish_engine(self, name: str, metadata: bytes) -> None:
        validate_name("engine name", name)
        metadata = _as_bytes(metadata, "metadata")
        if self._closed:
            raise InvalidArgument("the directory is closed")
        with self._publish_mu:
            self._claim_waiting(name, lambda: self._claim(name), "stops renewing it")
            self._put(name, self._key("engines", name, "metadata"), metadata)
            with self._mu:
                self._engines[name] = metadata
                self._lost.pop(name, None)
            if self._thread is None:
                self._thread = threading.Thread(target=self._heartbeat, name="ferry-directory",
                                                daemon=True)
                self._thread.start()

    def publish(self, name: str, key: str, value: bytes) -> None:
        validate_name("engine name", name)
        validate_name("key", key)
        value = _as_bytes(value, "value")
        with self._publish_mu:
            self._check_held(name, key)
            self._put(name, self._key("engines", name, "keys", key), value)
            with self._mu:
                self._entries[(name, key)] = value

    def lookup_engine(self, name: str, timeout: float = 0.0) -> bytes:
        validate_name("engine name", name)
        key = self._key("engines", name, "metadata")
        return self._poll(f"live engine named '{name}' (key {key})",
                          lambda: self._read(name, key), timeout)

    def lookup(self, name: str, key: str, timeout: float = 0.0) -> bytes:
        validate_name("engine name", name)
        validate_name("key", key)
        full = self._key("engines", name, "keys", key)
        return self._poll(f"key '{key}' of live engine '{name}' (key {full})",
                          lambda: self._read(name, full), timeout)

    def unpublish_engine(self, name: str) -> None:
        validate_name("engine name", name)
        with self._publish_mu:
            with self._mu:
                if self._engines.pop(name, None) is None:
                    raise NotFound(f"engine name '{name}' is not held by this directory")
                self._entries = {k: v for k, v in self._entries.items() if k[0] != name}
            self._release(name)

    def _release(self, name: str) -> None:
        last = self._records.pop(name, None)
        if last is not None:
            self._swap(self._holder_key(name), last,
                       self._new_record(json.loads(last)["epoch"], released=True))

    def engines(self) -> list[str]:
        if not hasattr(self.store, "add"):
            raise NotSupported(f"{self.endpoint} has no add(): it cannot list engines")
        count = int(self._call("add", self._key("names", "count"), 0))
        names = set()
        for i in range(1, count + 1):
            raw = self._get(self._key("names", str(i)))
            if raw:
                names.add(raw.decode())
        return sorted(n for n in names if self._live(self._record(n)[0]))

    def _heartbeat(self) -> None:
        period = max(self.ttl / 3.0, 0.1)
        healthy = True
        while not self._stop.wait(period if healthy else min(period, 0.5)):
            try:
                with self._publish_mu:
                    for name in list(self._engines):
                        self._renew(name)
                with self._mu:
                    self._health = None
                healthy = True
            except FerryError as exc:
                if healthy:
                    _log.warning("%s; retrying every 0.5 s", exc)
                with self._mu:
                    self._health = type(exc)(f"{exc} (renewing the directory's names is failing; "
                                             "they are renewed when the store answers)")
                healthy = False

    def _renew(self, name: str) -> None:
        last = self._records.get(name)
        desired = self._new_record(json.loads(last)["epoch"]) if last else None
        if last and self._swap(self._holder_key(name), last, desired):
            self._records[name] = desired
            return
        # Our record is gone or was replaced: claim the name again (and put its
        # entries back) unless another engine holds it now.
        who = self._claim(name)
        if who:
            with self._mu:
                self._engines.pop(name, None)
                self._entries = {k: v for k, v in self._entries.items() if k[0] != name}
                self._lost[name] = f"taken by {who}"
            return
        self._put(name, self._key("engines", name, "metadata"), self._engines[name])
        for (n, key), value in list(self._entries.items()):
            if n == name:
                self._put(name, self._key("engines", name, "keys", key), value)

    def close(self) -> None:
        """Stops the heartbeat and marks every held name released."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 1)
        with self._publish_mu:
            for name in list(self._records):
                try:
                    self._release(name)
                except FerryError:
                    pass


# ------------------------------------------------------------------- entry points

def open(directory, *, prefix: str | None = None, ttl: float = 10, timeout: float = 3.0,
         claim_wait: float = 0.0, holder: str | None = None) -> Directory:
    """A Directory for ``directory``: an ``"etcd://host:port/prefix"`` URL, a
    torch.distributed store object, or a Directory (returned as is).

    ``ttl``: seconds a dead process's names stay visible. ``timeout``: seconds
    one request to the store may take. ``claim_wait``: seconds ``publish_engine``
    waits for a name held by another engine to be released (a restarted engine
    sets about ``ttl + 2`` to take its old name back). ``holder``: how a
    refused claimer sees this process (default ``"pid N on HOST"``). ``prefix``
    (stores only; etcd takes it from the URL): the key namespace, default
    ``"ferry"``."""
    if isinstance(directory, Directory):
        return directory
    if isinstance(directory, str):
        if prefix is not None:
            raise InvalidArgument("an etcd directory takes its prefix from the URL "
                                  "(etcd://host:port/prefix)")
        return EtcdDirectory(directory, ttl=max(1, int(round(ttl))), timeout=timeout,
                             claim_wait=claim_wait, holder=holder)
    return StoreDirectory(directory, prefix=prefix or "ferry", ttl=ttl, timeout=timeout,
                          claim_wait=claim_wait, holder=holder)


class NamedEngine:
    """An engine published under a name: what ``attach`` returns.

    ``connect(name)`` finds another engine by name and connects to it;
    ``publish(key, region)`` advertises memory under a key of this engine's
    name; ``lookup(name, key)`` fetches another engine's descriptor.
    ``close()`` withdraws the name (and closes a directory that ``attach``
    opened); it is also a context manager."""

    def __init__(self, engine, directory: Directory, name: str, owns_directory: bool):
        self.engine = engine
        self.directory = directory
        self.name = name
        self._owns = owns_directory
        self._closed = False

    def connect(self, name: str, timeout: float = 30.0):
        """The ``ferry.Peer`` of the engine published as ``name`` (waiting up to
        ``timeout`` seconds for it to appear)."""
        metadata = self.directory.lookup_engine(name, timeout=timeout)
        return self.engine.connect(metadata)

    def publish(self, key: str, what, *, offset: int = 0, length: int | None = None,
                access="rw") -> bytes:
        """Publishes under ``key``: a Region (advertised over ``[offset,
        offset+length)`` with ``access``) or descriptor bytes. Returns the bytes
        published."""
        if hasattr(what, "advertise"):
            value = what.advertise(offset, length, access=access)
        else:
            value = _as_bytes(what, "a published value (a Region or descriptor bytes)")
        self.directory.publish(self.name, key, value)
        return value

    def lookup(self, name: str, key: str, timeout: float = 30.0) -> bytes:
        """The bytes (a descriptor) that engine ``name`` published under ``key``."""
        return self.directory.lookup(name, key, timeout=timeout)

    def engines(self) -> list[str]:
        return self.directory.engines()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.directory.unpublish_engine(self.name)
        except FerryError:
            pass
        if self._owns:
            self.directory.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ferry.directory.NamedEngine '{self.name}' in {self.directory._where()}>"


def attach(engine, directory, name: str, **options) -> NamedEngine:
    """Publishes ``engine`` under ``name`` in ``directory`` (a URL, a store or a
    Directory; ``options`` as for :func:`open`) and returns a NamedEngine."""
    validate_name("engine name", name)
    owns = not isinstance(directory, Directory)
    d = open(directory, **options)
    try:
        d.publish_engine(name, engine.metadata())
    except BaseException:
        if owns:
            d.close()
        raise
    return NamedEngine(engine, d, name, owns)
