"""ferry.compat.uccl.p2p.Endpoint running a benchmark_uccl.py-style flow in two processes."""
import multiprocessing as mp

import numpy as np
import pytest

import ferry
from ferry.compat.uccl import p2p

CTX = mp.get_context("spawn")
NUM_IOVS = 128
BLOCK = 64 * 1024


def _server(conn):
    """The 'rank 1' side: accept, register, advertisev, hand out the blobs, verify."""
    import numpy as np
    from cross_process import dump, ordered_by_peer
    from ferry.compat.uccl import p2p

    ep = p2p.Endpoint(0, listen="127.0.0.1:0")
    conn.send(ep.get_metadata())
    ok, r_ip, r_gpu, conn_id = ep.accept()
    assert ok and isinstance(conn_id, int)
    assert r_ip == "127.0.0.1" and r_gpu == 0  # the peer's address as seen here, its GPU
    bufs = [np.zeros(BLOCK, np.uint8) for _ in range(NUM_IOVS)]
    ptrs = [b.ctypes.data for b in bufs]
    ok, mr_ids = ep.regv(ptrs, [BLOCK] * NUM_IOVS)
    assert ok and len(mr_ids) == NUM_IOVS
    ok, blobs = ep.advertisev(mr_ids, ptrs, [BLOCK] * NUM_IOVS, NUM_IOVS)
    assert ok and all(len(x) == 64 for x in blobs)
    conn.send((conn_id, blobs))
    # older UCCL form with a leading conn_id gives equivalent descriptors
    ok, blobs2 = ep.advertisev(conn_id, mr_ids[:2], ptrs[:2], [BLOCK] * 2, 2)
    ok, one = ep.advertise(conn_id, mr_ids[0], ptrs[0], BLOCK)
    assert len(blobs2) == 2 and len(one) == 64
    while True:
        msg = conn.recv()
        if msg == "dump":
            conn.send(dump(bufs))
        elif msg == "fill":
            for i, b in enumerate(bufs):
                data = np.random.default_rng(1000 + i).integers(0, 256, BLOCK, dtype=np.uint8)
                with ordered_by_peer():
                    b[:] = data
            conn.send("filled")
        elif msg == "exit":
            for m in mr_ids:
                assert ep.dereg(m)
            ep.close()
            conn.send("bye")
            return


@pytest.fixture()
def server():
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_server, args=(child,), daemon=True)
    proc.start()
    child.close()
    assert parent.poll(60)
    metadata = parent.recv()
    yield parent, metadata
    try:
        parent.send("exit")
        parent.poll(20) and parent.recv()
    finally:
        proc.join(20)
        if proc.is_alive():
            proc.kill()


