"""One test per refusal case, plus the exception hierarchy."""
import numpy as np
import pytest

import ferry
from ferry import _ferry
from peer_proc import PeerProcess

KiB = 1 << 10


@pytest.fixture(scope="module")
def target():
    with PeerProcess() as p:
        yield p


@pytest.fixture()
def engine():
    with ferry.Engine() as e:
        yield e


@pytest.fixture()
def src(engine):
    buf = np.arange(64 * KiB, dtype=np.uint8)
    return engine.register(buf)


def test_every_status_code_has_its_class():
    names = {
        "InvalidArgument": ferry.InvalidArgument, "NotFound": ferry.NotFound,
        "PermissionDenied": ferry.PermissionDenied, "OutOfRange": ferry.OutOfRange,
        "PeerDisconnected": ferry.PeerDisconnected, "Timeout": ferry.Timeout,
        "Cancelled": ferry.Cancelled, "NotSupported": ferry.NotSupported, "Busy": ferry.Busy,
        "ProtocolError": ferry.ProtocolError, "Internal": ferry.InternalError,
    }
    for name, cls in names.items():
        code = ferry.StatusCode[name]
        assert issubclass(cls, ferry.FerryError) and cls.code == code
        with pytest.raises(cls) as info:
            _ferry._raise_status(int(code), f"message for {name}")
        assert info.value.code == code
        assert str(info.value) == info.value.message == f"message for {name}"
        assert ferry.error_for(code, "m").code == code
    # friendly builtin bases
    assert issubclass(ferry.InvalidArgument, ValueError)
    assert issubclass(ferry.Timeout, TimeoutError)
    assert issubclass(ferry.NotSupported, NotImplementedError)
    assert issubclass(ferry.PeerDisconnected, ConnectionError)


def test_wrong_key_tampered_descriptor(engine, target, src):
    desc = target.call("alloc", "k", 64 * KiB, 1, "rw")
    d = ferry.Descriptor.from_bytes(desc)
    d.key ^= 0x1
    forged = d.to_bytes()
    assert len(forged) == ferry.DESCRIPTOR_SIZE
    peer = engine.connect(target.metadata)
    with pytest.raises(ferry.PermissionDenied) as info:
        peer.write([(src, 0, 4 * KiB)], [(forged, 0, 4 * KiB)])
    assert info.value.code == ferry.StatusCode.PermissionDenied
    assert info.value.message
    # nothing was written
    assert target.call("get", "k") == np.random.default_rng(1).integers(
        0, 256, 64 * KiB, dtype=np.uint8).tobytes()
    # widening the advertised range in a forged descriptor is refused as well
    d = ferry.Descriptor.from_bytes(target.call("advertise", "k", 0, 4 * KiB, "rw"))
    d.length = 64 * KiB
    with pytest.raises(ferry.PermissionDenied):
        peer.read([(src, 0, 8 * KiB)], [(d.to_bytes(), 0, 8 * KiB)])


def test_corrupted_descriptor_bytes(engine, target, src):
    desc = bytearray(target.call("alloc", "c", 4 * KiB, 2, "rw"))
    desc[20] ^= 0xFF  # breaks the checksum
    peer = engine.connect(target.metadata)
    with pytest.raises(ferry.InvalidArgument):
        peer.write([(src, 0, 16)], [(bytes(desc), 0, 16)])
    with pytest.raises(ferry.InvalidArgument):
        ferry.Descriptor.from_bytes(b"short")


def test_out_of_range_remote(engine, target, src):
    desc = target.call("alloc", "o", 16 * KiB, 3, "rw")
    peer = engine.connect(target.metadata)
    with pytest.raises(ferry.OutOfRange):
        peer.write([(src, 0, 4 * KiB)], [(desc, 14 * KiB, 4 * KiB)])
    with pytest.raises(ferry.OutOfRange):
        peer.read([(src, 0, 4 * KiB)], [(desc, 16 * KiB, 4 * KiB)])
    small = target.call("advertise", "o", 4 * KiB, 4 * KiB, "rw")
    with pytest.raises(ferry.OutOfRange):
        peer.write([(src, 0, 4 * KiB + 1)], [(small, 0, 4 * KiB + 1)])
    # batch path: index of the bad entry named
    offs = np.zeros(4, dtype=np.uint64)
    with pytest.raises(ferry.OutOfRange):
        peer.write_batch(src, offs, desc, None, np.array([0, 0, 0, 15 * KiB], np.uint64), 2 * KiB)


def test_out_of_range_local(engine, target, src):
    desc = target.call("alloc", "ol", 128 * KiB, 4, "rw")
    peer = engine.connect(target.metadata)
    with pytest.raises(ferry.OutOfRange, match="local"):
        peer.write([(src, 60 * KiB, 8 * KiB)], [(desc, 0, 8 * KiB)])
    with pytest.raises(ferry.OutOfRange, match="iov 2"):
        peer.write_batch(src, np.array([0, 0, 63 * KiB], np.uint64), desc, None, 0, 2 * KiB)
    with pytest.raises(ferry.InvalidArgument):
        peer.write([(src, 0, 100)], [(desc, 0, 200)])  # lengths differ
    with pytest.raises(ferry.InvalidArgument):
        peer.write([(src, 0, 100)], [(desc, 0, 100), (desc, 100, 100)])  # counts differ


def test_write_to_read_only_grant(engine, target, src):
    ro = target.call("alloc", "ro", 16 * KiB, 5, "r")
    peer = engine.connect(target.metadata)
    with pytest.raises(ferry.PermissionDenied):
        peer.write([(src, 0, 4 * KiB)], [(ro, 0, 4 * KiB)])
    dst = np.zeros(4 * KiB, np.uint8)
    peer.read([(engine.register(dst), 0, 4 * KiB)], [(ro, 0, 4 * KiB)])  # reading is granted
    wo = target.call("advertise", "ro", 0, None, "w")
    with pytest.raises(ferry.PermissionDenied):
        peer.read([(src, 0, 4 * KiB)], [(wo, 0, 4 * KiB)])


