"""ferry.compat.uccl: same-host calls (connect_local/accept_local, *_ipc), the
descriptor API (register_memory/transfer), FloatType and the failure paths, with
a second process, random data and every byte checked. Host memory only (the
GPU paths run with UCCL's own scripts on the device: bench/uccl/)."""
import multiprocessing as mp
import struct
import threading

import numpy as np
import pytest

import ferry
from ferry.compat.uccl import p2p

CTX = mp.get_context("spawn")
SIZE = 64 * 1024 + 13  # odd on purpose


class FakeTensor:
    """What UCCL's register_memory reads of a torch tensor."""

    def __init__(self, array):
        self.array = array

    def data_ptr(self):
        return self.array.ctypes.data

    def numel(self):
        return self.array.size

    def element_size(self):
        return self.array.itemsize


def _server(conn, gpu):
    """The other process: an endpoint serving commands from the test."""
    import numpy as np
    from cross_process import dump
    from ferry.compat.uccl import p2p

    ep = p2p.Endpoint(gpu)
    conn.send(ep.get_metadata())
    bufs, conn_id = [], None
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "accept_local":
                ok, name, conn_id = ep.accept_local(timeout=20)
                conn.send((ok, name, conn_id))
            elif cmd == "buffers":  # (count, size, seed or None) -> ipc descriptors
                n, size, seed = args
                rng = np.random.default_rng(seed)
                bufs = [rng.integers(0, 256, size, dtype=np.uint8) if seed is not None
                        else np.zeros(size, np.uint8) for _ in range(n)]
                ok, blobs = ep.advertisev_ipc(conn_id, [b.ctypes.data for b in bufs],
                                              [size] * n)
                conn.send(blobs)
            elif cmd == "register_memory":  # same, through the descriptor API
                n, size, seed = args
                rng = np.random.default_rng(seed)
                bufs = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
                descs = ep.register_memory([FakeTensor(b) for b in bufs])
                conn.send(ep.get_serialized_descs(descs))
            elif cmd == "dump":
                conn.send(dump(bufs))
            elif cmd == "exit":
                ep.close()
                conn.send("bye")
                return
        except Exception as exc:  # report, keep serving
            conn.send(exc)


def _start(gpu=0):
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_server, args=(child, gpu), daemon=True)
    proc.start()
    child.close()
    assert parent.poll(60)
    return proc, parent, parent.recv()


def _ask(conn, *cmd):
    conn.send(cmd)
    assert conn.poll(60)
    out = conn.recv()
    if isinstance(out, Exception):
        raise out
    return out


@pytest.fixture()
def server():
    proc, conn, metadata = _start(gpu=3)
    yield conn, metadata
    try:
        conn.send(("exit",))
        conn.poll(20) and conn.recv()
    finally:
        proc.join(20)
        if proc.is_alive():
            proc.kill()


def _rand(rng, n, size):
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def _wait(ep, tid):
    done = False
    while not done:
        ok, done = ep.poll_async(tid)
        assert ok


