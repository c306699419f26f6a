"""vLLM's NixlConnector call sequence on ferry.compat.nixl, two processes.

The prefill worker (a child process) registers its KV caches -- K and V of
several layers, one region each, as NixlConnectorWorker.register_kv_caches does
-- prepares its local block list and hands out its agent metadata with the
cache base addresses. The decode worker (this process) registers its own caches,
prepares its block descriptors once (NIXL_INIT_AGENT), loads the prefill agent
(add_remote_agent returns its name as bytes), prepares the remote block list
once, then for each request READs a list of block ids (descriptor id = region x
num_blocks + block id, as _get_block_descs_ids) with make_prepped_xfer and the
notification "req_id:tp_size", polls check_xfer_state, records telemetry,
releases the handle; a full prefix hit sends the notification alone. The
prefill side drains get_new_notifs until every request reported done. Every
byte of every block read is checked. Host memory here; the GPU variant needs
torch with CUDA and is skipped with the reason elsewhere.
"""
import multiprocessing as mp
import time
import uuid

import numpy as np
import pytest

from ferry.compat.nixl import nixl_agent, nixl_agent_config

CTX = mp.get_context("spawn")
LAYERS = 3
REGIONS = 2 * LAYERS          # K and V of each layer in their own region
BLOCK_LEN = 2 * 16 * 8 * 64    # bf16 x block_size 16 x 8 kv heads x head_dim 64 = 16 KiB
P_BLOCKS, D_BLOCKS = 40, 56
REQUESTS = 6


def _caches(seed, blocks, device):
    """REGIONS caches of blocks x BLOCK_LEN bytes of random data; numpy for host
    memory, torch tensors for device=cuda:N."""
    rng = np.random.default_rng(seed)
    host = [rng.integers(0, 256, (blocks, BLOCK_LEN), dtype=np.uint8) for _ in range(REGIONS)]
    if device == "cpu":
        return host, "DRAM", 0
    import torch
    caches = [torch.from_numpy(h).to(device) for h in host]
    return caches, "VRAM", caches[0].get_device()


def _ptr(cache):
    return cache.ctypes.data if isinstance(cache, np.ndarray) else cache.data_ptr()


def _host(cache):
    return cache if isinstance(cache, np.ndarray) else cache.cpu().numpy()


def _register(agent, caches, mem, dev, blocks):
    """register_kv_caches + register_local_xfer_handler."""
    caches_data = [(_ptr(c), blocks * BLOCK_LEN, dev, "") for c in caches]
    descs = agent.get_reg_descs(caches_data, mem)
    agent.register_memory(descs, backends=["UCX"])
    blocks_data = [(_ptr(c) + b * BLOCK_LEN, BLOCK_LEN, dev) for c in caches for b in range(blocks)]
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(blocks_data, mem))
    return descs, local


def _prefill(conn, device, seed):
    from ferry.compat.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(num_threads=4, capture_telemetry=True))
    caches, mem, dev = _caches(seed, P_BLOCKS, device)
    descs, local = _register(agent, caches, mem, dev, P_BLOCKS)
    conn.send(dict(agent_metadata=agent.get_agent_metadata(), device_id=dev,
                   kv_caches_base_addr=[_ptr(c) for c in caches], num_blocks=P_BLOCKS,
                   block_lens=[BLOCK_LEN] * REGIONS))
    while True:
        cmd, arg = conn.recv()
        if cmd == "expect":  # _get_new_notifs until every request id was seen
            seen, deadline = [], time.monotonic() + 30
            while len(seen) < len(arg) and time.monotonic() < deadline:
                for notifs in agent.get_new_notifs().values():
                    for notif in notifs:
                        req_id, tp_size = notif.decode("utf-8").rsplit(":", 1)
                        seen.append((req_id, int(tp_size)))
            conn.send(seen)
        elif cmd == "exit":
            agent.release_dlist_handle(local)
            agent.deregister_memory(descs)
            conn.send("bye")
            return


