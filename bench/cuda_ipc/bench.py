#!/usr/bin/env python3
"""GPU memory between two processes of one host: Ferry (the engine's own choice
of transport, and tcp forced; with both GPUs visible to both processes, and as
serving stacks launch workers, each process seeing only its own GPU: the -1GPU
columns) against a contiguous copy (the ceiling), a
per-block copy loop, NCCL send/recv (torch.distributed) and NIXL (UCX backend),
all in one invocation, alternating, medians of several repetitions.

    python bench/cuda_ipc/bench.py                 # GPU machine: the full run
    python bench/cuda_ipc/bench.py --quick         # 1 repetition, short runs
    python bench/cuda_ipc/bench.py --cpu-smoke     # no GPU: host memory, small shapes

Processes: the initiator and the target are real processes (multiprocessing,
spawn), one pair per engine (Ferry, Ferry tcp, NIXL, NCCL), all kept alive for
the whole run and used one at a time; the copy references run in one more
process that sees both GPUs. The initiator uses GPU 0, the target GPU 1 (GPU 0
as well when only one GPU exists: then NCCL is not run, and the copy
"ceiling" is a copy within GPU 0). A pair that fails to start is listed as
NOT RUN with the reason; one that dies later is listed as FAILED from then on;
the run goes on.

Only Ferry's public Python API is used: ferry.Engine(options=...),
Engine.register, Region.advertise, Engine.metadata / connect,
Peer.write_batch / read_batch (async_=True -> Transfer.wait), Peer.transports.
The engine picks its transport for GPU memory itself (cuda_ipc where it
exists); "Ferry tcp" forces engine.transports=tcp.

Memory: DEPTH slots per side, each BATCH blocks of BLOCK bytes back to back;
call k of the DEPTH in flight moves slot k to/from slot k of the target's GPU
buffer. GB/s = calls x BATCH x BLOCK / time from the first post to the last
completion, after a warm-up. Blocking latency: one call at a time, p50 / p99
over --lat-iters calls. After the first repetition's timed run of every Ferry,
NIXL and NCCL cell, one call on fresh random bytes is checked byte for byte
on the receiving side.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import functools
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from multiprocessing.connection import wait as mp_wait
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CTX = mp.get_context("spawn")
KV = 1_179_648  # one DeepSeek-R1 layer page (nixlbench kvbench)
MEMNAME = {"gpu": "GPU", "pinned": "pinned host", "pageable": "pageable host"}


def log(*m):
    print("[cuda_ipc]", *m, file=sys.stderr, flush=True)


# --- workloads ------------------------------------------------------------------------------
def workloads(smoke: bool):
    """key, initiator memory, op, block, batch, depth, latency?  (the target's memory is its GPU)."""
    kv128, kv298, k4 = (8, 16, 256) if smoke else (128, 298, 4096)
    w = [
        ("g2g_kv128", "gpu", "write", KV, kv128, 4, False),
        ("g2g_kv298", "gpu", "write", KV, kv298, 4, False),
        ("g2g_4k", "gpu", "write", 4096, k4, 4, False),
        ("g2g_lat4k", "gpu", "write", 4096, 1, 1, True),
        ("g2g_lat64k", "gpu", "write", 65536, 1, 1, True),
        ("g2g_read_kv128", "gpu", "read", KV, kv128, 4, False),
        ("pin2g_kv128", "pinned", "write", KV, kv128, 4, False),
        ("g2pin_kv128", "pinned", "read", KV, kv128, 4, False),
        ("page2g_kv128", "pageable", "write", KV, kv128, 4, False),
        ("g2page_kv128", "pageable", "read", KV, kv128, 4, False),
    ]
    out = []
    for key, mem, op, block, batch, depth, lat in w:
        src, dst = (MEMNAME[mem], "GPU") if op == "write" else ("GPU", MEMNAME[mem])
        size = f"{block // 1024} KiB" if block % 1024 == 0 and block < KV else f"{block:,} B"
        name = (f"{src}→{dst} {op.upper()} {size}, blocking" if lat
                else f"{src}→{dst} {op.upper()} {batch:,} × {size}")
        out.append(dict(key=key, name=name, mem=mem, op=op, block=block, batch=batch, depth=depth,
                        lat=lat, slot=block * batch))
    return out


# Columns of the table: name -> (process group, variant). Groups are process pairs
# (or the one local process for the copies).
COLUMNS = {
    "Ferry": ("ferry", None),
    "Ferry tcp": ("ferry_tcp", None),
    # Each process sees only its own GPU (CUDA_VISIBLE_DEVICES=INIT / =TARGET), as serving
    # stacks launch their prefill and decode workers.
    "Ferry-1GPU": ("ferry_1gpu", None),
    "NIXL": ("nixl", None),
    "NIXL-1GPU": ("nixl_1gpu", None),
    "NCCL": ("nccl", "message"),        # one send/recv of the call's bytes
    "NCCL blocks": ("nccl_blocks", "blocks"),  # batch_isend_irecv, one p2p op per block (own pair)
    "copy": ("local", "contig"),        # one contiguous copy of the call's bytes (the ceiling)
    "copy loop": ("local", "loop"),     # one copy per block
}
RATIO_REFS = ["copy", "copy loop", "NCCL", "NIXL", "Ferry tcp"]
VERIFIED = {"ferry", "ferry_tcp", "ferry_1gpu", "nixl", "nixl_1gpu", "nccl", "nccl_blocks"}
ONE_SIDED = ("ferry", "ferry_tcp", "ferry_1gpu", "nixl", "nixl_1gpu")
CALL_TIMEOUT = 30.0  # seconds one transfer may take before the cell counts as failed


def applicable(col, wl):
    group, variant = COLUMNS[col]
    if group.startswith("nccl") and wl["mem"] != "gpu":
        return False  # NCCL moves device memory only
    if variant in ("blocks", "loop") and wl["batch"] == 1:
        return False  # the same as one message / one copy
    return True


# --- memory (in the workers) --------------------------------------------------------------
def random_bytes(n, seed):
    return np.frombuffer(bytearray(np.random.default_rng(seed).bytes(n)), dtype=np.uint8)


class Mem:
    """One buffer: 'gpu' (torch on a device), 'pinned' (torch pinned CPU tensor), 'pageable'
    (numpy). Without torch (--cpu-smoke) every kind is a numpy array."""

    def __init__(self, kind, nbytes, dev, torch):
        self.kind, self.nbytes, self.dev, self.torch = kind, nbytes, dev, torch
        self.on_gpu = torch is not None and kind == "gpu"
        if torch is None or kind == "pageable":
            self.np = np.ones(nbytes, dtype=np.uint8)  # touched: no page faults while timed
            self.obj = self.np
            self.t = torch.from_numpy(self.np) if torch is not None else None
            self.ptr = self.np.ctypes.data
        elif kind == "gpu":
            self.t = torch.ones(nbytes, dtype=torch.uint8, device=f"cuda:{dev}")
            self.obj, self.np, self.ptr = self.t, None, self.t.data_ptr()
        else:  # pinned
            self.t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.t.fill_(1)
            self.obj, self.np, self.ptr = self.t, self.t.numpy(), self.t.data_ptr()
        self.nixl_type, self.nixl_dev = ("VRAM", dev) if self.on_gpu else ("DRAM", 0)

    def fill(self, off, n, seed):
        rnd = random_bytes(n, seed)
        if self.on_gpu:
            self.t[off:off + n].copy_(self.torch.from_numpy(rnd))
            self.torch.cuda.synchronize(self.dev)
        else:
            self.np[off:off + n] = rnd

    def zero(self, off, n):
        if self.on_gpu:
            self.t[off:off + n].zero_()
            self.torch.cuda.synchronize(self.dev)
        else:
            self.np[off:off + n] = 0

    def bad(self, off, n, seed):
        """How many of the n bytes at off differ from random_bytes(n, seed)."""
        rnd = random_bytes(n, seed)
        if self.on_gpu:
            want = self.torch.from_numpy(rnd).to(f"cuda:{self.dev}")
            return int((self.t[off:off + n] != want).sum().item())
        return int(np.count_nonzero(self.np[off:off + n] != rnd))


def lat_stats(ns):
    us = np.asarray(ns, dtype=np.float64) / 1e3
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean()), "min_us": float(us.min()), "iters": int(len(us))}


