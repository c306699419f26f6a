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
  gateway (stdlib ``urllib``; the same keys and leases as the C++
  ``ferry::Directory``, so C++ and Python engines see each other). Entries
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
import base64
import json
import logging
import os
import re
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
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

_GRPC_ERRORS = {3: InvalidArgument, 9: InvalidArgument, 11: InvalidArgument, 5: NotFound,
                7: PermissionDenied, 16: PermissionDenied, 4: Timeout, 8: Busy, 10: Busy,
                14: Busy, 12: NotSupported}


def _b64(data) -> str:
    if isinstance(data, str):
        data = data.encode()
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text or "")


def _prefix_end(prefix: str) -> bytes:
    end = bytearray(prefix.encode())
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


def _parse_etcd_url(url: str):
    if not url.startswith("etcd://"):
        raise InvalidArgument(f"directory URL '{url}' is not etcd://host:port[,host:port...]"
                              "[/prefix]")
    rest = url[len("etcd://"):]
    hosts, _, path = rest.partition("/")
    endpoints = []
    for one in filter(None, hosts.split(",")):
        host, colon, port = one.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise InvalidArgument(f"directory URL '{url}': endpoint '{one}' is not host:port")
        endpoints.append(one)
    if not endpoints:
        raise InvalidArgument(f"directory URL '{url}' names no host:port")
    path = path.rstrip("/") or "ferry"
    for segment in path.split("/"):
        try:
            validate_name("directory URL prefix segment", segment)
        except InvalidArgument as exc:
            raise InvalidArgument(f"directory URL '{url}': {exc}") from None
    return endpoints, "/" + path