def _run_decode(device, prefill_device=None):
    parent, child = CTX.Pipe()
    seed = 1234
    proc = CTX.Process(target=_prefill, args=(child, prefill_device or device, seed),
                       daemon=True)
    proc.start()
    child.close()
    try:
        assert parent.poll(60), "the prefill worker did not start"
        meta = parent.recv()
        wrapper = nixl_agent(str(uuid.uuid4()),
                             nixl_agent_config(num_threads=4, capture_telemetry=True))
        caches, mem, dev = _caches(99, D_BLOCKS, device)
        descs, src_handle = _register(wrapper, caches, mem, dev, D_BLOCKS)
        remote_name = wrapper.add_remote_agent(meta["agent_metadata"])
        assert isinstance(remote_name, bytes)
        dst_blocks = [(base + b * meta["block_lens"][i], BLOCK_LEN, meta["device_id"])
                      for i, base in enumerate(meta["kv_caches_base_addr"])
                      for b in range(meta["num_blocks"])]
        dst_handle = wrapper.prep_xfer_dlist(remote_name, wrapper.get_xfer_descs(dst_blocks, mem))

        def desc_ids(block_ids, num_blocks):
            return (np.arange(REGIONS)[:, None] * num_blocks + np.asarray(block_ids)[None, :]).flatten()

        rng = np.random.default_rng(5)
        recving, plans, stats = {}, {}, []
        free_local = list(rng.permutation(D_BLOCKS))  # each request gets its own local blocks
        for r in range(REQUESTS):
            n = int(rng.integers(1, 9))
            remote_ids = rng.choice(P_BLOCKS, n, replace=False)
            local_ids = np.array([free_local.pop() for _ in range(n)])
            req_id = f"req-{r}"
            handle = wrapper.make_prepped_xfer("READ", src_handle, desc_ids(local_ids, D_BLOCKS),
                                               dst_handle, desc_ids(remote_ids, P_BLOCKS),
                                               notif_msg=f"{req_id}:1".encode())
            wrapper.transfer(handle)
            recving[req_id] = [handle]
            plans[req_id] = (local_ids, remote_ids)
        # A full prefix cache hit: nothing to read, the prefill worker is told alone.
        wrapper.send_notif(remote_name, notif_msg=b"req-hit:1")

        deadline = time.monotonic() + 30
        while recving and time.monotonic() < deadline:  # _pop_done_transfers
            for req_id, handles in list(recving.items()):
                left = []
                for h in handles:
                    state = wrapper.check_xfer_state(h)
                    if state == "DONE":
                        stats.append(wrapper.get_xfer_telemetry(h))
                        wrapper.release_xfer_handle(h)
                    else:
                        assert state == "PROC", state
                        left.append(h)
                if left:
                    recving[req_id] = left
                else:
                    del recving[req_id]
        assert not recving, f"requests not done: {sorted(recving)}"

        want = [f"req-{r}" for r in range(REQUESTS)] + ["req-hit"]
        parent.send(("expect", want))
        assert parent.poll(40)
        seen = parent.recv()
        assert sorted(seen) == sorted((w, 1) for w in want)

        prefill = [_host(c) for c in _caches(seed, P_BLOCKS, "cpu")[0]]
        decode = [_host(c) for c in caches]
        for req_id, (local_ids, remote_ids) in plans.items():
            for reg in range(REGIONS):
                for lb, rb in zip(local_ids, remote_ids):
                    assert np.array_equal(decode[reg][lb], prefill[reg][rb]), \
                        f"{req_id}: region {reg} block {lb} <- {rb}"
        assert len(stats) == REQUESTS
        assert all(t.totalBytes == t.descCount * BLOCK_LEN and t.descCount % REGIONS == 0
                   for t in stats)

        # shutdown()
        wrapper.release_dlist_handle(src_handle)
        wrapper.release_dlist_handle(dst_handle)
        wrapper.remove_remote_agent(remote_name)
        wrapper.deregister_memory(descs)
        assert not wrapper.check_remote_metadata(remote_name)
        parent.send(("exit", None))
        assert parent.poll(20) and parent.recv() == "bye"
    finally:
        if proc.is_alive():
            proc.kill()


def test_vllm_nixl_connector_sequence_host_memory():
    _run_decode("cpu")


def _gpu_reason():
    try:
        import torch
    except Exception as exc:  # absent, or an install that does not load
        return f"torch does not import ({exc!r}): the VRAM variant registers torch CUDA tensors"
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch: the VRAM variant needs a GPU"
    import ferry
    if not ferry.cuda_available():
        return f"Ferry has no GPU support here: {ferry.cuda_unavailable_reason()}"
    return ""


def test_vllm_nixl_connector_sequence_vram():
    reason = _gpu_reason()  # here, not at import: spawned workers import this module
    if reason:
        pytest.skip(reason)
    import torch
    # One GPU per worker where there are two (prefill on 0, decode on the last).
    _run_decode(f"cuda:{torch.cuda.device_count() - 1}", "cuda:0")