def test_benchmark_uccl_style_flow(server):
    conn, remote_metadata = server
    ep = p2p.Endpoint(0, listen="127.0.0.1:0")
    ip, port, r_gpu = p2p.Endpoint.parse_metadata(remote_metadata)
    assert ip == "127.0.0.1" and port > 0
    ok, conn_id = ep.connect(ip, r_gpu, remote_port=port)
    assert ok
    # connect() by address reaches what add_remote_endpoint(metadata) reaches: on one
    # host, shm carries host memory (the tcp handshake brought the server's metadata)
    if any(t["name"] == "shm" and t["running"] for t in ep.engine.transports()):
        (peer_id,) = ep.engine.peers()
        carriers = {t["transport"]: t["carries"] for t in ep.engine.peer_transports(peer_id)}
        assert carriers["shm"] == "host memory", carriers
    # add_remote_endpoint: cached per metadata
    ok2, cid2 = ep.add_remote_endpoint(remote_metadata)
    ok3, cid3 = ep.add_remote_endpoint(remote_metadata)
    assert ok2 and ok3 and cid2 == cid3  # a new handle (as UCCL), cached per metadata
    assert ep.start_passive_accept() is True

    assert conn.poll(60)
    server_conn_id, blobs = conn.recv()
    rng = np.random.default_rng(42)
    bufs = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(NUM_IOVS)]
    ptrs = [b.ctypes.data for b in bufs]
    sizes = [BLOCK] * NUM_IOVS
    ok, mr_ids = ep.regv(ptrs, sizes)

    # writev, 128 iovs, blocking
    assert ep.writev(conn_id, mr_ids, ptrs, sizes, blobs, NUM_IOVS) is True
    conn.send("dump")
    assert conn.recv() == [b.tobytes() for b in bufs]

    # writev_async + poll_async, several in flight
    for b in bufs:
        b[:] = rng.integers(0, 256, BLOCK, dtype=np.uint8)
    ids = []
    for half in (slice(0, 64), slice(64, 128)):
        ok, tid = ep.writev_async(conn_id, mr_ids[half], ptrs[half], sizes[half], blobs[half], 64)
        assert ok
        ids.append(tid)
    while ids:
        remaining = []
        for tid in ids:
            ok, done = ep.poll_async(tid)
            assert ok
            if not done:
                remaining.append(tid)
        ids = remaining
    conn.send("dump")
    assert conn.recv() == [b.tobytes() for b in bufs]

    # single write / write_async / read / read_async
    assert ep.write(conn_id, mr_ids[0], ptrs[0], BLOCK, blobs[0]) is True
    ok, tid = ep.write_async(conn_id, mr_ids[1], ptrs[1], BLOCK, blobs[1])
    while not ep.poll_async(tid)[1]:
        pass
    # polling a finished id again answers clearly instead of reading freed memory
    with pytest.raises(ferry.NotFound, match="already completed"):
        ep.poll_async(tid)
    with pytest.raises(ferry.NotFound, match="unknown"):
        ep.poll_async(987654321)

    conn.send("fill")
    assert conn.recv() == "filled"
    want = [np.random.default_rng(1000 + i).integers(0, 256, BLOCK, dtype=np.uint8)
            for i in range(NUM_IOVS)]
    assert ep.read(conn_id, mr_ids[0], ptrs[0], BLOCK, blobs[0]) is True
    assert np.array_equal(bufs[0], want[0])
    ok, tid = ep.read_async(conn_id, mr_ids[1], ptrs[1], BLOCK, blobs[1])
    assert ep.wait_async(tid, timeout=30)
    assert np.array_equal(bufs[1], want[1])
    # readv and readv_async over all 128
    for b in bufs:
        b[:] = 0
    assert ep.readv(conn_id, mr_ids, ptrs, sizes, blobs, NUM_IOVS) is True
    assert all(np.array_equal(b, w) for b, w in zip(bufs, want))
    for b in bufs:
        b[:] = 0
    ok, tid = ep.readv_async(conn_id, mr_ids, ptrs, sizes, blobs, NUM_IOVS)
    while not ep.poll_async(tid)[1]:
        pass
    assert all(np.array_equal(b, w) for b, w in zip(bufs, want))

    # a write that the target refuses is raised from poll_async, not reported as success
    d = ferry.Descriptor.from_bytes(blobs[0])
    d.key ^= 1
    ok, tid = ep.write_async(conn_id, mr_ids[0], ptrs[0], BLOCK, d.to_bytes())
    with pytest.raises(ferry.PermissionDenied):
        while not ep.poll_async(tid)[1]:
            pass

    for m in mr_ids:
        assert ep.dereg(m) is True
    ep.close()


def test_two_sided_calls_raise_not_supported():
    ep = p2p.Endpoint(listen="127.0.0.1:0")
    for name in ("send", "recv", "sendv", "recvv", "send_ipc", "recv_ipc"):
        with pytest.raises(ferry.NotSupported, match="one-sided"):
            getattr(ep, name)(0, 0, 0, 0)
    ep.close()


def test_compat_errors_are_raised():
    ep = p2p.Endpoint(listen="127.0.0.1:0")
    with pytest.raises(ferry.NotFound):
        ep.dereg(12345)
    with pytest.raises(ferry.InvalidArgument):
        ep.connect("127.0.0.1", 0)  # no port: Ferry has no well-known one
    with pytest.raises(ferry.InvalidArgument):
        p2p.Endpoint.parse_metadata(b"garbage")
    buf = np.zeros(4096, np.uint8)
    ok, mr = ep.reg(buf.ctypes.data, buf.nbytes)
    with pytest.raises(ferry.InvalidArgument):
        ep.writev(1, [mr], [buf.ctypes.data], [4096], [b"x" * 64], 2)  # num_iovs mismatch
    with pytest.raises(ferry.NotFound):
        ep.write(1, mr, buf.ctypes.data, 4096, b"x" * 64)  # unknown conn_id
    with pytest.raises(ferry.Timeout):
        ep.accept(timeout=0.05)
    ep.close()