@pytest.mark.parametrize("by", ["identity", "gpu_index", "gpu_index_keyword"])
def test_connect_local_ipc_every_call(server, by):
    conn, metadata = server
    ep = p2p.Endpoint(1)
    ip, port, identity = p2p.Endpoint.parse_metadata(metadata)
    assert identity.endswith("-gpu3") and port > 0
    if by == "identity":
        ok, cid = ep.connect_local(identity)
    elif by == "gpu_index":
        ok, cid = ep.connect_local(3)
    else:
        ok, cid = ep.connect_local(remote_gpu_idx=3)
    assert ok
    ok, my_name_there, _server_cid = _ask(conn, "accept_local")
    assert ok and my_name_there == p2p.Endpoint.parse_metadata(ep.get_metadata())[2]
    rng = np.random.default_rng(7)
    n = 4

    # write_ipc / write_ipc_async / writev_ipc / writev_ipc_async: unregistered sources
    for how in ("write", "write_async", "writev", "writev_async"):
        blobs = _ask(conn, "buffers", n, SIZE, None)
        assert all(len(b) == ferry.DESCRIPTOR_SIZE for b in blobs)
        src = _rand(rng, n, SIZE)
        ptrs = [s.ctypes.data for s in src]
        if how == "write":
            for p, b in zip(ptrs, blobs):
                assert ep.write_ipc(cid, p, SIZE, b) is True
        elif how == "write_async":
            tids = [ep.write_ipc_async(cid, p, SIZE, b)[1] for p, b in zip(ptrs, blobs)]
            for t in tids:
                _wait(ep, t)
        elif how == "writev":
            assert ep.writev_ipc(cid, ptrs, [SIZE] * n, blobs) is True
        else:
            ok, tid = ep.writev_ipc_async(cid, ptrs, [SIZE] * n, blobs)
            _wait(ep, tid)
        assert _ask(conn, "dump") == [s.tobytes() for s in src], how

    # read_ipc / read_ipc_async / readv_ipc / readv_ipc_async
    for seed, how in enumerate(("read", "read_async", "readv", "readv_async")):
        blobs = _ask(conn, "buffers", n, SIZE, 100 + seed)
        want = _ask(conn, "dump")
        dst = [np.zeros(SIZE, np.uint8) for _ in range(n)]
        ptrs = [d.ctypes.data for d in dst]
        if how == "read":
            for p, b in zip(ptrs, blobs):
                assert ep.read_ipc(cid, p, SIZE, b) is True
        elif how == "read_async":
            tids = [ep.read_ipc_async(cid, p, SIZE, b)[1] for p, b in zip(ptrs, blobs)]
            for t in tids:
                assert ep.wait_async(t, timeout=30)
        elif how == "readv":
            assert ep.readv_ipc(cid, ptrs, [SIZE] * n, blobs) is True
        else:
            ok, tid = ep.readv_ipc_async(cid, ptrs, [SIZE] * n, blobs)
            _wait(ep, tid)
        assert [d.tobytes() for d in dst] == want, how

    # out of range: more bytes than advertised; nothing is written
    blobs = _ask(conn, "buffers", 1, SIZE, None)
    big = np.ones(SIZE + 1, np.uint8)
    with pytest.raises(ferry.OutOfRange):
        ep.write_ipc(cid, big.ctypes.data, SIZE + 1, blobs[0])
    assert _ask(conn, "dump") == [bytes(SIZE)]
    # a damaged descriptor is refused by the target
    d = ferry.Descriptor.from_bytes(blobs[0])
    d.key ^= 1
    with pytest.raises(ferry.PermissionDenied):
        ep.write_ipc(cid, big.ctypes.data, SIZE, d.to_bytes())
    with pytest.raises(ferry.InvalidArgument):
        ep.write_ipc(cid, big.ctypes.data, SIZE, b"\x07" * 64)
    with pytest.raises(ferry.InvalidArgument):
        ep.writev_ipc(cid, [big.ctypes.data], [SIZE, SIZE], blobs)  # lengths differ
    # unknown / removed conn_id: UCCL's "Invalid conn_id", as RuntimeError and ferry.NotFound
    with pytest.raises(RuntimeError, match="Invalid conn_id"):
        ep.write_ipc(cid + 1000, big.ctypes.data, SIZE, blobs[0])
    assert ep.remove_remote_endpoint(cid) is True
    assert ep.remove_remote_endpoint(cid) is False
    with pytest.raises(p2p.InvalidConnId):
        ep.read_ipc(cid, big.ctypes.data, SIZE, blobs[0])
    # a *_ipc source nothing covers is registered on first use and kept for later calls
    # (each call one lookup, not a registration and its release); close() releases it
    kept = ep._ipc_local.get((big.ctypes.data, SIZE))
    assert kept is not None and kept[1] and kept[0].registered
    assert ep._covering(big.ctypes.data, SIZE) is None  # not an mr_id, nor advertise_ipc's
    ep.close()
    assert not kept[0].registered


def test_advertise_ipc_without_accept_local(server):
    """test_engine_nvlink_metadata.py's pattern: the listening side never calls
    accept_local and advertises with the *connecting* side's conn_id."""
    conn, metadata = server
    ep = p2p.Endpoint(0)
    ok, cid = ep.connect_local(p2p.Endpoint.parse_metadata(metadata)[2])
    blobs = _ask(conn, "buffers", 2, 4096, None)  # server's conn_id is None here
    src = _rand(np.random.default_rng(3), 2, 4096)
    assert ep.writev_ipc(cid, [s.ctypes.data for s in src], [4096] * 2, blobs)
    assert _ask(conn, "dump") == [s.tobytes() for s in src]
    ep.close()