def timed_calls(post, wait, slots, secs):
    """Keep len(slots) calls in flight for about `secs`: (calls, seconds). Time runs from
    the first post to the last completion."""
    q = collections.deque((h, post(h)) for h in slots)
    calls, t0 = 0, time.perf_counter()
    deadline = t0 + secs
    while q:
        h, tok = q.popleft()
        wait(tok)
        calls += 1
        if time.perf_counter() < deadline:
            q.append((h, post(h)))
    return calls, time.perf_counter() - t0


def latency_loop(once, iters):
    ns = np.empty(iters, dtype=np.int64)
    clock = time.perf_counter_ns
    for i in range(iters):
        t = clock()
        once()
        ns[i] = clock() - t
    return ns


# --- workers (one per process) ------------------------------------------------------------
class Base:
    def __init__(self, role, cfg):
        self.role, self.cfg = role, cfg
        self.torch = None
        self.dev = cfg["dev_target"] if role == "target" else cfg["dev_init"]
        if not cfg["smoke"]:
            import torch
            torch.cuda.set_device(self.dev)
            self.torch = torch
        self.mem = {}
        for kind, n in cfg["sizes"][role].items():
            if kind == "tgt":  # the local process: the target's GPU
                self.mem[kind] = Mem("gpu", n, cfg["dev_target"], self.torch)
            else:
                self.mem[kind] = Mem(kind, n, self.dev, self.torch)
        self.prepared = {}

    def hello(self):
        return {"pid": os.getpid(), "device": self.dev}

    # buffers, for the data checks
    def cmd_fill(self, kind, off, n, seed):
        self.mem[kind].fill(off, n, seed)

    def cmd_zero(self, kind, off, n):
        self.mem[kind].zero(off, n)

    def cmd_check(self, kind, off, n, seed):
        return self.mem[kind].bad(off, n, seed)

    def close(self):
        pass