class _EtcdClient:
    """etcd v3's HTTP/JSON gateway over urllib: one request at a time, bounded
    by ``timeout``, failing over to the next endpoint when one is unreachable."""

    # No proxy, ever: the store is on the cluster network.
    _opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __init__(self, endpoints, timeout: float, gateway_prefix: str | None):
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.current = 0
        self.gateway = gateway_prefix or ""
        self.server_version = ""
        self._mu = threading.Lock()

    @property
    def endpoint(self) -> str:
        return self.endpoints[self.current]

    def _request(self, endpoint: str, url: str, body: bytes | None):
        req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET",
                                     headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except (socket.timeout, TimeoutError) as exc:
            raise Timeout(f"etcd at {endpoint} did not answer within {self.timeout:g} s: "
                          f"{exc}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise Timeout(f"etcd at {endpoint} did not answer within {self.timeout:g} s: "
                              f"{reason}") from None
            raise PeerDisconnected(f"etcd at {endpoint} is unreachable: {reason}") from None

    def probe(self) -> None:
        failures = []
        with self._mu:
            for i in range(len(self.endpoints)):
                index = (self.current + i) % len(self.endpoints)
                endpoint = self.endpoints[index]
                try:
                    status, body = self._request(endpoint, f"http://{endpoint}/version", None)
                except (PeerDisconnected, Timeout) as exc:
                    failures.append(str(exc))
                    continue
                self.current = index
                try:
                    info = json.loads(body)
                except ValueError:
                    info = None
                if status != 200 or not isinstance(info, dict):
                    raise ProtocolError(f"{endpoint} answered /version with HTTP {status} and no "
                                        "etcd version: is it an etcd client URL?")
                self.server_version = info.get("etcdserver", "")
                cluster = info.get("etcdcluster", "")
                if not cluster or cluster == "not_decided":
                    cluster = self.server_version
                m = re.match(r"(\d+)\.(\d+)", cluster)
                if not m:
                    raise ProtocolError(f"etcd at {endpoint} reported an unreadable version "
                                        f"'{cluster}'")
                major, minor = int(m.group(1)), int(m.group(2))
                if not self.gateway:
                    if (major, minor) >= (3, 4):
                        self.gateway = "/v3"  # 3.4 serves /v3 and /v3beta, 3.5+ /v3 only
                    elif (major, minor) == (3, 3):
                        self.gateway = "/v3beta"
                    else:
                        raise NotSupported(f"etcd at {endpoint} is version {cluster}; the "
                                           "directory needs etcd 3.3 or newer (its v3 HTTP "
                                           "gateway)")
                return
        raise PeerDisconnected(f"no etcd endpoint answered ({', '.join(self.endpoints)}): "
                               + "; ".join(failures))

    def call(self, path: str, body: dict, what: str) -> dict:
        data = json.dumps(body).encode()
        last = None
        with self._mu:
            for i in range(len(self.endpoints)):
                index = (self.current + i) % len(self.endpoints)
                endpoint = self.endpoints[index]
                try:
                    status, raw = self._request(endpoint, f"http://{endpoint}{self.gateway}{path}",
                                                data)
                except (PeerDisconnected, Timeout) as exc:
                    last = type(exc)(f"{exc} ({what})")
                    continue
                self.current = index
                try:
                    answer = json.loads(raw)
                except ValueError:
                    answer = None
                if status == 404 and not (isinstance(answer, dict) and "code" in answer):
                    raise NotSupported(f"etcd at {endpoint} has no gateway path "
                                       f"{self.gateway}{path} (HTTP 404) for {what}")
                if status != 200:
                    answer = answer if isinstance(answer, dict) else {}
                    message = answer.get("message") or answer.get("error") or raw[:200]
                    cls = _GRPC_ERRORS.get(answer.get("code"), InternalError)
                    raise cls(f"etcd at {endpoint} refused {what}: {message} (HTTP {status})")
                if not isinstance(answer, dict):
                    raise ProtocolError(f"etcd at {endpoint} answered {what} with something that "
                                        "is not JSON")
                err = answer.get("error")
                if isinstance(err, dict):  # streaming calls wrap their errors
                    cls = _GRPC_ERRORS.get(err.get("grpc_code"), InternalError)
                    raise cls(f"etcd at {endpoint} refused {what}: {err.get('message')}")
                return answer
        raise last

    # --- kv -------------------------------------------------------------------

    @staticmethod
    def _kv(item: dict) -> dict:
        return {"key": _unb64(item.get("key", "")).decode(), "value": _unb64(item.get("value")),
                "lease": int(item.get("lease", 0) or 0)}

    def get(self, key: str):
        answer = self.call("/kv/range", {"key": _b64(key)}, f"range of key {key}")
        kvs = answer.get("kvs") or []
        return self._kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str, keys_only: bool = False) -> list[dict]:
        answer = self.call("/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)),
                                         "keys_only": keys_only, "sort_order": "ASCEND",
                                         "sort_target": "KEY"}, f"range of prefix {prefix}")
        return [self._kv(item) for item in answer.get("kvs") or []]

    def create_if_absent(self, guard: str, puts: list, lease: int, also_read: str):
        """(created, existing kv of guard or None, kv of also_read or None)"""
        body = {
            "compare": [{"key": _b64(guard), "target": "CREATE", "result": "EQUAL",
                         "create_revision": "0"}],
            "success": [{"request_put": {"key": _b64(k), "value": _b64(v), "lease": str(lease)}}
                        for k, v in puts],
            "failure": [{"request_range": {"key": _b64(guard)}},
                        {"request_range": {"key": _b64(also_read)}}],
        }
        answer = self.call("/kv/txn", body, f"create-if-absent transaction on key {guard}")
        if answer.get("succeeded"):
            return True, None, None
        found = []
        for response in answer.get("responses") or []:
            kvs = (response.get("response_range") or {}).get("kvs") or []
            found.append(self._kv(kvs[0]) if kvs else None)
        found += [None, None]
        return False, found[0], found[1]

    def _if_lease(self, guard: str, lease: int, op: dict, what: str) -> bool:
        body = {"compare": [{"key": _b64(guard), "target": "LEASE", "result": "EQUAL",
                             "lease": str(lease)}],
                "success": [op]}
        return bool(self.call("/kv/txn", body, what).get("succeeded"))

    def put_if_lease(self, guard: str, key: str, value: bytes, lease: int) -> bool:
        return self._if_lease(guard, lease, {"request_put": {"key": _b64(key), "value": _b64(value),
                                                             "lease": str(lease)}},
                              f"put of key {key} under lease {lease:x}")

    def delete_prefix_if_lease(self, guard: str, prefix: str, lease: int) -> bool:
        return self._if_lease(guard, lease,
                              {"request_delete_range": {"key": _b64(prefix),
                                                        "range_end": _b64(_prefix_end(prefix))}},
                              f"delete of prefix {prefix}")

    # --- leases ---------------------------------------------------------------

    def _lease_path(self, op: str) -> str:
        # 3.4+ serves /lease/<op>; 3.3 only /kv/lease/<op> (grant and keepalive are /lease/ in both).
        return f"/kv/lease/{op}" if self.gateway == "/v3beta" else f"/lease/{op}"

    def lease_grant(self, ttl: int) -> int:
        answer = self.call("/lease/grant", {"TTL": str(ttl)}, f"grant of a {ttl} s lease")
        if answer.get("error"):
            raise InternalError(f"etcd at {self.endpoint} refused a {ttl} s lease: "
                                f"{answer['error']}")
        lease = int(answer.get("ID", 0) or 0)
        if not lease:
            raise ProtocolError(f"etcd at {self.endpoint} granted a lease without an id")
        return lease

    def lease_keepalive(self, lease: int) -> int:
        """Remaining ttl after the refresh; 0 when the lease no longer exists."""
        answer = self.call("/lease/keepalive", {"ID": str(lease)}, f"keep-alive of lease {lease:x}")
        result = answer.get("result")
        if not isinstance(result, dict):
            raise ProtocolError(f"etcd at {self.endpoint} answered a keep-alive without a result")
        return int(result.get("TTL", 0) or 0)

    def lease_time_to_live(self, lease: int) -> int:
        answer = self.call(self._lease_path("timetolive"), {"ID": str(lease)},
                           f"time-to-live of lease {lease:x}")
        return int(answer.get("TTL", -1))

    def lease_revoke(self, lease: int) -> None:
        self.call(self._lease_path("revoke"), {"ID": str(lease)}, f"revoke of lease {lease:x}")