def test_descriptor_api_transfer(server):
    conn, metadata = server
    ep = p2p.Endpoint(0)
    ok, cid = ep.add_remote_endpoint(metadata)
    assert ep.add_remote_endpoint(metadata) == (True, cid)
    n = 5
    rng = np.random.default_rng(11)
    remote = ep.deserialize_descs(_ask(conn, "register_memory", n, SIZE, 5))
    assert len(remote) == n and all(d.size == SIZE and d["size"] == SIZE for d in remote)
    want = _ask(conn, "dump")

    # read all n into local registered tensors
    dst = [np.zeros(SIZE, np.uint8) for _ in range(n)]
    local = ep.register_memory([FakeTensor(d) for d in dst])
    ok, tid = ep.transfer(cid, "read", local, remote)
    _wait(ep, tid)
    assert [d.tobytes() for d in dst] == want
    # write random data back, one descriptor per call and all at once
    for d in dst:
        d[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
    ok, tid = ep.transfer(cid, "write", local[:1], remote[:1])
    _wait(ep, tid)
    ok, tid = ep.transfer(cid, "write", local, remote)
    assert ep.wait_async(tid, timeout=30)
    assert _ask(conn, "dump") == [d.tobytes() for d in dst]

    # failure paths
    with pytest.raises(RuntimeError, match="same size"):
        ep.transfer(cid, "write", local, remote[:2])
    with pytest.raises(RuntimeError, match="Invalid op_name"):
        ep.transfer(cid, "WRITE", local, remote)
    with pytest.raises(RuntimeError, match="Invalid conn_id"):
        ep.transfer(cid + 77, "write", local, remote)
    big = np.zeros(SIZE + 8, np.uint8)
    big_desc = ep.register_memory([FakeTensor(big)])
    with pytest.raises(ferry.OutOfRange, match="outside"):  # longer than the remote
        ep.transfer(cid, "write", big_desc, remote[:1])
    no_ferry = p2p.XferDesc(remote[0].addr, remote[0].size, remote[0].mr_id)
    with pytest.raises(ferry.InvalidArgument, match="no Ferry descriptor"):
        ep.transfer(cid, "read", local[:1], [no_ferry])
    ep.deregister_memory(local + big_desc)
    with pytest.raises(ferry.NotFound):  # local descriptors no longer registered
        ep.transfer(cid, "read", local, remote)
    with pytest.raises(ferry.NotFound):
        ep.deregister_memory(local[:1])  # twice
    assert ep.remove_remote_endpoint(cid) is True
    with pytest.raises(RuntimeError, match="Invalid conn_id"):
        ep.transfer(cid, "write", local, remote)
    # re-adding after removal gives a new conn_id (UCCL's behaviour)
    ok, cid2 = ep.add_remote_endpoint(metadata)
    assert ok and cid2 != cid
    ep.close()


def test_register_memory_cache_and_serialization():
    ep = p2p.Endpoint(0, listen="127.0.0.1:0")
    base = np.arange(4096, dtype=np.float32)
    d1, = ep.register_memory([FakeTensor(base)])
    d2, = ep.register_memory([FakeTensor(base)])
    sub, = ep.register_memory([FakeTensor(base[256:1280])])
    other, = ep.register_memory([FakeTensor(base[3000:].copy())])
    assert d1.addr == base.ctypes.data and d1.size == base.nbytes
    assert sub.addr == base[256:].ctypes.data and sub.size == 1024 * 4
    assert len({d1.mr_id, d2.mr_id, sub.mr_id}) == 3
    assert d1.lkeys == d2.lkeys == sub.lkeys and d1.rkeys == sub.rkeys
    assert other.lkeys != d1.lkeys
    assert "addr" in d1 and d1["lkeys"] == d1.lkeys and isinstance(d1["rkeys"], list)
    ep.deregister_memory([d1, d2])  # the sub-tensor keeps the registration alive
    assert ep.region(sub.mr_id).registered
    ep.deregister_memory([sub])
    descs = [d1, sub, other]
    data = ep.get_serialized_descs(descs)
    assert isinstance(data, bytes)
    back = ep.deserialize_descs(data)
    assert back == descs and back[1].ferry == sub.ferry
    assert ep.deserialize_descs(ep.get_serialized_descs([])) == []
    # bad bytes: UCCL raises RuntimeError; here also ferry.InvalidArgument, with the reason
    for bad, why in ((b"", "truncated"), (b"nope" + data[4:], "magic"),
                     (data[:-1], "truncated"), (data + b"\0", "trailing"),
                     (data[:8] + b"\xff" * 24, "truncated")):
        with pytest.raises(p2p.BadArgument, match=why) as info:
            ep.deserialize_descs(bad)
        assert isinstance(info.value, RuntimeError)
        assert isinstance(info.value, ferry.InvalidArgument)
    with pytest.raises((RuntimeError, AttributeError)):
        ep.register_memory([123])
    with pytest.raises((RuntimeError, AttributeError)):
        ep.register_memory([FakeTensor(base), "not a tensor"])
    ep.close()


def test_small_api_pieces():
    assert int(p2p.FloatType.kFloat16) == 1 and p2p.kFloat32 == p2p.FloatType.kFloat32
    assert [f.name for f in p2p.FloatType] == ["kUndefined", "kFloat16", "kBFloat16",
                                               "kFloat32", "kFloat8E4M3FN", "kFloat8E5M2"]
    a = p2p.Endpoint(0, listen="127.0.0.1:0")
    b = p2p.Endpoint(5, listen="127.0.0.1:0")
    buf = np.zeros(64, np.uint8)
    ok, mr = a.reg(buf.ctypes.data, 64, p2p.FloatType.kBFloat16)
    assert ok and a.dereg(mr)
    assert a.conn_id_of_rank(0) == (1 << 64) - 1
    assert isinstance(p2p.get_oob_ip(), str) and a.get_oob_ip() == p2p.get_oob_ip()
    ma, mb = a.get_metadata(), b.get_metadata()
    assert len(ma) == len(mb) and len(ma) % 64 == 0  # one length, as UCCL's benchmark needs
    assert p2p.Endpoint.parse_metadata(a.engine.metadata())[2] == ""  # bare Ferry metadata
    with pytest.raises(ferry.InvalidArgument):
        p2p.Endpoint.parse_metadata(ma[:20])
    # accept() hands out the peer's GPU index (sent by connect/add_remote_endpoint)
    ok, cid = b.add_remote_endpoint(ma)
    ok, ip, gpu, acid = a.accept(timeout=10)
    assert ok and gpu == 5 and ip == "127.0.0.1"
    # same-host failures
    with pytest.raises(ferry.NotFound, match="answers"):
        b.connect_local("ferry-0000000000000000-gpu9", timeout=0.05)
    with pytest.raises(ferry.NotFound):
        b.connect_local(remote_gpu_idx=977, timeout=0.05)
    with pytest.raises(ferry.InvalidArgument):
        b.connect_local(0, remote_gpu_idx=0)
    with pytest.raises(ferry.Timeout):
        a.accept_local(timeout=0.05)
    assert b.remove_remote_endpoint(999999) is False
    # in one process too: connect_local by identity, accept_local gets the caller's
    ok, lcid = b.connect_local(p2p.Endpoint.parse_metadata(ma)[2])
    assert a.accept_local(timeout=5)[1] == p2p.Endpoint.parse_metadata(mb)[2]
    # the local connection is not handed out by accept()
    with pytest.raises(ferry.Timeout):
        a.accept(timeout=1.5)
    a.close()
    with pytest.raises(ferry.FerryError):
        b.connect_local(p2p.Endpoint.parse_metadata(ma)[2], timeout=0.05)
    b.close()


def test_metadata_names_the_gpu_by_pci_bus_id():
    """parse_metadata gives the GPU's PCI bus id, as UCCL's does (the same in processes
    with different CUDA_VISIBLE_DEVICES); version 1 envelopes (no bus id) are read."""
    from ferry.compat.uccl import _envelope, _local
    meta = ferry.Engine("127.0.0.1:0")
    try:
        raw = meta.metadata()
    finally:
        meta.close()
    env = _envelope.unwrap(_envelope.wrap(1, "ferry-00-gpu1", raw, "0000:9a:00.0"))
    assert (env.gpu, env.local_name, env.engine_metadata, env.gpu_bdf) == (
        1, "ferry-00-gpu1", raw, "0000:9a:00.0")
    assert p2p.Endpoint.parse_metadata(_envelope.wrap(1, "n", raw, "0000:9a:00.0"))[2] == "0000:9a:00.0"
    assert p2p.Endpoint.parse_metadata(_envelope.wrap(1, "n", raw))[2] == "n"  # no GPU: the name
    # version 1, as an older build wrote it: no bus id
    v1 = b"FUCL" + struct.pack("<Bi", 1, 2) + struct.pack("<B", 1) + b"x" + struct.pack("<H", len(raw)) + raw
    old = _envelope.unwrap(v1 + b"\0" * (-len(v1) % 64))
    assert (old.gpu, old.local_name, old.gpu_bdf) == (2, "x", "")
    with pytest.raises(ferry.InvalidArgument, match="version 3"):
        _envelope.unwrap(b"FUCL" + struct.pack("<Bi", 3, 0) + b"\0" * 59)
    full = _envelope.wrap(1, "n", raw, "0000:9a:00.0")
    with pytest.raises(ferry.InvalidArgument, match="truncated"):
        _envelope.unwrap(full.rstrip(b"\0")[:-1])  # the bus id cut short
    # connect_local's argument: every spelling of one bus id reaches one rendezvous name
    assert _local.resolve("0000:9A:00.0") == _local.resolve("00000000:9a:00.0") == "bdf-0000:9a:00.0"
    assert _local.resolve("9a:00.0") == "bdf-0000:9a:00.0"
    assert _local.resolve(3) == "gpu3"
    # this machine's GPUs: Endpoint(i)'s identity is GPU i's bus id
    gpus = ferry.gpus()
    for g in gpus[:2]:
        ep = p2p.Endpoint(g["ordinal"], listen="127.0.0.1:0")
        try:
            assert p2p.Endpoint.parse_metadata(ep.get_metadata())[2] == g["pci_bus_id"]
            assert ferry.gpu_ordinal(g["pci_bus_id"]) == g["ordinal"]
            assert ferry.gpu_ordinal(g["uuid"]) == g["ordinal"]
        finally:
            ep.close()
    with pytest.raises(ferry.InvalidArgument):
        ferry.gpu_ordinal("gpu0")


def _only_transport(metadata: bytes, keep: str) -> bytes:
    """Engine metadata re-encoded with one transport's address (layout: ferry/_metadata.py)."""
    import zlib

    from ferry._metadata import parse_metadata

    m = parse_metadata(metadata)

    def s16(text):
        return struct.pack("<H", len(text.encode())) + text.encode()

    body = (b"FRYM" + struct.pack("<HHQ", m.format_version, m.protocol_version, m.engine_id)
            + s16(m.hostname) + s16(m.host_id) + struct.pack("<H", 1) + s16(keep)
            + struct.pack("<I", len(m.transports[keep])) + m.transports[keep])
    return body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)