class OneSided(Base):
    """Ferry and NIXL: the initiator posts, the target only owns memory."""

    def cmd_run(self, wl, secs, warmup, lat_iters):
        if wl["lat"]:
            once = self.blocking(wl)
            latency_loop(once, max(20, lat_iters // 10))
            return lat_stats(latency_loop(once, lat_iters))
        slots = self.slots(wl)
        timed_calls(self.post, self.wait, slots, warmup)
        calls, el = timed_calls(self.post, self.wait, slots, secs)
        return {"gbps": calls * wl["slot"] / el / 1e9, "calls": calls, "seconds": el}

    def cmd_once(self, wl):
        """One call of slot 0 (for the data check)."""
        if wl["lat"]:
            self.blocking(wl)()
        else:
            self.wait(self.post(self.slots(wl)[0]))

    def registered(self, kind, register):
        """Register each memory kind on its own: one refused kind fails only its cells."""
        self.reg_errors = getattr(self, "reg_errors", {})
        out = {}
        refuse = os.environ.get("BENCH_CUDA_IPC_REFUSE", "")  # test hook: "pageable" fails that kind
        for k, m in self.mem.items():
            try:
                if k in refuse.split(","):
                    raise RuntimeError("refused by BENCH_CUDA_IPC_REFUSE (test hook)")
                out[k] = register(m)
            except Exception as e:
                if self.role == "target":
                    raise  # the target has its GPU buffer only
                self.reg_errors[k] = f"{kind}: registering {k} memory failed: {type(e).__name__}: {e}"
                traceback.print_exc()
        return out

    def check_kind(self, wl):
        if wl["mem"] in getattr(self, "reg_errors", {}):
            raise RuntimeError(self.reg_errors[wl["mem"]])

    def slots(self, wl):
        self.check_kind(wl)
        if wl["key"] not in self.prepared:
            offs = np.arange(wl["batch"], dtype=np.uint64) * np.uint64(wl["block"])
            self.prepared[wl["key"]] = [self.prepare(wl, offs + np.uint64(k * wl["slot"]))
                                        for k in range(wl["depth"])]
        return self.prepared[wl["key"]]


class FerryWorker(OneSided):
    def __init__(self, role, cfg):
        super().__init__(role, cfg)
        import ferry
        self.ferry = ferry
        self.engine = ferry.Engine(options=dict(cfg["ferry_options"]) or None)
        self.regions = self.registered("ferry", lambda m: self.engine.register(m.obj))

    def hello(self):
        h = super().hello()
        h.update(version=self.ferry.version(), engine_transports=self.engine.transports(),
                 regions={k: r.kind for k, r in self.regions.items()}, reg_errors=self.reg_errors)
        if self.role == "target":
            h.update(meta=self.engine.metadata(), desc=self.regions["gpu"].advertise(access="rw"))
        return h

    def cmd_connect(self, info):
        self.peer = self.engine.connect(info["meta"])
        self.desc = info["desc"]
        return self.peer.transports()

    # A repeated call is built once (Peer.prepare_write / prepare_read), as NIXL's
    # handle is (initialize_xfer once, transfer() per call); BENCH_FERRY_API=batch
    # measures write_batch / read_batch building every call instead.
    PREPARED = os.environ.get("BENCH_FERRY_API", "prepared") != "batch"

    def prepare(self, wl, offs):
        region = self.regions[wl["mem"]]
        if self.PREPARED:
            make = self.peer.prepare_write if wl["op"] == "write" else self.peer.prepare_read
            return make(region, offs, self.desc, remote_offsets=offs, lengths=wl["block"]).post
        call = self.peer.write_batch if wl["op"] == "write" else self.peer.read_batch
        return functools.partial(call, region, offs, self.desc,
                                 remote_offsets=offs, lengths=wl["block"], async_=True)

    def blocking(self, wl):
        self.check_kind(wl)
        region = self.regions[wl["mem"]]
        offs = np.zeros(1, dtype=np.uint64)
        if self.PREPARED:
            make = self.peer.prepare_write if wl["op"] == "write" else self.peer.prepare_read
            return functools.partial(
                make(region, offs, self.desc, remote_offsets=offs, lengths=wl["block"]).run,
                CALL_TIMEOUT)
        call = self.peer.write_batch if wl["op"] == "write" else self.peer.read_batch
        return functools.partial(call, region, offs, self.desc,
                                 remote_offsets=offs, lengths=wl["block"], timeout=CALL_TIMEOUT)

    @staticmethod
    def post(h):
        return h()

    @staticmethod
    def wait(t):
        t.wait(CALL_TIMEOUT)

    def close(self):
        self.engine.close()


def _version_of(dist):
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


class NixlWorker(OneSided):
    def __init__(self, role, cfg):
        super().__init__(role, cfg)
        from nixl._api import nixl_agent, nixl_agent_config
        # The initiator's polls drive UCX (no progress thread); the idle target keeps one.
        self.agent = nixl_agent(f"{role}-{os.getpid()}",
                                nixl_agent_config(enable_prog_thread=role == "target", backends=["UCX"]))
        if "UCX" not in self.agent.backends:
            raise RuntimeError(f"nixl: no UCX backend (plugins: {self.agent.plugin_list})")
        self.registered("nixl", lambda m: self.agent.register_memory([(m.ptr, m.nbytes, m.nixl_dev, "")],
                                                                      m.nixl_type))

    def hello(self):
        h = super().hello()
        h["version"] = next((f"{d} {v}" for d in ("nixl-cu13", "nixl-cu12", "nixl")
                             if (v := _version_of(d))), "nixl ?")
        h["reg_errors"] = self.reg_errors
        if self.role == "target":
            m = self.mem["gpu"]
            h.update(meta=self.agent.get_agent_metadata(), base=m.ptr, dev=m.nixl_dev, type=m.nixl_type)
        return h

    def cmd_connect(self, info):
        self.remote = self.agent.add_remote_agent(info["meta"])
        self.rbase, self.rdev, self.rtype = info["base"], info["dev"], info["type"]
        return None

    def prepare(self, wl, offs):
        m = self.mem[wl["mem"]]
        n = len(offs)

        def descs(addrs, dev, typ):
            return self.agent.get_xfer_descs(
                np.stack([addrs, np.full(n, wl["block"], dtype=np.uint64),
                          np.full(n, dev, dtype=np.uint64)], axis=1), typ)

        local = descs(np.uint64(m.ptr) + offs, m.nixl_dev, m.nixl_type)
        remote = descs(np.uint64(self.rbase) + offs, self.rdev, self.rtype)
        h = self.agent.initialize_xfer(wl["op"].upper(), local, remote, self.remote)
        if h is None:
            raise RuntimeError("nixl: initialize_xfer failed")
        return h

    def blocking(self, wl):
        self.check_kind(wl)
        h = self.prepare(wl, np.zeros(1, dtype=np.uint64))
        return lambda: self.wait(self.post(h))

    def post(self, h):
        s = self.agent.transfer(h)
        if s == "ERR":
            raise RuntimeError("nixl: transfer() returned ERR")
        return h, s == "DONE"

    def wait(self, tok):
        h, done = tok
        if done:
            return
        deadline = time.monotonic() + CALL_TIMEOUT
        while (s := self.agent.check_xfer_state(h)) == "PROC":  # NIXL has no blocking wait: users poll
            if time.monotonic() > deadline:  # (checked every poll: a clock read costs ~50 ns)
                raise RuntimeError(f"nixl: transfer still in progress after {CALL_TIMEOUT:.0f} s")
        if s != "DONE":
            raise RuntimeError(f"nixl: transfer state {s}")


class _NoEvent:  # --cpu-smoke (gloo): a wait() already returned when the transfer was done
    def record(self):
        pass

    def synchronize(self):
        pass


class NcclWorker(Base):
    """Two-sided: both processes run the same count of calls, one sends, one receives.
    With --cpu-smoke (no GPU) gloo and CPU tensors stand in for NCCL, to exercise the control flow."""

    def __init__(self, role, cfg):
        super().__init__(role, cfg)
        import torch
        import torch.distributed as dist
        self.T, self.dist = torch, dist
        self.gpu = not cfg["smoke"]
        self.rank = 0 if role == "initiator" else 1
        self.other = 1 - self.rank
        kw = dict(backend="nccl" if self.gpu else "gloo", init_method=f"tcp://127.0.0.1:{cfg['nccl_port']}",
                  rank=self.rank, world_size=2)
        if self.gpu:
            try:
                dist.init_process_group(**kw, device_id=torch.device("cuda", self.dev))
            except TypeError:  # torch without device_id
                dist.init_process_group(**kw)
        else:
            dist.init_process_group(**kw)
        self.devstr = f"cuda:{self.dev}" if self.gpu else "cpu"
        self.one = torch.ones(1, device=self.devstr)

    def hello(self):
        h = super().hello()
        if self.gpu:
            try:
                v = self.T.cuda.nccl.version()
                nccl = ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
            except Exception as e:
                nccl = f"? ({e})"
            h["version"] = f"NCCL {nccl} (torch {self.T.__version__})"
        else:
            h["version"] = f"gloo standing in for NCCL (--cpu-smoke; torch {self.T.__version__})"
        return h

    def _cuda_sync(self):
        if self.gpu:
            self.T.cuda.synchronize()

    def _views(self, wl):
        m = self.mem["gpu"]
        t = m.t if m.t is not None else self.T.from_numpy(m.np)
        s = wl["slot"]
        return [t[k * s:(k + 1) * s] for k in range(wl["depth"])]

    def _poster(self, wl, variant):
        key = (wl["key"], variant)
        if key not in self.prepared:
            self.prepared[key] = self._make_poster(wl, variant)
        return self.prepared[key]

    def _make_poster(self, wl, variant):
        dist = self.dist
        sender = (self.role == "initiator") == (wl["op"] == "write")
        fn = dist.isend if sender else dist.irecv
        views = self._views(wl)
        if variant == "blocks":
            b = wl["block"]
            ops = [[dist.P2POp(fn, v[i * b:(i + 1) * b], self.other) for i in range(wl["batch"])]
                   for v in views]
        # How far this rank may run ahead: DEPTH calls; in a blocking-latency run the receiving
        # rank queues its receives far ahead, so that its own host round trip (wait, post again)
        # is not part of the sender's latency.
        window = 64 if wl["lat"] and not sender else len(views)
        events = [self.T.cuda.Event() if self.gpu else _NoEvent() for _ in range(window)]

        def post(i):
            k = i % len(views)
            works = dist.batch_isend_irecv(ops[k]) if variant == "blocks" else [fn(views[k], self.other)]
            for w in works:
                w.wait()  # NCCL: the current stream waits for NCCL's (gloo: the host waits)
            events[i % window].record()
        return post, events

    def _sync(self):
        self.dist.all_reduce(self.one)
        self._cuda_sync()

    def _done(self):
        """The target tells the initiator it has finished: the initiator's clock stops after it."""
        tok = self.T.zeros(1, device=self.devstr)
        if self.role == "target":
            self.dist.send(tok, self.other)
        else:
            self.dist.recv(tok, self.other)
        self._cuda_sync()

    def cmd_run(self, wl, variant, n):
        post, events = self._poster(wl, variant)
        window = len(events)
        lat = wl["lat"] and self.role == "initiator"
        ns = np.empty(n, dtype=np.int64) if lat else None
        clock = time.perf_counter_ns
        self._sync()
        t0 = time.perf_counter()
        for i in range(n):
            e = events[i % window]
            if i >= window:
                e.synchronize()  # at most `window` calls in flight
            if lat:
                t = clock()
                post(i)
                e.synchronize()  # a blocking send: back when NCCL's kernel is done
                ns[i] = clock() - t
            else:
                post(i)
        self._cuda_sync()
        self._done()
        el = time.perf_counter() - t0
        if lat:
            return lat_stats(ns)
        return {"gbps": n * wl["slot"] / el / 1e9, "calls": n, "seconds": el}

    def cmd_once(self, wl, variant):
        post, _ = self._poster(wl, variant)
        self._sync()
        post(0)
        self._cuda_sync()
        self._done()

    def close(self):
        try:
            self.dist.destroy_process_group()
        except Exception:
            pass


class LocalWorker(Base):
    """The references, in one process that sees both GPUs: `gpu` on the initiator's device,
    `tgt` on the target's, pinned and pageable host memory."""

    def _pairs(self, wl, variant):
        key = (wl["key"], variant)
        if key not in self.prepared:
            a, b = self.mem[wl["mem"]], self.mem["tgt"]
            src, dst = (a, b) if wl["op"] == "write" else (b, a)
            s, blk = wl["slot"], wl["block"]
            pairs = []
            for k in range(wl["depth"]):
                if variant == "contig":
                    pairs.append([(self._view(dst, k * s, s), self._view(src, k * s, s))])
                else:
                    pairs.append([(self._view(dst, k * s + i * blk, blk), self._view(src, k * s + i * blk, blk))
                                  for i in range(wl["batch"])])
            self.prepared[key] = pairs
        return self.prepared[key]

    def _view(self, m, off, n):
        return m.t[off:off + n] if self.torch is not None else m.np[off:off + n]

    def _copy_call(self, pairs):
        if self.torch is None:
            def call():
                for d, s in pairs:
                    np.copyto(d, s)
        else:
            def call():
                for d, s in pairs:
                    d.copy_(s, non_blocking=True)
        return call

    def _sync(self):
        if self.torch is not None:
            self.torch.cuda.synchronize(self.cfg["dev_init"])
            self.torch.cuda.synchronize(self.cfg["dev_target"])

    def _bw(self, calls_per_slot, secs):
        calls, t0 = 0, time.perf_counter()
        while calls < len(calls_per_slot) or time.perf_counter() - t0 < secs:
            calls_per_slot[calls % len(calls_per_slot)]()
            calls += 1
        self._sync()
        return calls, time.perf_counter() - t0

    def cmd_run(self, wl, variant, secs, warmup, lat_iters):
        calls_per_slot = [self._copy_call(p) for p in self._pairs(wl, variant)]
        if wl["lat"]:
            c = calls_per_slot[0]

            def once():
                c()
                self._sync()
            latency_loop(once, max(20, lat_iters // 10))
            return lat_stats(latency_loop(once, lat_iters))
        self._bw(calls_per_slot, warmup)
        calls, el = self._bw(calls_per_slot, secs)
        return {"gbps": calls * wl["slot"] / el / 1e9, "calls": calls, "seconds": el}


WORKERS = {"ferry": FerryWorker, "ferry_tcp": FerryWorker, "ferry_1gpu": FerryWorker,
           "nixl": NixlWorker, "nixl_1gpu": NixlWorker, "nccl": NcclWorker,
           "nccl_blocks": NcclWorker, "local": LocalWorker}


def worker_main(group, role, cfg, conn, logpath):
    fd = os.open(logpath, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(cfg["env"])
    os.environ.update(cfg.get("role_env", {}).get(role, {}))  # before CUDA starts: CUDA_VISIBLE_DEVICES
    print(f"[{group}/{role}] pid {os.getpid()} env {cfg['env']} {cfg.get('role_env', {}).get(role, {})}",
          flush=True)
    try:
        w = WORKERS[group](role, cfg)
        conn.send(("ok", w.hello()))
    except BaseException as e:
        traceback.print_exc()
        sys.stdout.flush()
        conn.send(("error", f"{type(e).__name__}: {e}"))
        os._exit(1)
    while True:
        try:
            cmd, args = conn.recv()
        except (EOFError, OSError):
            break
        if cmd == "exit":
            try:
                w.close()
            except Exception:
                traceback.print_exc()
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", getattr(w, "cmd_" + cmd)(*args)))
        except BaseException as e:
            traceback.print_exc()
            sys.stdout.flush()
            conn.send(("error", f"{type(e).__name__}: {e}"))
    sys.stdout.flush()
    sys.stderr.flush()
    # Without library destructors: NIXL 1.5.1's bundled libnl-route crashes in its exit handler.
    os._exit(0)


# --- the orchestrator's side --------------------------------------------------------------
class WorkerDead(Exception):
    pass


class WorkerError(Exception):
    pass


class Worker:
    def __init__(self, group, role, cfg, logdir):
        self.name = f"{group}-{role}"
        self.log = Path(logdir) / f"{self.name}.log"
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=worker_main, args=(group, role, cfg, child, str(self.log)),
                                daemon=True, name=self.name)
        self.proc.start()
        child.close()

    def tail(self, n=4):
        try:
            lines = [l for l in self.log.read_text(errors="replace").splitlines() if l.strip()]
        except OSError:
            return ""
        return " | ".join(lines[-n:])[-600:]

    def _died(self):
        self.proc.join(2)
        code = self.proc.exitcode
        how = ("still running" if code is None else
               f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}")
        return WorkerDead(f"{self.name} {how}; log {self.log}: {self.tail()}")

    def send(self, cmd, *args):
        try:
            self.conn.send((cmd, args))
        except (OSError, BrokenPipeError):
            raise self._died()

    def recv(self, timeout):
        if not self.conn.poll(timeout):
            raise WorkerDead(f"{self.name}: no answer in {timeout:.0f} s (log {self.log}: {self.tail(2)})")
        try:
            tag, val = self.conn.recv()
        except (EOFError, OSError):
            raise self._died()
        if tag == "error":
            raise WorkerError(val)
        return val

    def call(self, cmd, *args, timeout=120):
        self.send(cmd, *args)
        return self.recv(timeout)

    def stop(self):
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=15)
            except Exception:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def recv_all(workers, timeout):
    """The answers of several workers ({role: worker}), in whatever order they come."""
    pending, out = dict(workers), {}
    deadline = time.monotonic() + timeout
    while pending:
        ready = mp_wait([w.conn for w in pending.values()], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise WorkerDead(", ".join(w.name for w in pending.values()) + f": no answer in {timeout:.0f} s ("
                             + "; ".join(f"log {w.log}: {w.tail(2)}" for w in pending.values()) + ")")
        for r, w in list(pending.items()):
            if w.conn in ready:
                del pending[r]
                out[r] = w.recv(0)
    return out


class Group:
    """The processes behind one or more columns: 'initiator' + 'target', or 'local'."""

    def __init__(self, name, roles, cfg, logdir):
        self.name, self.cfg = name, cfg
        self.workers = {r: Worker(name, r, cfg, logdir) for r in roles}
        self.hello, self.dead, self.transports = {}, None, None

    def stop(self):
        for r in ("target", "local", "initiator"):  # the target closes first (peers.py does too)
            if r in self.workers:
                self.workers[r].stop()


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def git(*a):
    return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()


def fmt_size(n):
    return (f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB" if n >= 2**20
            else f"{n / 2**10:.0f} KiB")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-r", "--reps", type=int, default=3, help="repetitions (medians over them)")
    ap.add_argument("--secs", type=float, default=0.6, help="timed seconds per bandwidth cell")
    ap.add_argument("--warmup", type=float, default=0.2, help="warm-up seconds per bandwidth cell")
    ap.add_argument("--lat-iters", type=int, default=2000, help="blocking calls per latency cell")
    ap.add_argument("--quick", action="store_true", help="1 repetition, 0.25 s, 500 latency calls")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="no GPU: host memory in both processes, small shapes, NCCL not run")
    ap.add_argument("--engines", default=",".join(COLUMNS), help="comma list of: " + ", ".join(COLUMNS))
    ap.add_argument("--workloads", default="", help="comma list of workload keys (default: all)")
    ap.add_argument("--gpus", default="", help="INIT,TARGET device indices (default 0,1; 0,0 with one GPU)")
    ap.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--json", default="", help="result file (default RESULTS_DIR/cuda_ipc-DATE-COMMIT.json)")
    ap.add_argument("--plot", default="", help="PNG (default: the JSON path with .png)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the workers' logs (printed path)")
    ap.add_argument("--log-dir", default="", help="the workers' logs go here (default: a fresh temp dir)")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds: start no repetition that would end after this (0: no limit); "
                         "the table then has fewer repetitions, and says so")
    a = ap.parse_args()
    if a.quick:
        a.reps, a.secs, a.warmup, a.lat_iters = 1, 0.25, 0.1, 500
    smoke = a.cpu_smoke
    if smoke and "--lat-iters" not in sys.argv:
        a.lat_iters = 300
    t_start = time.time()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    commit = git("rev-parse", "--short", "HEAD") or os.environ.get("BENCH_COMMIT", "nogit")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", "src", "include", "python"))
    env_info = {"host": platform.node(), "kernel": platform.release(), "nproc": os.cpu_count(),
                "python": platform.python_version(),
                "environment": {k: v for k, v in os.environ.items()
                                if k.startswith(("FERRY_", "UCX_", "NIXL_", "NCCL_", "PYTORCH_CUDA_ALLOC",
                                                 "CUDA_VISIBLE"))}}

    # --- GPUs ---------------------------------------------------------------------------
    not_run = {}
    if smoke:
        dev_init = dev_target = 0
        ngpu, gpu_note = 0, "--cpu-smoke: host memory stands in for GPU memory on both sides"
    else:
        import torch
        ngpu = torch.cuda.device_count()
        if ngpu == 0:
            sys.exit("bench.py: no CUDA device (run with --cpu-smoke on a machine without a GPU)")
        if a.gpus:
            dev_init, dev_target = (int(x) for x in a.gpus.split(","))
        else:
            dev_init, dev_target = (0, 1) if ngpu >= 2 else (0, 0)
        names = [torch.cuda.get_device_name(i) for i in range(ngpu)]
        env_info.update(gpus=names, torch=torch.__version__, cuda=torch.version.cuda)
        if dev_init != dev_target:
            p2p = torch.cuda.can_device_access_peer(dev_init, dev_target)
            gpu_note = (f"initiator on GPU {dev_init}, target on GPU {dev_target} ({names[dev_target]}; "
                        f"peer access {'yes' if p2p else 'NO'})")
        else:
            gpu_note = (f"ONE GPU: initiator and target both on GPU {dev_init} ({names[dev_init]}); "
                        "'copy' is a copy within that GPU, and the floors (defined for GPU 0 -> GPU 1) "
                        "are shown for information only")
        try:
            env_info["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True,
                                                  text=True, timeout=20).stdout
        except Exception as e:
            env_info["topology"] = f"nvidia-smi topo -m: {e}"
    log(gpu_note)

    wls = workloads(smoke)
    if a.workloads:
        keep = set(a.workloads.split(","))
        wls = [w for w in wls if w["key"] in keep]
    cols = [c.strip() for c in a.engines.split(",") if c.strip()]
    for c in cols:
        if c not in COLUMNS:
            sys.exit(f"unknown engine {c!r}; choose from {', '.join(COLUMNS)}")

    # --- buffer sizes per group and role -----------------------------------------------
    def need(pred):
        return max([w["depth"] * w["slot"] for w in wls if pred(w)], default=0)

    init_sizes = {k: need(lambda w, k=k: w["mem"] == k) for k in ("gpu", "pinned", "pageable")}
    init_sizes = {k: v for k, v in init_sizes.items() if v}
    tgt_size = need(lambda w: True)
    sizes = {
        "ferry": {"initiator": init_sizes, "target": {"gpu": tgt_size}},
        "nixl": {"initiator": init_sizes, "target": {"gpu": tgt_size}},
        "nccl": {"initiator": {"gpu": need(lambda w: w["mem"] == "gpu")},
                 "target": {"gpu": need(lambda w: w["mem"] == "gpu")}},
        "local": {"local": {**init_sizes, "tgt": tgt_size}},
    }
    sizes["ferry_tcp"] = sizes["ferry_1gpu"] = sizes["nixl_1gpu"] = sizes["ferry"]
    sizes["nccl_blocks"] = sizes["nccl"]
    log("buffers: initiator " + ", ".join(f"{k} {fmt_size(v)}" for k, v in init_sizes.items()) +
        f"; target GPU {fmt_size(tgt_size)} (per engine pair)")

    quiet = {"NIXL_LOG_LEVEL": "WARN", "UCX_LOG_LEVEL": "warn", "PYTHONUNBUFFERED": "1"}
    # NVLink multicast stays off (the device machines' rule; NCCL's p2p does not need it).
    nccl_env = {**quiet, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
    base_cfg = dict(smoke=smoke, dev_init=dev_init, dev_target=dev_target, env=quiet, ferry_options={})
    group_cfg = {
        "ferry": dict(base_cfg),
        "ferry_tcp": dict(base_cfg, ferry_options={"engine.transports": "tcp"}),
        # UCX_PROTO_INFO=y: UCX prints the protocols it picks (log only; read for the report).
        "nixl": dict(base_cfg, env={**quiet, "UCX_PROTO_INFO": "y"}),
        "nccl": dict(base_cfg, nccl_port=free_port(), env=nccl_env),
        "nccl_blocks": dict(base_cfg, nccl_port=free_port(), env=nccl_env),
        "local": dict(base_cfg),
    }
    # One GPU visible per process: each side's GPU is its device 0.
    one_gpu = dict(dev_init=0, dev_target=0,
                   role_env={"initiator": {"CUDA_VISIBLE_DEVICES": str(dev_init)},
                             "target": {"CUDA_VISIBLE_DEVICES": str(dev_target)}})
    group_cfg["ferry_1gpu"] = dict(group_cfg["ferry"], **one_gpu)
    group_cfg["nixl_1gpu"] = dict(group_cfg["nixl"], **one_gpu)
    for g, c in group_cfg.items():
        c["sizes"] = sizes[g]

    # Which groups are needed, and which cannot run at all.
    import importlib.util
    have_torch = importlib.util.find_spec("torch") is not None
    want_groups = []
    for c in cols:
        g = COLUMNS[c][0]
        if g.startswith("nccl") and smoke and not have_torch:
            not_run[c] = "--cpu-smoke: NCCL needs GPUs (and gloo, its stand-in here, needs torch)"
        elif g.endswith("_1gpu") and (smoke or dev_init == dev_target):
            not_run[c] = "not run: one GPU visible per process needs two GPUs"
        elif g.startswith("nccl") and dev_init == dev_target and not smoke:
            not_run[c] = ("not run: needs 2 GPUs (NCCL cannot send/recv between two ranks on the same "
                          "GPU: ncclInvalidUsage, 'Duplicate GPU detected')")
        elif g not in want_groups:
            want_groups.append(g)

    if a.log_dir:
        logdir = Path(a.log_dir)
        logdir.mkdir(parents=True, exist_ok=True)
        a.keep_logs = True
    else:
        logdir = Path(tempfile.mkdtemp(prefix="ferry-cuda-ipc-"))
    groups = {}
    versions, transports, ucx_protocols = {}, {}, None
    failures, runs = [], []
    status, reps_done, interrupted = 0, 0, False
    try:
        # --- start every group (in parallel), then finish the set-up of each ---------
        for g in want_groups:
            roles = ("local",) if g == "local" else ("target", "initiator")
            groups[g] = Group(g, roles, group_cfg[g], logdir)
        for g, grp in groups.items():
            # a first 4 KiB write of the initiator's first memory kind: can this pair move bytes?
            probe = dict(key="probe", mem=next(iter(init_sizes)), op="write", block=4096, batch=1, depth=1,
                         lat=False, slot=4096)
            try:
                grp.hello = recv_all(grp.workers, 240)
                refused = grp.hello.get("initiator", {}).get("reg_errors") or {}
                for kind, why in refused.items():
                    log(f"{g}: {why} (its cells will fail)")
                ok_kinds = [k for k in init_sizes if k not in refused]
                if not ok_kinds:
                    raise WorkerError("; ".join(refused.values()))
                probe["mem"] = ok_kinds[0]
                if g in ONE_SIDED:
                    grp.transports = grp.workers["initiator"].call("connect", grp.hello["target"])
                    grp.workers["initiator"].call("once", probe, timeout=120)
                elif g.startswith("nccl"):
                    for w in grp.workers.values():
                        w.send("once", dict(probe, mem="gpu"), "message")
                    recv_all(grp.workers, 180)
                h = grp.hello.get("initiator") or grp.hello.get("local")
                versions[g] = h.get("version", "")
                if g.startswith("ferry"):
                    transports[g] = {"engine": [t["name"] for t in h["engine_transports"] if t["running"]],
                                     "peer": grp.transports}
                log(f"{g}: ready ({versions[g] or 'pid ' + str(h['pid'])})")
            except (WorkerDead, WorkerError) as e:
                grp.dead = str(e)
                for c in cols:
                    if COLUMNS[c][0] == g:
                        not_run[c] = str(e)
                log(f"{g}: NOT RUN: {e}")
                grp.stop()

        for g in ("ferry", "ferry_tcp", "ferry_1gpu"):
            if g in transports:
                log(f"{g}: {describe_transports(transports[g])}")

        live = lambda c: c not in not_run and not groups[COLUMNS[c][0]].dead

        # --- the measurements: alternating, order rotated --------------------------------
        calib, failed = {}, set()  # failed: (column, workload) cells not tried again
        t_reps = time.time()
        for rep in range(a.reps):
            if a.budget and rep > 0:
                per_rep = (time.time() - t_reps) / rep
                if time.time() - t_start + per_rep > a.budget:
                    log(f"--budget {a.budget:.0f} s: stopping after {rep} of {a.reps} repetitions "
                        f"({per_rep:.0f} s each)")
                    break
            reps_done = rep + 1
            for wi, wl in enumerate(wls):
                todo = [c for c in cols if applicable(c, wl) and live(c) and (c, wl["key"]) not in failed]
                if not todo:
                    continue
                k = (rep + wi) % len(todo)
                for c in todo[k:] + todo[:k]:
                    g, variant = COLUMNS[c]
                    grp = groups[g]
                    if grp.dead:
                        continue
                    try:
                        res = measure(grp, g, variant, wl, a, calib)
                        bad = verify(grp, g, variant, wl, rep) if (rep == 0 and g in VERIFIED) else None
                    except WorkerError as e:
                        failed.add((c, wl["key"]))
                        failures.append(f"{c} {wl['key']}: {e}")
                        log(f"rep {rep + 1}/{a.reps} {wl['name']} {c}: FAILED {e}")
                        continue
                    except WorkerDead as e:
                        grp.dead = str(e)
                        failures.append(f"{c} {wl['key']}: {e}")
                        log(f"rep {rep + 1}/{a.reps} {wl['name']} {c}: FAILED {e} (no more {g} runs)")
                        grp.stop()
                        continue
                    res.update(engine=c, workload=wl["key"], rep=rep)
                    if bad is not None:
                        res["verify"] = "ok" if bad == 0 else f"FAILED: {bad} of {wl['slot']} bytes differ"
                        if bad:
                            failures.append(f"{c} {wl['key']}: DATA CHECK {res['verify']}")
                            status = 1
                    runs.append(res)
                    val = (f"{res['p50_us']:9.1f} µs p50 {res['p99_us']:9.1f} µs p99" if wl["lat"]
                           else f"{res['gbps']:9.3f} GB/s")
                    log(f"rep {rep + 1}/{a.reps} {wl['name']:40} {c:11} {val}"
                        + (f"  verify {res['verify']}" if "verify" in res else ""))

    except KeyboardInterrupt:
        log("interrupted")
        status = 130
        interrupted = True
    finally:
        for grp in groups.values():
            if not grp.dead:
                grp.stop()
            else:
                for w in grp.workers.values():
                    if w.proc.is_alive():
                        w.proc.kill()

    ucx_protocols = ucx_seen(groups["nixl"]) if "nixl" in groups else None
    if "nixl_1gpu" in groups:
        seen1 = ucx_seen(groups["nixl_1gpu"])
        ucx_protocols = (ucx_protocols or []) + [f"(1 GPU each) {p}" for p in seen1]
    for g, grp in groups.items():
        if grp.dead and not any(COLUMNS[c][0] == g and c in not_run for c in cols):
            for c in cols:
                if COLUMNS[c][0] == g and not any(r["engine"] == c for r in runs):
                    not_run[c] = grp.dead

    # --- medians, table, floors, JSON, plot --------------------------------------------
    med = medians(runs, wls, cols)
    if reps_done != a.reps:
        a.reps_planned, a.reps = a.reps, reps_done
    print(table(wls, cols, med, not_run, a, gpu_note, smoke))
    if getattr(a, "reps_planned", None):
        print(f"(stopped early: {a.reps} of {a.reps_planned} repetitions"
              + (", interrupted" if interrupted else f", --budget {a.budget:.0f} s") + ")")
    print()
    print("versions: " + "; ".join(f"{g}: {v}" for g, v in versions.items() if v))
    for g, t in transports.items():
        print(f"{ {'ferry': 'Ferry', 'ferry_tcp': 'Ferry tcp'}.get(g, 'Ferry-1GPU')}: "
              f"{describe_transports(t)}")
    if ucx_protocols:
        print("NIXL: UCX picked (UCX_PROTO_INFO): " + "; ".join(ucx_protocols))
    for c, why in not_run.items():
        print(f"NOT RUN {c}: {why}")
    for f in failures:
        print(f"FAILED {f}")
    checked = [r for r in runs if "verify" in r]
    if checked and not any(r["verify"] != "ok" for r in checked):
        print(f"data checks: all ok ({len(checked)} cells, one call of random bytes each)")
    fl = floors(med, wls, dev_init != dev_target and not smoke)
    if fl:
        print("\nfloors (issues 11, 26)" + ("" if dev_init != dev_target and not smoke else
                                      " — informational: not GPU 0 → GPU 1") + ":")
        for f in fl:
            print(f"  {f['verdict']:5} {f['what']}: {f['detail']}")

    out = Path(a.json) if a.json else Path(a.results_dir) / (
        f"cuda_ipc-{date}-{commit}{'-smoke' if smoke else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"kind": "cuda_ipc", "date": date, "commit": commit, "dirty_tree": dirty,
              "mode": "cpu-smoke" if smoke else "gpu", "dev_init": dev_init, "dev_target": dev_target,
              "gpu_note": gpu_note, "env": env_info,
              "args": {k: v for k, v in vars(a).items()}, "workloads": wls, "columns": cols,
              "versions": versions, "ferry_transports": transports, "ucx_protocols": ucx_protocols,
              "not_run": not_run, "failures": failures, "floors": fl, "runs": runs,
              "medians": [{"workload": w, "engine": c, **v} for (w, c), v in med.items()],
              "seconds": time.time() - t_start}
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"\nresults: {out}")
    png = Path(a.plot) if a.plot else out.with_suffix(".png")
    try:
        print(plot(result, png))
    except Exception as e:  # a plot never fails the run
        print(f"plot: failed ({type(e).__name__}: {e})")
    if a.keep_logs or failures or not_run:
        print(f"worker logs: {logdir}")
    else:
        shutil.rmtree(logdir, ignore_errors=True)
    print(f"total {time.time() - t_start:.0f} s")
    return status


def measure(grp, g, variant, wl, a, calib):
    """One cell: the result dict of the initiator (or the local process)."""
    if g == "local":
        return grp.workers["local"].call("run", wl, variant, a.secs, a.warmup, a.lat_iters,
                                         timeout=120 + 20 * (a.secs + a.warmup) + a.lat_iters * 0.01)
    if not g.startswith("nccl"):
        return grp.workers["initiator"].call("run", wl, a.secs, a.warmup, a.lat_iters,
                                             timeout=120 + 20 * (a.secs + a.warmup) + a.lat_iters * 0.01)

    def both(n, timeout):
        for w in (grp.workers["target"], grp.workers["initiator"]):
            w.send("run", wl, variant, n)
        try:
            return recv_all(grp.workers, timeout)["initiator"]
        except WorkerError as e:  # the other side may be stuck in NCCL now
            raise WorkerDead(f"nccl: {e}")

    if wl["lat"]:
        both(max(20, a.lat_iters // 10), 300)
        return both(a.lat_iters, 300)
    key = (wl["key"], variant)
    if key not in calib:  # calls per second, from a short run (the second: the first sets NCCL up)
        n0 = 2 * wl["depth"]
        for _ in range(2):
            r = both(n0, 300)
        calib[key] = n0 / r["seconds"]
    rate = calib[key]
    both(max(wl["depth"], int(rate * a.warmup)), 120 + 4 * a.warmup)
    return both(max(2 * wl["depth"], min(1_000_000, int(rate * a.secs))), 120 + 4 * a.secs)


def verify(grp, g, variant, wl, rep):
    """One call on fresh random bytes in slot 0, checked on the receiving side: bytes that differ."""
    ini, tgt = grp.workers["initiator"], grp.workers["target"]
    n, seed = wl["slot"], 1000 + rep + zlib.crc32(wl["key"].encode()) % 1000
    if wl["op"] == "write":
        ini.call("fill", wl["mem"], 0, n, seed, timeout=120)
        tgt.call("zero", "gpu", 0, n, timeout=120)
    else:
        tgt.call("fill", "gpu", 0, n, seed, timeout=120)
        ini.call("zero", wl["mem"], 0, n, timeout=120)
    if g.startswith("nccl"):
        for w in (tgt, ini):
            w.send("once", wl, variant)
        try:
            recv_all(grp.workers, 120)
        except WorkerError as e:
            raise WorkerDead(f"nccl: {e}")
    else:
        ini.call("once", wl, timeout=120)
    return (tgt.call("check", "gpu", 0, n, seed, timeout=120) if wl["op"] == "write"
            else ini.call("check", wl["mem"], 0, n, seed, timeout=120))


def describe_transports(t):
    """'engine runs [...]; GPU memory: cuda_ipc; host memory: shm' from Engine/Peer.transports()."""
    carried = {}
    for x in t["peer"] or []:
        # Route names, comma-separated ("peer GPU memory, local GPU with peer host memory"):
        # "host memory" is the host-to-host route only.
        routes = [r.strip() for r in (x.get("carries") or "").split(",")]
        both = x.get("carries") == "host and GPU memory"
        if both or any("GPU" in r for r in routes):
            carried.setdefault("GPU memory", x["transport"])
        if both or "host memory" in routes:
            carried.setdefault("host memory", x["transport"])
    why = "; ".join(f"{x['transport']}: {x['reason']}" for x in t["peer"] or [] if x.get("reason"))
    return (f"engine runs {t['engine']}; to the peer, GPU memory over {carried.get('GPU memory', 'none reported')}, "
            f"host memory over {carried.get('host memory', 'none reported')}" + (f" ({why})" if why else ""))


def ucx_seen(grp):
    """What UCX picked under NIXL, from the workers' UCX_PROTO_INFO tables:
    ['put from cuda memory to cuda: cuda_ipc/cuda', ...] (operation, memory types: transports)."""
    seen = {}
    for w in grp.workers.values():
        try:
            text = w.log.read_text(errors="replace")
        except OSError:
            continue
        what = None
        for line in text.splitlines():
            if "|" not in line:  # UCX_PROTO_INFO prints tables; skip tracebacks and the rest
                continue
            m = re.search(r"\|\s*([^|]*\bby ucp_\w+\*?[^|]*?)\s*\|", line)
            if m:  # "remote memory write by ucp_put*(multi) from host memory to cuda" -> "put from host ..."
                d = re.sub(r"\([^)]*\)", "", m.group(1))
                what = (re.sub(r"^remote memory (write|read) by ucp_(\w+?)\*? ", r"\2 ", d)
                        if d.startswith("remote memory") else None)
                continue
            for t in re.finditer(r"(?<![\w/.])(cuda_ipc|cuda_copy|gdr_copy|cma|knem|xpmem|sysv|posix|tcp|"
                                 r"rc_mlx5|dc_mlx5|ud_mlx5|rc_verbs|self)/[\w:.-]+", line):
                if what:  # one-sided put/get only (not the active messages of the handshake)
                    seen.setdefault(what, set()).add(t.group(0))
    return [f"{k}: {', '.join(sorted(v))}" for k, v in sorted(seen.items())]


def medians(runs, wls, cols):
    med = {}
    for w in wls:
        for c in cols:
            rs = [r for r in runs if r["workload"] == w["key"] and r["engine"] == c]
            if not rs:
                continue
            if w["lat"]:
                med[w["key"], c] = {"p50_us": statistics.median(r["p50_us"] for r in rs),
                                    "p99_us": statistics.median(r["p99_us"] for r in rs), "n": len(rs)}
            else:
                med[w["key"], c] = {"gbps": statistics.median(r["gbps"] for r in rs), "n": len(rs)}
    return med


def ratio(med, wl, x, y):
    vx, vy = med.get((wl["key"], x)), med.get((wl["key"], y))
    if not vx or not vy:
        return None
    return vx["p50_us"] / vy["p50_us"] if wl["lat"] else vx["gbps"] / vy["gbps"]


def table(wls, cols, med, not_run, a, gpu_note, smoke):
    refs = [r for r in RATIO_REFS if r in cols and r != "Ferry"]
    hdr = ["workload"] + cols + [f"Ferry/{r}" for r in refs]
    rows = []
    for w in wls:
        row = [w["name"]]
        for c in cols:
            v = med.get((w["key"], c))
            if not applicable(c, w):
                row.append("n/a")
            elif v is None:
                row.append("NOT RUN" if c in not_run else "FAILED")
            elif w["lat"]:
                row.append(f"{v['p50_us']:.1f}/{v['p99_us']:.0f}")
            else:
                row.append(f"{v['gbps']:.2f}")
        for r in refs:
            x = ratio(med, w, "Ferry", r) if applicable(r, w) else None
            row.append(f"{x:.2f}" if x is not None else "-")
        rows.append(row)
    wid = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(hdr)]
    fmt = lambda r: "  ".join(c.ljust(wid[i]) if i == 0 else c.rjust(wid[i]) for i, c in enumerate(r))
    lines = [
        "",
        f"Ferry vs references, two processes ({gpu_note}); medians of {a.reps}, "
        f"{a.secs} s per bandwidth cell, {a.lat_iters} blocking calls per latency cell",
        "GB/s = 10^9 B/s of payload; 'blocking' rows: µs p50/p99 per call, Ferry/ref there is the "
        "p50 ratio (lower is better); 4 calls in flight elsewhere."
        + (" CPU SMOKE: host memory everywhere, shapes shrunk." if smoke else "")
        + (" -1GPU columns: each process sees only its own GPU (CUDA_VISIBLE_DEVICES=INIT / =TARGET)."
           if any(c.endswith("-1GPU") for c in cols) else ""),
        fmt(hdr), "  ".join("-" * x for x in wid)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def floors(med, wls, real):
    """Issue 11's floors, evaluated on this run's medians."""
    keys = {w["key"]: w for w in wls}
    out = []

    def add(what, ok, detail):
        out.append({"what": what, "verdict": ("PASS" if ok else "FAIL") if ok is not None else "-",
                    "detail": detail, "binding": real})

    for key, floor, stretch in (("g2g_kv128", 0.90, 0.95), ("g2g_kv298", 0.90, 0.95), ("g2g_4k", 0.40, None)):
        if key not in keys:
            continue
        r = ratio(med, keys[key], "Ferry", "copy")
        add(f"{keys[key]['name']}: Ferry ≥ {floor:.2f} × contiguous copy"
            + (f" (stretch {stretch:.2f})" if stretch else ""),
            None if r is None else r >= floor, "no data" if r is None else f"{r:.3f} × copy")
    if "g2g_lat4k" in keys:
        v = med.get(("g2g_lat4k", "Ferry"))
        add("blocking 4 KiB GPU → GPU write: Ferry p50 ≤ 15 µs", None if v is None else v["p50_us"] <= 15,
            "no data" if v is None else f"{v['p50_us']:.1f} µs p50")
    for key in ("g2g_kv128", "g2g_kv298", "g2g_4k", "g2g_lat4k"):
        if key not in keys:
            continue
        r = ratio(med, keys[key], "Ferry", "NIXL")
        lat = keys[key]["lat"]
        add(f"{keys[key]['name']}: Ferry ahead of NIXL", None if r is None else (r < 1 if lat else r > 1),
            "no data" if r is None else f"Ferry/NIXL {r:.2f}" + (" (µs)" if lat else " (GB/s)"))
    # Issue 26: each process sees only its own GPU.
    one, nixl_one = "Ferry-1GPU", "NIXL-1GPU"
    for key, floor in (("g2g_kv128", 0.90), ("g2g_kv298", 0.90), ("g2g_4k", 0.40)):
        if key not in keys:
            continue
        r = ratio(med, keys[key], one, "copy")
        add(f"{keys[key]['name']}, 1 GPU visible each: Ferry ≥ {floor:.2f} × contiguous copy",
            None if r is None else r >= floor, "no data" if r is None else f"{r:.3f} × copy")
    for key in ("g2g_kv128", "g2g_4k", "g2g_lat4k"):
        if key not in keys:
            continue
        r = ratio(med, keys[key], one, nixl_one)
        lat = keys[key]["lat"]
        add(f"{keys[key]['name']}, 1 GPU visible each: Ferry ahead of NIXL (same launch)",
            None if r is None else (r < 1 if lat else r > 1),
            "no data" if r is None else f"Ferry/NIXL {r:.2f}" + (" (µs)" if lat else " (GB/s)"))
    for key in ("g2g_kv128", "g2g_4k", "g2g_lat4k"):
        if key not in keys:
            continue
        r = ratio(med, keys[key], one, "Ferry")
        if r is not None:
            add(f"{keys[key]['name']}: 1 GPU visible each / both visible (information)", None,
                f"{r:.2f}" + (" (µs)" if keys[key]["lat"] else " (GB/s)"))
    return out


def plot(result, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except Exception as e:
        return f"plot: skipped (matplotlib not available: {e})"
    med = {(m["workload"], m["engine"]): m for m in result["medians"]}
    cols = result["columns"]
    bw = [w for w in result["workloads"] if not w["lat"]]
    lat = [w for w in result["workloads"] if w["lat"]]
    fig, axes = plt.subplots(1, 2, figsize=(16, 6), gridspec_kw={"width_ratios": [max(1, len(bw)), max(1, len(lat))]})
    for ax, ws, field, unit in ((axes[0], bw, "gbps", "GB/s"), (axes[1], lat, "p50_us", "µs p50 (bar), p99 (tick)")):
        n = len(cols)
        width = 0.8 / max(1, n)
        for i, c in enumerate(cols):
            xs = [j + (i - (n - 1) / 2) * width for j in range(len(ws))]
            ys = [med.get((w["key"], c), {}).get(field, 0) or 0 for w in ws]
            ax.bar(xs, ys, width, label=c)
            if field == "p50_us":
                p99 = [med.get((w["key"], c), {}).get("p99_us") for w in ws]
                ax.scatter([x for x, p in zip(xs, p99) if p], [p for p in p99 if p], marker="_", color="k", s=60)
        if not any((med.get((w["key"], c), {}).get(field) or 0) > 0 for w in ws for c in cols):
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            continue
        ax.set_xticks(range(len(ws)))
        ax.set_xticklabels([w["name"].replace(" WRITE", "\nWRITE").replace(" READ", "\nREAD") for w in ws],
                           fontsize=7, rotation=20, ha="right")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylabel(unit)
        ax.grid(axis="y", alpha=0.3, which="both")
    axes[0].set_title("bandwidth (higher is better)")
    axes[1].set_title("blocking latency (lower is better)")
    axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, -0.22), ncol=len(cols), frameon=False)
    fig.suptitle(f"Ferry cuda_ipc benchmark — {result['gpu_note']}\n{result['date']} {result['commit']}"
                 + (" (CPU SMOKE)" if result["mode"] != "gpu" else ""), fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    return f"plot: {png}"


if __name__ == "__main__":
    sys.exit(main())