class EtcdDirectory(Directory):
    """The etcd back end; the same key layout and lease rules as the C++
    ``ferry::Directory`` (docs/directory.md)."""

    kind = "etcd"

    def __init__(self, url: str, *, ttl: int = 10, timeout: float = 3.0, claim_wait: float = 0.0,
                 holder: str | None = None, gateway_prefix: str | None = None):
        endpoints, self.prefix = _parse_etcd_url(url)
        if int(ttl) < 1:
            raise InvalidArgument(f"directory lease ttl {ttl} s: at least 1 s")
        self.ttl = int(ttl)
        self.claim_wait = float(claim_wait)
        self.holder = holder or _default_holder()
        self._user = _EtcdClient(endpoints, timeout, gateway_prefix)
        self._keeper_client = _EtcdClient(endpoints, timeout, gateway_prefix)
        self._user.probe()
        self._keeper_client.probe()
        self._mu = threading.Lock()            # the fields below
        self._publish_mu = threading.RLock()   # serializes changes of what is in the store
        self._stop = threading.Event()
        self._lease = 0
        self._engines: dict[str, bytes] = {}
        self._entries: dict[tuple[str, str], bytes] = {}
        self._lost: dict[str, str] = {}
        self._health = None
        self._restore_pending = False
        self._thread = None
        self._closed = False
        _open_directories.add(self)

    @property
    def endpoint(self) -> str:
        return self._user.endpoint

    @property
    def lease_id(self) -> int:
        return self._lease

    def _dir(self, name: str) -> str:
        return f"{self.prefix}/engines/{name}/"

    def _meta_key(self, name):
        return self._dir(name) + "metadata"

    def _holder_key(self, name):
        return self._dir(name) + "holder"

    def _entry_key(self, name, key):
        return self._dir(name) + "keys/" + key

    def _check_open(self):
        if self._closed:
            raise InvalidArgument("the directory is closed")

    def _ensure_lease(self) -> None:
        if self._lease:
            return
        self._lease = self._user.lease_grant(self.ttl)
        self._thread = threading.Thread(target=self._keep_alive, name="ferry-directory",
                                        daemon=True)
        self._thread.start()

    def _claim(self, client: _EtcdClient, name: str, metadata: bytes) -> str:
        """'' when this directory holds ``name`` now, else who does."""
        guard = self._meta_key(name)
        created, existing, holder = client.create_if_absent(
            guard, [(guard, metadata), (self._holder_key(name), self.holder.encode())],
            self._lease, self._holder_key(name))
        if created:
            return ""
        their = existing["lease"] if existing else 0
        if their == self._lease and client.put_if_lease(guard, guard, metadata, self._lease):
            return ""
        who = holder["value"].decode(errors="replace") if holder else "an engine"
        if not their:
            return who + " (with no lease: it never expires; delete the key)"
        try:
            left = client.lease_time_to_live(their)
        except FerryError:
            left = -1
        return f"{who} (lease {their:x}, {left} s left)" if left >= 0 else f"{who} (lease {their:x})"

    def publish_engine(self, name: str, metadata: bytes) -> None:
        validate_name("engine name", name)
        metadata = _as_bytes(metadata, "metadata")
        self._check_open()
        with self._publish_mu:
            self._ensure_lease()
            self._claim_waiting(name, lambda: self._claim(self._user, name, metadata),
                                "its lease expires")
            with self._mu:
                self._engines[name] = metadata
                self._lost.pop(name, None)

    def publish(self, name: str, key: str, value: bytes) -> None:
        validate_name("engine name", name)
        validate_name("key", key)
        value = _as_bytes(value, "value")
        self._check_open()
        with self._publish_mu:
            self._check_held(name, key)
            if not self._user.put_if_lease(self._meta_key(name), self._entry_key(name, key), value,
                                           self._lease):
                raise PermissionDenied(f"publish of key '{key}' under engine name '{name}' in "
                                       f"{self._where()}: the name is no longer held by this "
                                       f"directory's lease {self._lease:x}")
            with self._mu:
                self._entries[(name, key)] = value

    def lookup_engine(self, name: str, timeout: float = 0.0) -> bytes:
        validate_name("engine name", name)
        key = self._meta_key(name)

        def fetch():
            kv = self._user.get(key)
            return kv["value"] if kv else None
        return self._poll(f"engine named '{name}' (key {key})", fetch, timeout)

    def lookup(self, name: str, key: str, timeout: float = 0.0) -> bytes:
        validate_name("engine name", name)
        validate_name("key", key)
        full = self._entry_key(name, key)

        def fetch():
            kv = self._user.get(full)
            return kv["value"] if kv else None
        return self._poll(f"key '{key}' of engine '{name}' (key {full})", fetch, timeout)

    def unpublish_engine(self, name: str) -> None:
        validate_name("engine name", name)
        with self._publish_mu:
            with self._mu:
                if self._engines.pop(name, None) is None:
                    raise NotFound(f"engine name '{name}' is not held by this directory")
                self._entries = {k: v for k, v in self._entries.items() if k[0] != name}
            self._user.delete_prefix_if_lease(self._meta_key(name), self._dir(name), self._lease)

    def engines(self) -> list[str]:
        head = self.prefix + "/engines/"
        names = []
        for kv in self._user.get_prefix(head, keys_only=True):
            rest = kv["key"][len(head):]
            if rest.endswith("/metadata") and rest.count("/") == 1:
                names.append(rest[: -len("/metadata")])
        return sorted(names)

    # --- keep-alive --------------------------------------------------------------

    def _set_health(self, error) -> None:
        with self._mu:
            if error is None:
                self._health = None
            else:
                self._health = type(error)(
                    f"{error} (keep-alive of lease {self._lease:x} failing; lookups and "
                    "publishing resume when the store answers)")

    def _keep_alive(self) -> None:
        period = max(self.ttl / 3.0, 0.2)
        healthy = True
        while not self._stop.wait(period if healthy else min(period, 0.5)):
            try:
                left = self._keeper_client.lease_keepalive(self._lease)
                if left <= 0 or self._restore_pending:
                    self._restore(new_lease=left <= 0)
                self._set_health(None)
                healthy = True
            except FerryError as exc:
                if healthy:
                    _log.warning("%s; retrying every 0.5 s", exc)
                self._set_health(exc)
                healthy = False
            except Exception as exc:  # never let the thread die silently
                self._set_health(InternalError(f"directory keep-alive: {exc!r}"))
                healthy = False

    def _restore(self, new_lease: bool) -> None:
        """The store lost the lease: a new one, every name claimed again and every
        entry put back; a name someone else took meanwhile is lost."""
        with self._publish_mu:
            self._restore_pending = True
            if new_lease:
                old = self._lease
                self._lease = self._keeper_client.lease_grant(self.ttl)
                _log.warning("the store lost lease %x; publishing %d name(s) again under lease %x",
                             old, len(self._engines), self._lease)
            with self._mu:
                engines = dict(self._engines)
                entries = dict(self._entries)
            for name, metadata in engines.items():
                who = self._claim(self._keeper_client, name, metadata)
                if who:
                    with self._mu:
                        self._engines.pop(name, None)
                        self._entries = {k: v for k, v in self._entries.items() if k[0] != name}
                        self._lost[name] = f"taken by {who} while this directory's lease was lost"
                    continue
                for (n, key), value in entries.items():
                    if n == name:
                        self._keeper_client.put_if_lease(self._meta_key(name),
                                                         self._entry_key(name, key), value,
                                                         self._lease)
            self._restore_pending = False

    def close(self) -> None:
        """Stops the keep-alive and revokes the lease: every entry vanishes now."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self._user.timeout + 1)
        if self._lease:
            try:
                self._user.lease_revoke(self._lease)
            except FerryError:
                pass  # the store is gone: the lease expires on its own

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
