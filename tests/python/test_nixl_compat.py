"""ferry.compat.nixl between two processes: a target agent in a child process, the
initiator here. Random data, every byte checked after each transfer; the failure
paths (descriptors outside registered memory, unknown agents, released handles,
memory deregistered by the target, a dead target) raise NIXL's exceptions with
messages naming the descriptor, agent or handle."""
import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from ferry.compat.nixl import nixl_agent, nixl_agent_config
from ferry.compat.nixl import _bindings as nb

CTX = mp.get_context("spawn")
SIZES = (256 * 1024, 64 * 1024, 4096 * 3)  # the target's three buffers


def _wait(pred, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


def _target(conn, listen):
    """The target: registers three buffers (two in one call), then serves commands."""
    import numpy as np
    from cross_process import dump, ordered_by_peer
    from ferry.compat.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent("target", nixl_agent_config(enable_listen_thread=listen, listen_port=0))
    bufs = [np.zeros(n, np.uint8) for n in SIZES]
    regs = [agent.register_memory([(b.ctypes.data, b.nbytes, 0, "kv") for b in bufs[:2]], "DRAM"),
            agent.register_memory([(bufs[2].ctypes.data, bufs[2].nbytes, 0, "")], "DRAM")]
    port = agent.agent.exchange.port
    conn.send((agent.get_agent_metadata(), [b.ctypes.data for b in bufs], port))
    notifs = []
    while True:
        cmd, *args = conn.recv()
        if cmd == "fill":
            rng = np.random.default_rng(args[0])
            for b in bufs:
                data = rng.integers(0, 256, b.size, dtype=np.uint8)
                with ordered_by_peer():
                    b[:] = data
            conn.send("ok")
        elif cmd == "dump":
            conn.send(dump(bufs))
        elif cmd == "notifs":  # wait until `count` messages from `sender` are there
            sender, count = args
            deadline = time.monotonic() + 20
            while len(notifs) < count and time.monotonic() < deadline:
                notifs.extend(agent.get_new_notifs().get(sender, []))
            taken, notifs = notifs[:count], notifs[count:]
            conn.send(taken)
        elif cmd == "wait_done":  # check_remote_xfer_done until the tag arrives
            sender, tag = args
            conn.send(bool(_wait(lambda: agent.check_remote_xfer_done(sender, tag), 20,
                                 f"notification {tag!r}")))
        elif cmd == "wait_md":
            conn.send(bool(_wait(lambda: agent.check_remote_metadata(args[0]), 20, "metadata")))
        elif cmd == "knows":
            conn.send(agent.check_remote_metadata(args[0]))
        elif cmd == "add":
            conn.send(agent.add_remote_agent(args[0]))
        elif cmd == "notify":
            for msg in args[1]:
                agent.send_notif(args[0], msg)
            conn.send("ok")
        elif cmd == "partial":  # partial metadata of registration `which` to ip:port
            which, ip, port, label = args
            if ip:
                agent.send_partial_agent_metadata(regs[which], True, ["UCX"], ip, port)
            else:
                agent.send_partial_agent_metadata(regs[which], True, ["UCX"], label=label)
            conn.send("ok")
        elif cmd == "publish":
            agent.send_local_metadata()
            conn.send("ok")
        elif cmd == "dereg":
            agent.deregister_memory(regs[args[0]])
            conn.send("ok")
        elif cmd == "exit":
            conn.send("bye")
            return


class Target:
    def __init__(self, listen=False):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=_target, args=(child, listen), daemon=True)
        self.proc.start()
        child.close()
        assert self.conn.poll(60), "the target process did not start"
        self.metadata, self.addrs, self.port = self.conn.recv()

    def __call__(self, *cmd):
        self.conn.send(cmd)
        assert self.conn.poll(60), f"the target did not answer {cmd[0]}"
        return self.conn.recv()

    def close(self):
        if self.proc.is_alive():
            try:
                self("exit")
            except (OSError, EOFError, AssertionError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


@pytest.fixture()
def target():
    t = Target()
    yield t
    t.close()


def _initiator(name="initiator", **conf):
    agent = nixl_agent(name, nixl_agent_config(**conf) if conf else None)
    local = np.zeros(sum(SIZES), np.uint8)
    reg = agent.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
    return agent, local, reg


def _done(agent, handle):
    return _wait(lambda: agent.check_xfer_state(handle) == "DONE", 20, "DONE")


def test_write_and_read_through_both_apis(target):
    agent, local, _ = _initiator(capture_telemetry=True)
    assert agent.add_remote_agent(target.metadata) == b"target"
    rng = np.random.default_rng(7)
    local[:] = rng.integers(0, 256, local.size, dtype=np.uint8)
    # WRITE, one call across the target's three buffers (two registrations).
    remote = [(a, n, 0) for a, n in zip(target.addrs, SIZES)]
    offs = np.cumsum((0,) + SIZES[:-1])
    local_descs = agent.get_xfer_descs([(local.ctypes.data + int(o), n, 0)
                                        for o, n in zip(offs, SIZES)], "DRAM")
    h = agent.initialize_xfer("WRITE", local_descs, agent.get_xfer_descs(remote, "DRAM"),
                              "target", b"wrote-1")
    assert agent.transfer(h) in ("DONE", "PROC")
    _done(agent, h)
    assert target("wait_done", "initiator", b"wrote")  # prefix match, after the data
    got = target("dump")
    for o, n, blob in zip(offs, SIZES, got):
        assert blob == local[o:o + n].tobytes()
    t = agent.get_xfer_telemetry(h)
    assert (t.totalBytes, t.descCount) == (sum(SIZES), 3)
    assert t.xferDuration >= t.postDuration > 0 and t.startTime > 0
    agent.release_xfer_handle(h)

    # READ through prepared lists: 4 KiB blocks of the first buffer, shuffled pairs.
    target("fill", 11)
    blocks = SIZES[0] // 4096
    remote_rows = np.array([[target.addrs[0] + 4096 * i, 4096, 0] for i in range(blocks)],
                           dtype=np.uint64)
    local_rows = remote_rows.copy()
    local_rows[:, 0] = local.ctypes.data + 4096 * np.arange(blocks, dtype=np.uint64)
    lside = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, "DRAM")
    rside = agent.prep_xfer_dlist("target", remote_rows, "DRAM")
    perm = np.random.default_rng(3).permutation(blocks).astype(np.int32)
    h = agent.make_prepped_xfer("READ", lside, np.arange(blocks, dtype=np.int32), rside, perm,
                                b"read-1")
    agent.transfer(h)
    _done(agent, h)
    src = np.frombuffer(target("dump")[0], np.uint8).reshape(blocks, 4096)
    assert np.array_equal(local[:SIZES[0]].reshape(blocks, 4096), src[perm])
    assert target("notifs", "initiator", 1) == [b"read-1"]
    # The same handle posted again with a new message reads the new data.
    target("fill", 12)
    agent.transfer(h, b"read-2")
    _done(agent, h)
    src = np.frombuffer(target("dump")[0], np.uint8).reshape(blocks, 4096)
    assert np.array_equal(local[:SIZES[0]].reshape(blocks, 4096), src[perm])
    assert target("notifs", "initiator", 1) == [b"read-2"]
    agent.release_xfer_handle(h)
    # A READ released once done but never polled still notifies the target.
    h = agent.make_prepped_xfer("READ", lside, [0], rside, [1], b"unpolled")
    if agent.transfer(h) != "DONE":
        # Wait for the engine's transfer itself, not through check_xfer_state.
        _wait(lambda: h._req._transfer.done(), 20, "the read")
        agent.release_xfer_handle(h)
    assert target("notifs", "initiator", 1) == [b"unpolled"]
    agent.release_dlist_handle(lside)
    agent.release_dlist_handle(rside)
    agent.close()


