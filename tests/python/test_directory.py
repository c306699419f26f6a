"""ferry.directory over a real etcd (Debian etcd-server) that these tests start on
loopback, on free ports, with its data in a temporary directory: engines in separate
processes find each other by name and move verified data; a SIGKILLed engine's names
vanish within the lease ttl; a held name is refused naming its holder; etcd killed and
restarted. Skipped, with the reason, where etcd is not installed."""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import traceback
import urllib.request
import uuid

import numpy as np
import pytest

import ferry

ETCD = os.environ.get("FERRY_ETCD") or shutil.which("etcd")
pytestmark = pytest.mark.skipif(
    not ETCD, reason="etcd is not installed (Debian package etcd-server, or set FERRY_ETCD): "
                     "the etcd directory tests need a real etcd server")

CTX = mp.get_context("spawn")
TTL = 2  # seconds: etcd's minimum lease ttl with its default timing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """One etcd server: start (waits until it answers), kill -9, wipe its data."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="ferry-etcd-")
        self.client_port, self.peer_port = _free_port(), _free_port()
        self.proc = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def url(self, prefix: str) -> str:
        return f"etcd://{self.address}/{prefix}"

    def start(self, timeout: float = 20.0) -> None:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(os.path.join(self.dir, "etcd.log"), "ab")
        self.proc = subprocess.Popen(
            [ETCD, "--name=ferry-test", f"--data-dir={self.dir}/data",
             f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
             f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
             f"--initial-cluster=ferry-test={peer}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "etcd exited at start:\n" + self.log_tail()
            try:
                req = urllib.request.Request(f"{client}/v3/kv/range", data=b'{"key":"AA=="}',
                                             method="POST")
                with opener.open(req, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        self.kill()
        raise AssertionError(f"etcd did not answer within {timeout} s:\n" + self.log_tail())

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def wipe(self) -> None:
        shutil.rmtree(os.path.join(self.dir, "data"), ignore_errors=True)

    def log_tail(self) -> str:
        try:
            with open(os.path.join(self.dir, "etcd.log"), "rb") as f:
                return b"".join(f.readlines()[-8:]).decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def etcd():
    server = Etcd()
    server.start()
    yield server
    server.close()


@pytest.fixture
def prefix():
    return "t-" + uuid.uuid4().hex[:12]


def _bounded(seconds):
    """Deadline helper: remaining() raises when the bound is past."""
    end = time.monotonic() + seconds

    def remaining():
        left = end - time.monotonic()
        assert left > 0, f"bound of {seconds} s exceeded"
        return left
    return remaining


# --- a target engine in another process ------------------------------------------

def _target(conn, url, name, size, ttl):
    try:
        engine = ferry.Engine()
        buf = np.zeros(size, dtype=np.uint8)
        region = engine.register(buf)
        me = ferry.directory.attach(engine, url, name, ttl=ttl, timeout=1.5)
        me.publish("kv", region, access="w")
        conn.send(("ready", os.getpid()))
        while True:
            cmd, *args = conn.recv()
            if cmd == "verify":  # seed, timeout: wait for the notification, check the bytes
                seed, timeout = args
                notes = engine.wait_notifications(timeout=timeout)
                expected = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
                conn.send(("ok", [p for _, p in notes], bool(np.array_equal(buf, expected))))
            elif cmd == "lookup":
                try:
                    conn.send(("ok", len(me.directory.lookup_engine(args[0], timeout=args[1]))))
                except ferry.FerryError as exc:
                    conn.send(("error", type(exc).__name__, str(exc)))
            elif cmd == "exit":
                me.close()
                engine.close()
                conn.send(("ok",))
                return
    except Exception:
        conn.send(("error", "crash", traceback.format_exc()))


class Target:
    def __init__(self, url, name, size=1 << 20, ttl=TTL):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=_target, args=(child, url, name, size, ttl), daemon=True)
        self.proc.start()
        child.close()
        assert self.conn.poll(60), "target did not start"
        answer = self.conn.recv()
        assert answer[0] == "ready", answer
        self.pid = answer[1]
        self.size = size

    def call(self, *cmd, timeout=30):
        self.conn.send(cmd)
        assert self.conn.poll(timeout), f"no answer to {cmd[0]}"
        return self.conn.recv()

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self):
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except (AssertionError, OSError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


def _write_by_name(me, engine, name, size, seed):
    peer = me.connect(name, timeout=10)
    desc = me.lookup(name, "kv", timeout=10)
    src = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    with engine.register(src) as region:
        # 16 iovs in one call, in a shuffled order.
        block = size // 16
        order = np.random.default_rng(seed + 1).permutation(16)
        peer.write([(region, int(i) * block, block) for i in order],
                   [(desc, int(i) * block, block) for i in order], notify=b"seed %d" % seed)


# --- tests ----------------------------------------------------------------------------

def test_names_are_validated():
    for good in ("decode-3", "prefill_0", "a.b", "x..y", "k" * 128):
        assert ferry.directory.validate_name("engine name", good) == good
    for bad in ("", ".", "..", "a/b", "../x", "a b", "é", "k" * 129, None, b"x"):
        with pytest.raises(ferry.InvalidArgument, match="engine name"):
            ferry.directory.validate_name("engine name", bad)
    for url in ("http://127.0.0.1:2379", "etcd://", "etcd://nohost/x", "etcd://h:1/a/../b"):
        with pytest.raises(ferry.InvalidArgument, match="directory URL"):
            ferry.directory.open(url)


def test_unreachable_store_names_the_endpoint():
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(ferry.PeerDisconnected, match=f"127.0.0.1:{port}"):
        ferry.directory.open(f"etcd://127.0.0.1:{port}/x", timeout=1.0)
    assert time.monotonic() - start < 5


def test_two_processes_find_each_other_by_name(etcd, prefix):
    url = etcd.url(prefix)
    target = Target(url, "decode-0")
    try:
        engine = ferry.Engine()
        with ferry.directory.attach(engine, url, "prefill-0", ttl=TTL) as me:
            assert me.engines() == ["decode-0", "prefill-0"]
            _write_by_name(me, engine, "decode-0", target.size, seed=5)
            status, notes, same = target.call("verify", 5, 10.0)
            assert (status, notes, same) == ("ok", [b"seed 5"], True)
            # The target finds us too.
            assert target.call("lookup", "prefill-0", 5.0) == ("ok", len(engine.metadata()))
            # Missing names and keys; waiting for them.
            with pytest.raises(ferry.NotFound, match="nobody"):
                me.connect("nobody", timeout=0)
            with pytest.raises(ferry.NotFound, match=etcd.address):
                me.lookup("decode-0", "nope", timeout=0)
            start = time.monotonic()
            with pytest.raises(ferry.Timeout, match="nope"):
                me.lookup("decode-0", "nope", timeout=0.3)
            assert 0.25 <= time.monotonic() - start < 3
            # Publishing: regions and bytes under our own name only.
            assert me.publish("raw", b"\x01\x02") == b"\x01\x02"
            assert me.lookup("prefill-0", "raw") == b"\x01\x02"
            with pytest.raises(ferry.InvalidArgument, match="does not hold"):
                me.directory.publish("decode-0", "k", b"x")
            with pytest.raises(ferry.InvalidArgument, match="key"):
                me.publish("../x", b"x")
        engine.close()
        # A clean exit revokes the lease: the name is gone at once.
        assert target.call("exit") == ("ok",)
        with ferry.directory.open(url) as d:
            with pytest.raises(ferry.NotFound):
                d.lookup_engine("decode-0")
            assert d.engines() == []
    finally:
        target.close()


def test_sigkilled_engine_vanishes_within_ttl_and_its_name_is_refused_meanwhile(etcd, prefix):
    url = etcd.url(prefix)
    target = Target(url, "decode-1")
    try:
        engine = ferry.Engine()
        me = ferry.directory.attach(engine, url, "prefill-1", ttl=TTL)
        time.sleep(TTL + 0.5)  # held by the keep-alive, not only by the first grant
        _write_by_name(me, engine, "decode-1", target.size, seed=9)
        assert target.call("verify", 9, 10.0)[2] is True
        # A second engine claiming the name is refused, naming the holder; not overwritten.
        before = me.directory.lookup_engine("decode-1")
        with pytest.raises(ferry.PermissionDenied, match=f"pid {target.pid} on"):
            ferry.directory.attach(ferry.Engine(), url, "decode-1")
        assert me.directory.lookup_engine("decode-1") == before

        target.kill()
        killed = time.monotonic()
        remaining = _bounded(TTL + 4)
        while True:
            try:
                me.directory.lookup_engine("decode-1")
            except ferry.NotFound:
                break
            remaining()
            time.sleep(0.1)
        gone = time.monotonic() - killed
        print(f"[ entries gone {gone:.2f} s after SIGKILL, ttl {TTL} s ]")
        with pytest.raises(ferry.NotFound):
            me.lookup("decode-1", "kv", timeout=0)
        assert me.engines() == ["prefill-1"]
        # A restarted engine takes the name again with fresh metadata.
        again = Target(url, "decode-1")
        try:
            _write_by_name(me, engine, "decode-1", again.size, seed=10)
            assert again.call("verify", 10, 10.0)[2] is True
        finally:
            again.close()
        me.close()
        engine.close()
    finally:
        target.close()


def test_claim_wait_takes_over_a_dead_holders_name(etcd, prefix):
    url = etcd.url(prefix)
    target = Target(url, "svc")
    target.kill()
    start = time.monotonic()
    with ferry.directory.open(url, ttl=TTL, claim_wait=TTL + 4) as d:
        d.publish_engine("svc", b"new")
        assert d.lookup_engine("svc") == b"new"
    assert time.monotonic() - start < TTL + 4


def test_etcd_killed_and_restarted():
    server = Etcd()
    server.start()
    target = None
    try:
        url = server.url("restart")
        target = Target(url, "decode-2")
        engine = ferry.Engine()
        me = ferry.directory.attach(engine, url, "prefill-2", ttl=TTL, timeout=1.0)
        me.publish("k", b"v")
        peer = me.connect("decode-2", timeout=10)
        desc = me.lookup("decode-2", "kv", timeout=10)

        server.kill()
        # Connected peers keep working.
        src = np.random.default_rng(3).integers(0, 256, target.size, dtype=np.uint8)
        with engine.register(src) as region:
            peer.write(region, desc, notify=b"while etcd is down")
        assert target.call("verify", 3, 10.0)[1:] == ([b"while etcd is down"], True)
        # Lookups and publishing fail naming the endpoint; health says why.
        with pytest.raises(ferry.PeerDisconnected, match=server.address):
            me.directory.lookup_engine("decode-2")
        with pytest.raises(ferry.PeerDisconnected, match="decode-2"):
            me.connect("decode-2", timeout=0)
        with pytest.raises(ferry.PeerDisconnected):
            me.publish("k2", b"v2")
        remaining = _bounded(TTL + 3)
        while me.directory.healthy:
            remaining()
            time.sleep(0.1)
        with pytest.raises(ferry.PeerDisconnected, match=server.address):
            me.directory.health()

        # Back empty (its data lost): the lease is granted anew, every entry put back.
        server.wipe()
        server.start()
        remaining = _bounded(TTL + 8)
        while True:
            try:
                assert me.lookup("prefill-2", "k") == b"v"
                me.lookup("decode-2", "kv")
                break
            except ferry.NotFound:
                remaining()
                time.sleep(0.1)
        assert me.directory.healthy
        fresh = ferry.Engine()
        with ferry.directory.attach(fresh, url, "prefill-3", ttl=TTL) as other:
            _write_by_name(other, fresh, "decode-2", target.size, seed=4)
            assert target.call("verify", 4, 10.0)[2] is True
        me.close()
    finally:
        if target:
            target.close()
        server.close()


def test_engine_directory_and_name_arguments(etcd, prefix):
    """Engine(directory=url, name=...) is the C++ engine's own directory:
    connect by name, publish/lookup by key, a taken name refused."""
    url = etcd.url(prefix)
    rng = np.random.default_rng(5)
    with ferry.Engine(directory=url, name="prefill-0") as prefill, \
            ferry.Engine(directory=url, name="decode-3") as decode:
        assert prefill.name == "prefill-0"
        kv = np.zeros(1 << 20, dtype=np.uint8)
        region = prefill.register(kv)
        prefill.publish("layer-12", region.advertise())
        with pytest.raises(ferry.PermissionDenied):
            ferry.Engine(directory=url, name="prefill-0")
        peer = decode.connect("prefill-0", timeout=5)
        assert peer.id == prefill.id
        desc = decode.lookup("prefill-0", "layer-12", timeout=5)
        src = rng.integers(0, 256, 64 << 10, dtype=np.uint8)
        local = decode.register(src)
        peer.write([(local, 0, src.size)], [(desc, 4096, src.size)])
        assert np.array_equal(kv[4096:4096 + src.size], src)
        with pytest.raises(ferry.NotFound):
            decode.lookup("prefill-0", "layer-13")
