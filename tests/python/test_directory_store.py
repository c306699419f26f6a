"""ferry.directory over torch.distributed stores: HashStore and FileStore in one
process, a TCPStore across processes (SIGKILL: the emulated lease runs out), and
examples/disagg_torchrun.py under torchrun with 4 processes finding each other by
name and moving verified KV pages. Those need torch and are skipped, with the reason,
where it is not installed (the CPU-less PyPI wheel pulls in ~3 GB of CUDA libraries,
too heavy for CI: docs/directory.md). The store contract itself (set/get/check, no
atomics) is checked everywhere with a plain object."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta

import numpy as np
import pytest

import ferry

try:
    import torch.distributed as dist
    HAVE_TORCH = dist.is_available()
    WHY_NO_TORCH = "" if HAVE_TORCH else "torch.distributed is not available in this torch build"
except ImportError as exc:
    dist = None
    HAVE_TORCH = False
    WHY_NO_TORCH = (f"torch is not installed ({exc}); the torch store tests need it "
                    "(pip install torch)")

needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason=WHY_NO_TORCH or "torch")
CTX = mp.get_context("spawn")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class PlainStore:
    """The least a store needs: set, get and check (no add, no compare_set)."""

    def __init__(self):
        self.data, self.mu = {}, threading.Lock()

    def set(self, key, value):
        with self.mu:
            self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key):
        with self.mu:
            return self.data[key]

    def check(self, keys):
        with self.mu:
            return all(k in self.data for k in keys)


def _crash(d):
    """Stops a directory's heartbeat without releasing anything, as a SIGKILL would."""
    d._stop.set()
    d._thread.join(5)
    d._closed = True


def test_plain_store_object():
    store = PlainStore()
    a = ferry.directory.open(store, ttl=0.6)
    b = ferry.directory.open(store, ttl=0.6)
    a.publish_engine("decode-0", b"meta-a")
    a.publish("decode-0", "kv", b"desc-a")
    assert b.lookup_engine("decode-0") == b"meta-a"
    assert b.lookup("decode-0", "kv") == b"desc-a"
    with pytest.raises(ferry.PermissionDenied, match="pid .* on"):
        b.publish_engine("decode-0", b"meta-b")
    with pytest.raises(ferry.NotSupported, match="add"):
        b.engines()
    with pytest.raises(ferry.InvalidArgument, match="not a store"):
        ferry.directory.open(object())
    time.sleep(1.0)  # renewed by the heartbeat past its ttl
    assert b.lookup_engine("decode-0") == b"meta-a"
    _crash(a)
    deadline = time.monotonic() + 3
    while True:
        try:
            b.lookup_engine("decode-0")
        except ferry.NotFound:
            break
        assert time.monotonic() < deadline, "a crashed holder's name did not expire"
        time.sleep(0.05)
    with pytest.raises(ferry.NotFound):
        b.lookup("decode-0", "kv")  # its keys went with it
    b.publish_engine("decode-0", b"meta-b")
    assert b.lookup_engine("decode-0") == b"meta-b"
    with pytest.raises(ferry.NotFound):
        b.lookup("decode-0", "kv")  # the old holder's key is not the new holder's
    b.close()


@needs_torch
@pytest.mark.parametrize("kind", ["hash", "file"])
def test_torch_store_claims_release_and_epochs(kind, tmp_path):
    store = dist.HashStore() if kind == "hash" else dist.FileStore(str(tmp_path / "store"), 1)
    a = ferry.directory.open(store, ttl=5, prefix="job/7")
    b = ferry.directory.open(store, ttl=5, prefix="job/7", holder="rank 1")
    other = ferry.directory.open(store, ttl=5, prefix="job/8")
    a.publish_engine("prefill-0", b"A")
    a.publish("prefill-0", "kv", b"a-kv")
    with pytest.raises(ferry.PermissionDenied, match="prefill-0"):
        b.publish_engine("prefill-0", b"B")
    assert b.lookup_engine("prefill-0") == b"A"
    assert b.engines() == ["prefill-0"]
    with pytest.raises(ferry.NotFound):
        other.lookup_engine("prefill-0")
    a.close()  # released at once
    with pytest.raises(ferry.NotFound):
        b.lookup_engine("prefill-0")
    b.publish_engine("prefill-0", b"B")
    assert a.lookup_engine("prefill-0") == b"B"
    with pytest.raises(ferry.NotFound):
        b.lookup("prefill-0", "kv")
    with pytest.raises(ferry.PermissionDenied, match="rank 1"):
        ferry.directory.open(store, prefix="job/7").publish_engine("prefill-0", b"C")
    b.close()
    other.close()


