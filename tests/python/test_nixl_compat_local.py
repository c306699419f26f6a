"""ferry.compat.nixl in one process: configuration, plugins, descriptor lists,
telemetry switches, the `nixl` shim, torch tensors; two agents of one process
move real bytes between their Ferry engines."""
import os
import pickle
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from ferry.compat import nixl as fnixl
from ferry.compat.nixl import _bindings as nb
from ferry.compat.nixl import _utils, nixl_agent, nixl_agent_config, nixl_thread_sync_t


def _agent(**conf):
    return nixl_agent(str(uuid.uuid4()), nixl_agent_config(**conf))


def test_config_and_plugins():
    with pytest.raises(ValueError):
        nixl_agent("")
    with pytest.raises(TypeError, match="sync_mode must be a nixl_thread_sync_t"):
        nixl_agent_config(sync_mode=1)
    a = _agent(backends=[])
    assert "UCX" in a.get_plugin_list() and "FERRY" in a.get_plugin_list()
    assert a.backends == {}
    assert a.get_plugin_mem_types("UCX") == ["DRAM", "VRAM"]
    assert a.get_plugin_mem_types("UVX") == [] and a.get_plugin_params("UVX") == {}
    with pytest.raises(nb.nixlNotFoundError, match="no NIXL plugin named 'UVX'"):
        a.create_backend("UVX")
    a.create_backend("UCX")
    assert a.get_backend_mem_types("UCX") == ["DRAM", "VRAM"]
    with pytest.raises(KeyError):
        a.make_prepped_xfer("RD", 0, [], 0, [])
    b = _agent(backends=["UCX", "NOPE"])  # an unknown backend is skipped, as NIXL does
    assert list(b.backends) == ["UCX"]


def test_sync_mode_reaches_the_native_agent(monkeypatch):
    seen = {}
    real = nb.nixlAgent

    def spy(name, config):
        seen["sync"] = config.syncMode
        return real(name, config)
    monkeypatch.setattr(nb, "nixlAgent", spy)
    _agent(enable_listen_thread=True, listen_port=0)
    assert seen["sync"] == nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT.value
    _agent(sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
    assert seen["sync"] == nixl_thread_sync_t.NIXL_THREAD_SYNC_RW.value
    _agent(sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE, enable_listen_thread=True,
           listen_port=0)  # NONE is 0: it must not fall back to the listener's default
    assert seen["sync"] == nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value


def test_descriptor_lists():
    a = _agent(backends=[])
    rows = [(0x1000, 64, 0, "a"), (0x2000, 128, 0, "b")]
    reg = a.get_reg_descs(rows, "DRAM")
    assert reg.descCount() == 2 and reg[1] == rows[1] and reg.getType() == nb.DRAM_SEG
    xfer = reg.trim()
    assert isinstance(xfer, nb.nixlXferDList) and xfer[0] == (0x1000, 64, 0)
    assert pickle.loads(pickle.dumps(reg)) == reg
    assert a.deserialize_descs(a.get_serialized_descs(xfer)) == xfer
    xfer.addDesc((0x3000, 8, 0))
    assert xfer.index((0x3000, 8, 0)) == 2
    xfer.remDesc(0)
    assert xfer.descCount() == 2 and not xfer.isEmpty()
    arr = np.array([[1, 2, 0], [3, 4, 0]], dtype=np.uint64)
    assert a.get_xfer_descs(arr, "DRAM")[1] == (3, 4, 0)
    assert a.get_xfer_descs([(1, 2, 3, 4)]) is None            # 4-tuples are not xfer descs
    assert a.get_xfer_descs([(1, 2, 3)], mem_type=None) is None
    with pytest.raises(KeyError):
        a.get_xfer_descs([(1, 2, 3)], mem_type="V-RAM")
    assert a.get_xfer_descs(nb.nixlRegDList(nb.DRAM_SEG)) is None
    assert a.get_reg_descs([(1, 2, 3)]) is None
    assert a.get_reg_descs(nb.nixlXferDList(nb.DRAM_SEG)) is None
    sized = nb.nixlXferDList(nb.VRAM_SEG, 2)
    sized[1] = (5, 6, 1)
    assert sized[1] == (5, 6, 1) and sized[0] == (0, 0, 0)
    with pytest.raises(IndexError):
        sized[2]
    remote = a.get_remote_descs([(1, 2, 0, "peer")], "DRAM")
    assert remote[0] == (1, 2, 0, "peer")


def _pair(**conf):
    """Two agents of this process, each with a registered random buffer."""
    a, b = _agent(**conf), _agent(**conf)
    bufs = [np.random.default_rng(i).integers(0, 256, 1 << 16, dtype=np.uint8) for i in (1, 2)]
    for agent, buf in zip((a, b), bufs):
        agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    return a, b, bufs


def _until_done(agent, h):
    deadline = time.monotonic() + 20
    while agent.check_xfer_state(h) != "DONE":
        assert time.monotonic() < deadline


def test_telemetry_switches(monkeypatch):
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "no")  # the environment overrides the config
    a, b, (x, y) = _pair(capture_telemetry=True)
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(x.ctypes.data, 4096, 0)], "DRAM"),
                          a.get_xfer_descs([(y.ctypes.data, 4096, 0)], "DRAM"), b.name, b"t")
    a.transfer(h)
    _until_done(a, h)
    assert y[:4096].tobytes() == x[:4096].tobytes()
    with pytest.raises(nb.nixlNoTelemetryError, match="does not capture telemetry"):
        a.get_xfer_telemetry(h)
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")
    c, d, (x, y) = _pair()
    h = c.initialize_xfer("READ", c.get_xfer_descs([(x.ctypes.data, 8192, 0)], "DRAM"),
                          c.get_xfer_descs([(y.ctypes.data + 8192, 8192, 0)], "DRAM"), d.name)
    assert c.query_xfer_backend(h) == "UCX"
    c.transfer(h)
    _until_done(c, h)
    assert x[:8192].tobytes() == y[8192:16384].tobytes()
    t = c.get_xfer_telemetry(h)
    assert t.totalBytes == 8192 and t.descCount == 1 and t.xferDuration >= t.postDuration > 0


