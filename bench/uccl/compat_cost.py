#!/usr/bin/env python3
"""Per-call cost of ferry.compat.uccl against Ferry's own Python API, on one
connection, in one run: the same engine, the same peer, the same buffers;
only the layer the call goes through differs. Rounds alternate between the
forms; the table gives medians of the rounds' mean latency per call and the
ratio to Ferry's own API (floor, issue 31: at most 1.2).

    python bench/uccl/compat_cost.py [--sizes 4096,1048576,16777216] [--iters 400]
                                     [--rounds 5] [--device cpu|gpu] [--p2p FILE]

Then the posting cost alone (the calling thread's CPU time until the call returns; the
transfer waited for untimed), which is the layer's own work per call: Peer.write_async
against the async forms.

Forms (one block per call, blocking unless said):
  ferry      Peer.write((region, 0, size), (desc, 0, size))         -- the reference
  write_ipc  Endpoint.write_ipc(conn, ptr, size, desc)              -- UCCL --write-ipc
             (from a buffer never registered, as that benchmark's client)
  writev     Endpoint.writev(conn, [mr], [ptr], [size], [desc], 1)   -- UCCL's default mode
  async      Endpoint.write_async(...) then poll_async until done
The target is a second process with an Endpoint of its own (connect() by address,
as UCCL's benchmark does). --device gpu puts both buffers on GPU 0 (torch).
--p2p FILE: load the Endpoint from another p2p.py (e.g. an older version) as
ferry.compat.uccl.p2p_under_test, for before/after figures in one run.
"""
from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import statistics
import sys
import time


def buffer(size, device):
    if device == "gpu":
        import torch
        t = torch.zeros(size, dtype=torch.uint8, device="cuda:0")
        return t, t.data_ptr()
    import numpy as np
    a = np.zeros(size, dtype=np.uint8)
    return a, a.ctypes.data


def target(conn, sizes, device):
    if device == "gpu":
        import torch  # noqa: F401 - before ferry (see main)
    from ferry.compat.uccl import p2p
    ep = p2p.Endpoint(0)
    keep = []
    blobs = []
    for s in sizes:
        buf, ptr = buffer(s, device)
        keep.append(buf)
        ok, mr = ep.reg(ptr, s)
        blobs.append(ep.advertise(mr, ptr, s)[1])
    conn.send((ep.get_metadata(), blobs))
    conn.recv()
    ep.close()


def load_p2p(path):
    if not path:
        from ferry.compat.uccl import p2p
        return p2p
    import ferry.compat.uccl  # noqa: F401 - the package the module's relative imports name
    spec = importlib.util.spec_from_file_location("ferry.compat.uccl.p2p_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4096,1048576,16777216")
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--p2p", default=None)
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",") if x]
    if a.device == "gpu":
        import torch  # noqa: F401 - before ferry: torch imported after it aborted (H200, 2026-11-27)
    p2p = load_p2p(a.p2p)

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=target, args=(there, sizes, a.device), daemon=True)
    proc.start()
    metadata, blobs = here.recv()
    ep = p2p.Endpoint(0)
    ip, port, gpu = p2p.Endpoint.parse_metadata(metadata)
    ok, conn = ep.connect(ip, gpu, remote_port=port)
    (peer_id,) = ep.engine.peers()
    peer = ep.engine.peer(peer_id)
    carriers = {t["transport"]: t["carries"] for t in peer.transports() if t["carries"]}
    print(f"# {a.device} memory, connected by address; carriers {carriers}; "
          f"p2p from {p2p.__file__}")
    print(f"{'size':>9} | {'ferry us':>9} | {'write_ipc':>15} | {'writev':>15} | {'async+poll':>15}")
    posts = {}
    for size, blob in zip(sizes, blobs):
        buf, ptr = buffer(size, a.device)
        ok, mr = ep.reg(ptr, size)
        region = ep.region(mr)

        def ferry_call():
            peer.write((region, 0, size), (blob, 0, size))

        ubuf, uptr = buffer(size, a.device)  # not registered, as UCCL's --write-ipc client

        def write_ipc():
            ep.write_ipc(conn, uptr, size, blob)

        def writev():
            ep.writev(conn, [mr], [ptr], [size], [blob], 1)

        def async_poll():
            ok, tid = ep.write_async(conn, mr, ptr, size, blob)
            while not ep.poll_async(tid)[1]:
                pass

        forms = {"ferry": ferry_call, "write_ipc": write_ipc, "writev": writev,
                 "async": async_poll}
        lat = {k: [] for k in forms}
        for f in forms.values():
            for _ in range(20):
                f()
        for r in range(a.rounds):
            order = list(forms) if r % 2 == 0 else list(reversed(forms))
            for k in order:
                f = forms[k]
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    f()
                lat[k].append((time.perf_counter() - t0) / a.iters * 1e6)
        med = {k: statistics.median(v) for k, v in lat.items()}
        ref = med["ferry"]
        cells = " | ".join(f"{med[k]:7.2f} {med[k] / ref:5.2f}x" for k in ("write_ipc", "writev", "async"))
        print(f"{size:>9} | {ref:9.2f} | {cells}", flush=True)
        posts[size] = post_costs(ep, conn, peer, region, mr, ptr, uptr, size, blob, a)
        ep.dereg(mr)
    # The layer's own work per call, apart from the transfer: the time to post (the
    # call returning its transfer id), 32 posts timed, then waited for untimed.
    print("\nposting cost per call, us of the posting thread's CPU time (median of rounds; the "
          "transfer itself is waited for untimed)")
    print(f"{'size':>9} | {'ferry':>7} | {'write_ipc_async':>15} | {'writev_async':>15} | "
          f"{'write_async':>15}")
    for size, med in posts.items():
        ref = med["ferry"]
        cells = " | ".join(f"{med[k]:7.2f} {med[k] / ref:5.2f}x"
                           for k in ("write_ipc_async", "writev_async", "write_async"))
        print(f"{size:>9} | {ref:7.2f} | {cells}")
    here.send("done")
    proc.join(30)
    ep.close()
    return 0


def post_costs(ep, conn, peer, region, mr, ptr, uptr, size, blob, a, batch=32):
    def ferry_post():
        return peer.write_async((region, 0, size), (blob, 0, size))

    forms = {
        "ferry": (ferry_post, lambda t: t.wait()),
        "write_ipc_async": (lambda: ep.write_ipc_async(conn, uptr, size, blob)[1],
                            lambda t: ep.wait_async(t)),
        "writev_async": (lambda: ep.writev_async(conn, [mr], [ptr], [size], [blob], 1)[1],
                         lambda t: ep.wait_async(t)),
        "write_async": (lambda: ep.write_async(conn, mr, ptr, size, blob)[1],
                        lambda t: ep.wait_async(t)),
    }
    got = {k: [] for k in forms}
    rounds = max(3, a.iters // batch)
    for r in range(rounds):
        order = list(forms) if r % 2 == 0 else list(reversed(forms))
        for k in order:
            post, wait = forms[k]
            t0 = time.thread_time()  # this thread's CPU time: a loaded machine's preemption left out
            ids = [post() for _ in range(batch)]
            got[k].append((time.thread_time() - t0) / batch * 1e6)
            for t in ids:
                wait(t)
    return {k: statistics.median(v) for k, v in got.items()}


if __name__ == "__main__":
    sys.exit(main())