def _store_target(conn, port, name, size, ttl):
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        engine = ferry.Engine()
        buf = np.zeros(size, dtype=np.uint8)
        region = engine.register(buf)
        me = ferry.directory.attach(engine, store, name, ttl=ttl)
        me.publish("kv", region, access="w")
        conn.send(("ready", os.getpid()))
        while True:
            cmd, *args = conn.recv()
            if cmd == "verify":
                seed, timeout = args
                notes = engine.wait_notifications(timeout=timeout)
                expected = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
                conn.send(("ok", [p for _, p in notes], bool(np.array_equal(buf, expected))))
    except Exception:
        conn.send(("error", traceback.format_exc()))


@needs_torch
def test_tcpstore_across_processes_and_sigkill():
    ttl = 1.5
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    conn, child = CTX.Pipe()
    proc = CTX.Process(target=_store_target, args=(child, server.port, "decode-0", 1 << 20, ttl),
                       daemon=True)
    proc.start()
    try:
        assert conn.poll(60), "the target did not start"
        answer = conn.recv()
        assert answer[0] == "ready", answer
        pid = answer[1]
        engine = ferry.Engine()
        with ferry.directory.attach(engine, server, "prefill-0", ttl=ttl) as me:
            assert me.engines() == ["decode-0", "prefill-0"]
            peer = me.connect("decode-0", timeout=10)
            desc = me.lookup("decode-0", "kv", timeout=10)
            src = np.random.default_rng(6).integers(0, 256, 1 << 20, dtype=np.uint8)
            with engine.register(src) as region:
                peer.write(region, desc, notify=b"kv ready")
            conn.send(("verify", 6, 10.0))
            assert conn.poll(30)
            assert conn.recv() == ("ok", [b"kv ready"], True)
            with pytest.raises(ferry.PermissionDenied, match=f"pid {pid} on"):
                me.directory.publish_engine("decode-0", b"x")

            os.kill(pid, signal.SIGKILL)
            proc.join(10)
            killed = time.monotonic()
            while True:
                try:
                    me.directory.lookup_engine("decode-0")
                except ferry.NotFound:
                    break
                assert time.monotonic() - killed < ttl + 3, "the dead engine's name stayed"
                time.sleep(0.05)
            print(f"[ gone {time.monotonic() - killed:.2f} s after SIGKILL, ttl {ttl} s ]")
            assert me.engines() == ["prefill-0"]
            me.directory.publish_engine("decode-0", b"taken over")
        engine.close()
    finally:
        if proc.is_alive():
            proc.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_torch
def test_torchrun_four_processes_by_name():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
           os.path.join(REPO, "examples", "disagg_torchrun.py"),
           "--requests", "12", "--pages", "6", "--timeout", "60"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    print(f"[ torchrun, 4 processes: {time.monotonic() - start:.1f} s ]")
    assert out.returncode == 0, out.stdout + out.stderr
    for d in (0, 1):
        assert f"[decode-{d}] verified 6 requests, 36 pages" in out.stdout, out.stdout + out.stderr
    for p in (0, 1):
        assert f"[prefill-{p}] rank {p}: 6 requests" in out.stdout, out.stdout


def test_engine_directory_argument_takes_a_store():
    """Engine(directory=<store>, name=...) goes through ferry.directory: the
    same connect-by-name, publish and lookup as with etcd."""
    store = PlainStore()
    rng = np.random.default_rng(9)
    with ferry.Engine(directory=store, name="prefill-0") as prefill, \
            ferry.Engine(directory=store, name="decode-3") as decode:
        assert prefill.name == "prefill-0"
        kv = np.zeros(1 << 20, dtype=np.uint8)
        region = prefill.register(kv)
        prefill.publish("layer-12", region.advertise())
        peer = decode.connect("prefill-0", timeout=5)
        assert peer.id == prefill.id
        desc = decode.lookup("prefill-0", "layer-12", timeout=5)
        src = rng.integers(0, 256, 32 << 10, dtype=np.uint8)
        peer.write([(decode.register(src), 0, src.size)], [(desc, 0, src.size)])
        assert np.array_equal(kv[:src.size], src)
    with pytest.raises(ferry.InvalidArgument):
        ferry.Engine(directory=store)