def test_accept_waits_for_the_tcp_address_a_hello_announces():
    # A peer shows up over shm before our tcp side lists its connection (the
    # connecting side's connect returns first): accept() must not hand it out
    # with no ip then. Here that window is held open: shm first, the hello that
    # says its tcp is up, then tcp.
    from ferry.compat.uccl import _peer_info

    a = p2p.Endpoint(0, listen="127.0.0.1:0")
    if "shm" not in ferry._metadata.parse_metadata(a.engine.metadata()).transports:
        a.close()
        pytest.skip("this engine runs no shm transport")
    c = ferry.Engine("127.0.0.1:0")
    peer = c.connect(_only_transport(a.engine.metadata(), "shm"))
    peer.notify(_peer_info.hello(7, tcp_up=True))
    got = []
    waiter = threading.Thread(target=lambda: got.append(a.accept(timeout=60)))
    waiter.start()
    waiter.join(0.5)
    assert not got  # shm alone: no ip to give yet, and the hello says tcp is coming
    ip, port = p2p.Endpoint.parse_metadata(a.get_metadata())[:2]
    assert c.connect(f"{ip}:{port}").id == peer.id
    waiter.join(60)
    assert got and got[0][:3] == (True, "127.0.0.1", 7)
    # A peer whose hello says it has no tcp is handed out without waiting for
    # one (no deadline here to fall back on), with no ip.
    d = ferry.Engine("127.0.0.1:0")
    d.connect(_only_transport(a.engine.metadata(), "shm")).notify(_peer_info.hello(3, False))
    got.clear()
    waiter = threading.Thread(target=lambda: got.append(a.accept()), daemon=True)
    waiter.start()
    waiter.join(60)
    assert got and got[0][:3] == (True, "", 3)
    c.close()
    d.close()
    a.close()