def test_strided_prepared_list_and_malloc_passthru():
    a, b, _ = _pair()
    n, blk = 8, 4096
    src, dst = _utils.malloc_passthru(n * blk), _utils.malloc_passthru(2 * n * blk)
    try:
        _utils.ba_buf(src, n * blk)
        a.register_memory([(src, n * blk, 0, "")], "DRAM")
        b.register_memory([(dst, 2 * n * blk, 0, "")], "DRAM")
        b_rows = b.get_agent_metadata()
        a.add_remote_agent(b_rows)
        # Strided (NIXL 1.5): n blocks, every other block of dst.
        lside = a.prep_xfer_dlist("", np.array([[src, blk, 0, blk, n]], np.uint64), "DRAM")
        rside = a.prep_xfer_dlist(b.name, np.array([[dst, blk, 0, 2 * blk, n]], np.uint64), "DRAM")
        h = a.make_prepped_xfer("WRITE", lside, list(range(n)), rside, list(range(n)), b"s")
        a.transfer(h)
        _until_done(a, h)
        for i in range(n):
            _utils.verify_transfer(src + i * blk, dst + 2 * i * blk, blk)
        with pytest.raises(AssertionError, match="byte 0 differs"):
            _utils.verify_transfer(src, dst + blk, blk)
    finally:
        a.close()
        b.close()
        _utils.free_passthru(src)
        _utils.free_passthru(dst)


def test_torch_tensors_register_and_move():
    torch = pytest.importorskip("torch", reason="torch is not installed: tensor inputs need it")
    a, b = _agent(), _agent()
    src = torch.arange(16 * 32, dtype=torch.float32).reshape(16, 32)
    dst = torch.zeros((16, 32), dtype=torch.float32)
    assert a.register_memory(src) is not None and b.register_memory(dst) is not None
    assert a.get_reg_descs(src.t()) is None  # not contiguous
    a.add_remote_agent(b.get_agent_metadata())
    rows_a = a.get_xfer_descs([src[i, :] for i in range(16)])
    rows_b = a.get_xfer_descs([dst[i, :] for i in range(16)])
    assert rows_a.getType() == nb.DRAM_SEG and rows_a.descCount() == 16
    h = a.initialize_xfer("WRITE", rows_a, rows_b, b.name, b"rows")
    a.transfer(h)
    _until_done(a, h)
    assert torch.equal(src, dst)


def test_shim_makes_nixl_imports_resolve(tmp_path):
    from ferry.compat.nixl import shim
    shim.write(str(tmp_path))
    code = ("import nixl, nixl._bindings as b, nixl._utils as u\n"
            "from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t\n"
            "from nixl._bindings import nixlNotFoundError, nixlXferTelemetry\n"
            "from nixl.logging import get_logger\n"
            "import ferry.compat.nixl as f\n"
            "assert nixl._api is f._api and b.nixlAgent is f._bindings.nixlAgent\n"
            "assert nixl.nixl_agent is nixl_agent and b.DRAM_SEG == f._bindings.DRAM_SEG\n"
            "print('shim ok', nixl_agent('x', nixl_agent_config(backends=[])).name)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "shim ok x" in out.stdout


def test_agents_added_from_another_thread_while_transferring():
    """vLLM adds remote agents from its handshake thread while the worker thread
    transfers: both go on, every byte checked."""
    import threading
    a, b, (x, y) = _pair()
    others = [_agent() for _ in range(3)]
    stop = threading.Event()
    errors = []

    def handshakes():
        try:
            while not stop.is_set():
                for o in others:
                    a.add_remote_agent(o.get_agent_metadata())
                    assert a.check_remote_metadata(o.name)
                    a.remove_remote_agent(o.name)
        except Exception as exc:  # reported below
            errors.append(exc)
    t = threading.Thread(target=handshakes)
    t.start()
    try:
        lside = a.prep_xfer_dlist("", [(x.ctypes.data + 4096 * i, 4096, 0) for i in range(16)],
                                  "DRAM")
        rside = a.prep_xfer_dlist(b.name, [(y.ctypes.data + 4096 * i, 4096, 0)
                                           for i in range(16)], "DRAM")
        for rnd in range(50):
            x[:16 * 4096] = np.random.default_rng(rnd).integers(0, 256, 16 * 4096, dtype=np.uint8)
            perm = np.random.default_rng(100 + rnd).permutation(16)
            h = a.make_prepped_xfer("WRITE", lside, list(range(16)), rside, perm,
                                    f"r{rnd}".encode())
            a.transfer(h)
            _until_done(a, h)
            a.release_xfer_handle(h)
            got = y[:16 * 4096].reshape(16, 4096)
            assert np.array_equal(got[perm], x[:16 * 4096].reshape(16, 4096)), f"round {rnd}"
        deadline = time.monotonic() + 20
        seen = []
        while len(seen) < 50 and time.monotonic() < deadline:
            seen += b.get_new_notifs().get(a.name, [])
        assert seen == [f"r{i}".encode() for i in range(50)]
    finally:
        stop.set()
        t.join(20)
    assert not errors, errors