def test_read_only_local_memory(engine, target):
    desc = target.call("alloc", "rl", 4 * KiB, 6, "rw")
    peer = engine.connect(target.metadata)
    frozen = bytes(4 * KiB)
    region = engine.register(frozen)
    assert region.readonly
    with pytest.raises(ferry.PermissionDenied):
        region.advertise(access="rw")
    assert len(region.advertise()) == 64  # read-only memory defaults to access='r'
    with pytest.raises(ferry.PermissionDenied):
        peer.read([(region, 0, 4 * KiB)], [(desc, 0, 4 * KiB)])
    peer.write([(region, 0, 4 * KiB)], [(desc, 0, 4 * KiB)])  # sending from it is fine
    ro_arr = np.zeros(16, np.uint8)
    ro_arr.flags.writeable = False
    with pytest.raises(ferry.PermissionDenied):
        peer.read([(ro_arr, 0, 16)], [(desc, 0, 16)])


def test_deregistered_remote_region(engine, target, src):
    desc = target.call("alloc", "d", 16 * KiB, 7, "rw")
    peer = engine.connect(target.metadata)
    peer.write([(src, 0, 4 * KiB)], [(desc, 0, 4 * KiB)])
    target.call("dereg", "d")
    with pytest.raises(ferry.NotFound):
        peer.write([(src, 0, 4 * KiB)], [(desc, 0, 4 * KiB)])
    with pytest.raises(ferry.NotFound):
        peer.read([(src, 0, 4 * KiB)], [(desc, 0, 4 * KiB)])


def test_deregistered_local_region(engine, target, src):
    desc = target.call("alloc", "dl", 16 * KiB, 8, "rw")
    peer = engine.connect(target.metadata)
    src.deregister()
    src.deregister()  # idempotent
    assert not src.registered
    with pytest.raises(ferry.NotFound):
        peer.write([(src, 0, 16)], [(desc, 0, 16)])
    with pytest.raises(ferry.NotFound):
        src.advertise()


def test_closed_engine_and_unknown_peer(target):
    e = ferry.Engine()
    buf = np.zeros(16, np.uint8)
    region = e.register(buf)
    peer = e.connect(target.metadata)
    e.close()
    e.close()
    assert e.closed and not region.registered
    with pytest.raises(ferry.InvalidArgument, match="closed"):
        peer.write([(buf, 0, 16)], [(b"\0" * 64, 0, 16)])
    with pytest.raises(ferry.InvalidArgument):
        e.metadata()
    with ferry.Engine() as e2:
        ghost = e2.peer(0x1234)
        desc = target.call("alloc", "g", 16, 9, "rw")
        with pytest.raises(ferry.FerryError) as info:
            ghost.write([(e2.register(buf), 0, 16)], [(desc, 0, 16)])
        assert info.value.code in (ferry.StatusCode.NotFound, ferry.StatusCode.InvalidArgument,
                                   ferry.StatusCode.PeerDisconnected)


def test_bad_arguments(engine):
    with pytest.raises(TypeError):
        engine.register(object())
    with pytest.raises(ferry.InvalidArgument, match="contiguous"):
        engine.register(np.zeros((8, 8), np.uint8)[:, ::2])
    with pytest.raises(ferry.InvalidArgument):
        ferry.Engine(no_such_option=1)
    with pytest.raises(ferry.FerryError):
        engine.connect("127.0.0.1:1")  # nothing listens there
    assert engine.wait_notifications(timeout=0.05) == []


def test_peer_disconnected():
    import os
    import signal
    size = 128 << 20
    with ferry.Engine() as engine:
        p = PeerProcess()
        desc = p.call("alloc", "x", size, 10, "rw")
        peer = engine.connect(p.metadata)
        buf = np.zeros(size, np.uint8)
        region = engine.register(buf)
        peer.write([(region, 0, 4096)], [(desc, 0, 4096)])
        os.kill(p.proc.pid, signal.SIGSTOP)  # the write below stalls in flight ...
        t = peer.write_async([(region, 0, size)], [(desc, 0, size)])
        p.kill()                             # ... until the peer dies
        with pytest.raises(ferry.PeerDisconnected):
            t.wait(timeout=30)
        assert t.status == ferry.StatusCode.PeerDisconnected
        # A new call to the dead peer is refused at once. (The engine answers NotFound,
        # "not connected", for a peer it has dropped.)
        with pytest.raises((ferry.PeerDisconnected, ferry.NotFound)):
            peer.write([(region, 0, 4096)], [(desc, 0, 4096)], timeout=20)


def test_transfer_timeout_and_cancel(engine, target):
    size = 64 << 20
    desc = target.call("alloc", "t", size, 11, "rw")
    peer = engine.connect(target.metadata)
    buf = np.zeros(size, np.uint8)
    region = engine.register(buf)
    t = peer.read_async([(region, 0, size)], [(desc, 0, size)])
    try:
        t.wait(timeout=0)
    except ferry.Timeout as exc:
        assert "still running" in str(exc)
    t.cancel()
    try:
        t.wait(timeout=30)  # the final status may take a moment to be reported
    except ferry.Cancelled:
        pass
    assert t.done()
    assert t.status in (ferry.StatusCode.Cancelled, ferry.StatusCode.Ok)
    if t.status == ferry.StatusCode.Cancelled:
        with pytest.raises(ferry.Cancelled):
            t.wait()
    # the engine and the connection still work
    peer.read([(region, 0, 4096)], [(desc, 0, 4096)])