def test_one_request_spans_several_local_registrations(target):
    """The local side of one request lies in three registrations: one Ferry call
    each, one notification after all of them."""
    agent = nixl_agent("initiator", nixl_agent_config(backends=["FERRY"]))
    agent.add_remote_agent(target.metadata)
    parts = [np.random.default_rng(i).integers(0, 256, 4096 * 4, dtype=np.uint8) for i in range(3)]
    regs = [agent.register_memory([(p.ctypes.data, p.nbytes, 0, "")], "DRAM") for p in parts]
    # Interleave: block j of part j % 3 goes to target block j.
    rows_l = [(parts[j % 3].ctypes.data + 4096 * (j // 3), 4096, 0) for j in range(12)]
    rows_r = [(target.addrs[0] + 4096 * j, 4096, 0) for j in range(12)]
    h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(rows_l, "DRAM"),
                              agent.get_xfer_descs(rows_r, "DRAM"), "target", b"spread")
    agent.transfer(h)
    _done(agent, h)
    assert target("notifs", "initiator", 1) == [b"spread"]
    got = np.frombuffer(target("dump")[0], np.uint8)
    for j in range(12):
        want = parts[j % 3][4096 * (j // 3):4096 * (j // 3 + 1)]
        assert np.array_equal(got[4096 * j:4096 * (j + 1)], want), f"block {j}"
    h.release()
    for r in regs:
        agent.deregister_memory(r)
    agent.close()


def test_notifications_keep_order_and_name_the_sender(target):
    agent, _, _ = _initiator()
    agent.add_remote_agent(target.metadata)
    msgs = [f"m{i}".encode() * (i % 7 + 1) for i in range(200)]
    for m in msgs:
        agent.send_notif("target", m)
    assert target("notifs", "initiator", len(msgs)) == msgs
    # The target answers by name once it has our metadata.
    assert target("add", agent.get_agent_metadata()) == b"initiator"
    target("notify", "initiator", [b"alpha-1", b"beta-2", b"gamma-3"])
    _wait(lambda: len(agent.update_notifs().get("target", [])) == 3, what="3 notifications")
    assert agent.check_remote_xfer_done("target", b"beta")           # prefix
    assert agent.check_remote_xfer_done("target", b"a-3", tag_is_prefix=False)  # substring
    assert not agent.check_remote_xfer_done("target", b"beta")       # consumed
    assert agent.notifs["target"] == [b"alpha-1"]
    agent.close()


def test_errors_name_the_descriptor_agent_and_handle(target):
    agent, local, reg = _initiator()
    agent.add_remote_agent(target.metadata)
    base = target.addrs[2]
    good_l = agent.get_xfer_descs([(local.ctypes.data, 4096, 0)], "DRAM")
    outside = agent.get_xfer_descs([(base + SIZES[2] - 100, 4096, 0)], "DRAM")
    with pytest.raises(nb.nixlNotFoundError, match=r"remote \(agent 'target'\) descriptor 0 "
                       rf"\(DRAM \[0x{base + SIZES[2] - 100:x}, \+4096\).*outside"):
        agent.initialize_xfer("READ", good_l, outside, "target")
    stray = agent.get_xfer_descs([(local.ctypes.data + local.nbytes, 4096, 0)], "DRAM")
    good_r = agent.get_xfer_descs([(base, 4096, 0)], "DRAM")
    with pytest.raises(nb.nixlNotFoundError, match=r"local descriptor 0 .*outside the DRAM "
                       r"memory this agent 'initiator' registered"):
        agent.initialize_xfer("WRITE", stray, good_r, "target")
    with pytest.raises(nb.nixlNotFoundError, match=r"unknown remote agent 'nobody'.*'target'"):
        agent.initialize_xfer("WRITE", good_l, good_r, "nobody")
    with pytest.raises(nb.nixlNotFoundError, match="unknown remote agent 'nobody'"):
        agent.send_notif("nobody", b"x")
    with pytest.raises(nb.nixlInvalidParamError, match="local length 4096 but remote length 8"):
        agent.initialize_xfer("WRITE", good_l, agent.get_xfer_descs([(base, 8, 0)], "DRAM"),
                              "target")
    with pytest.raises(KeyError):
        agent.initialize_xfer("COPY", good_l, good_r, "target")
    lside = agent.prep_xfer_dlist("", good_l)
    rside = agent.prep_xfer_dlist("target", good_r)
    with pytest.raises(nb.nixlInvalidParamError, match=r"remote index 5 \(position 0\) is outside"):
        agent.make_prepped_xfer("READ", lside, [0], rside, [5])
    with pytest.raises(nb.nixlInvalidParamError, match="remote side handle is a local"):
        agent.make_prepped_xfer("READ", lside, [0], lside, [0])
    h = agent.make_prepped_xfer("READ", lside, [0], rside, [0])
    raw = h._handle
    h.release()
    with pytest.raises(nb.nixlNotFoundError, match=rf"transfer handle {raw} was released"):
        agent.agent.postXferReq(raw)
    with pytest.raises(nb.nixlNotFoundError, match="is not a transfer handle of this agent"):
        agent.agent.getXferStatus(12345)
    with pytest.raises(nb.nixlNotFoundError, match="has no such registration"):
        agent.deregister_memory(agent.get_reg_descs([(local.ctypes.data, 8, 0, "")], "DRAM"))
    # Local memory deregistered after the request was made: the post is refused.
    spare = np.zeros(8192, np.uint8)
    spare_reg = agent.register_memory([(spare.ctypes.data, spare.nbytes, 0, "")], "DRAM")
    h = agent.initialize_xfer("READ", agent.get_xfer_descs([(spare.ctypes.data, 4096, 0)], "DRAM"),
                              good_r, "target")
    agent.deregister_memory(spare_reg)
    with pytest.raises(nb.nixlError, match=f"{spare.ctypes.data:x}|not registered|no region"):
        agent.transfer(h)
        _wait(lambda: agent.check_xfer_state(h) == "DONE", 20, "the failure")
    assert not spare.any()  # nothing was read into memory no longer registered
    # The target deregisters its third buffer: the read fails there, named by Ferry.
    h = agent.initialize_xfer("READ", good_l, good_r, "target")
    agent.transfer(h)
    _done(agent, h)
    target("dereg", 1)
    with pytest.raises(nb.nixlNotFoundError, match=r"READ of 1 descriptor.*agent 'target' failed: "
                       r".*region \d+ is not registered on the target"):
        agent.transfer(h)  # the failure shows at the call that sees the request complete
        _wait(lambda: agent.check_xfer_state(h) == "DONE", 20, "the failure")
    with pytest.raises(nb.nixlError):  # a failed request stays failed when polled again
        agent.check_xfer_state(h)
    # A dead target: posting or completing fails; the agent stays usable.
    h2 = agent.initialize_xfer("READ", good_l,
                               agent.get_xfer_descs([(target.addrs[0], 4096, 0)], "DRAM"), "target")
    target.proc.kill()
    target.proc.join(10)
    with pytest.raises(nb.nixlError):
        agent.transfer(h2)
        _wait(lambda: agent.check_xfer_state(h2) == "DONE", 20, "the failure")
    agent.deregister_memory(reg)
    agent.close()


def test_metadata_through_the_listeners():
    """basic_two_peers' exchange: fetch the target's metadata from its listener and
    send ours to it; invalidate at the end."""
    target = Target(listen=True)
    try:
        agent, local, _ = _initiator(enable_listen_thread=True, listen_port=0)
        assert not agent.check_remote_metadata("target")
        agent.fetch_remote_metadata("target", "127.0.0.1", target.port)
        agent.send_local_metadata("127.0.0.1", target.port)
        _wait(lambda: agent.check_remote_metadata("target"), what="the target's metadata")
        assert target("wait_md", "initiator")
        target("fill", 5)
        h = agent.initialize_xfer("READ", agent.get_xfer_descs([(local.ctypes.data, SIZES[1], 0)],
                                                               "DRAM"),
                                  agent.get_xfer_descs([(target.addrs[1], SIZES[1], 0)], "DRAM"),
                                  "target", b"Done_reading")
        agent.transfer(h)
        _done(agent, h)
        assert local[:SIZES[1]].tobytes() == target("dump")[1]
        assert target("wait_done", "initiator", b"Done_reading")
        agent.invalidate_local_metadata("127.0.0.1", target.port)
        _wait(lambda: not target("knows", "initiator"), what="the invalidation")
        agent.remove_remote_agent("target")
        assert not agent.check_remote_metadata("target")
        agent.close()
    finally:
        target.close()


def test_partial_metadata_adds_regions_as_they_come():
    target = Target(listen=False)
    try:
        agent, local, _ = _initiator(enable_listen_thread=True, listen_port=0)
        port = agent.agent.exchange.port
        target("partial", 1, "127.0.0.1", port, "")  # the third buffer only
        third = agent.get_xfer_descs([(target.addrs[2], 4096, 0)], "DRAM")
        first = agent.get_xfer_descs([(target.addrs[0], 4096, 0)], "DRAM")
        _wait(lambda: agent.check_remote_metadata("target", third), what="partial metadata")
        assert not agent.check_remote_metadata("target", first)
        mine = agent.get_xfer_descs([(local.ctypes.data, 4096, 0)], "DRAM")
        with pytest.raises(nb.nixlNotFoundError, match="outside the DRAM memory agent 'target'"):
            agent.initialize_xfer("READ", mine, first, "target")
        target("fill", 9)
        h = agent.initialize_xfer("READ", mine, third, "target")
        agent.transfer(h)
        _done(agent, h)
        assert local[:4096].tobytes() == target("dump")[2][:4096]
        target("partial", 0, "127.0.0.1", port, "")
        _wait(lambda: agent.check_remote_metadata("target", first), what="the second part")
        h = agent.initialize_xfer("READ", mine, first, "target")
        agent.transfer(h)
        _done(agent, h)
        assert local[:4096].tobytes() == target("dump")[0][:4096]
        agent.close()
    finally:
        target.close()


def test_metadata_through_etcd(monkeypatch):
    from test_directory import ETCD, Etcd
    if not ETCD:
        pytest.skip("etcd is not installed (Debian package etcd-server): NIXL's etcd exchange "
                    "needs a real etcd server")
    server = Etcd()
    server.start()
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", f"http://{server.address}")
    monkeypatch.setenv("NIXL_ETCD_NAMESPACE", f"/nixl-{os.getpid()}/agents/")
    target = Target()  # inherits the environment
    try:
        agent, local, _ = _initiator()
        target("partial", 1, "", 0, "label_1")
        agent.fetch_remote_metadata("target", label="label_1")
        third = agent.get_xfer_descs([(target.addrs[2], SIZES[2], 0)], "DRAM")
        _wait(lambda: agent.check_remote_metadata("target", third), what="metadata from etcd")
        target("fill", 21)
        h = agent.initialize_xfer("READ", agent.get_xfer_descs([(local.ctypes.data, SIZES[2], 0)],
                                                               "DRAM"), third, "target")
        agent.transfer(h)
        _done(agent, h)
        assert local[:SIZES[2]].tobytes() == target("dump")[2]
        target("publish")  # full metadata, no label
        agent.fetch_remote_metadata("target")
        first = agent.get_xfer_descs([(target.addrs[0], 4096, 0)], "DRAM")
        _wait(lambda: agent.check_remote_metadata("target", first), what="full metadata")
        agent.close()
    finally:
        target.close()
        server.close()
