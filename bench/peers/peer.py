"""One measurement: an initiator (this process) and a target (a child process)
of one engine, host memory, one-sided WRITE and/or READ with DEPTH calls in
flight. Prints one JSON line per op on stdout. Called by bench.py.

    python peer.py ENGINE --block 65536 --batch 8 --depth 4 --secs 2 --ops write,read
    python peer.py ENGINE --probe      # both sides, 4 KiB each way; prints the version

ENGINE: ferry | nixl | mooncake | memcpy | iperf3 (memcpy: one process, no
target; iperf3: one TCP stream on loopback, `iperf3 -l BLOCK`, its own server).
The environment picks variants (FERRY_ENGINE_TRANSPORTS=tcp, UCX_TLS=tcp;
PEERS_NIXL_PROG_THREAD=1: NIXL's initiator keeps its UCX progress thread).

Placement (bench.py --place netns sets these; unset: both sides on 127.0.0.1):
PEERS_TARGET_PREFIX, a command prefix the target process (and iperf3's server)
is started under, e.g. "ip netns exec ferryabA env UCX_NET_DEVICES=fvabA";
PEERS_TARGET_ADDR and PEERS_INITIATOR_ADDR, the address each side listens on
and advertises (Ferry's listen address, iperf3's server address).

--block and --batch may be comma lists of equal length: the workloads run one
after another in the same pair of processes (one start-up for all of them),
each line then names its block and batch.

Memory: DEPTH slots per side, each BATCH blocks of BLOCK bytes back to back;
call k of the DEPTH in flight moves slot k of the initiator to/from slot k of
the target. After the timed runs the data is checked once per op: random bytes
written are compared by the target, random bytes the target filled are read back.
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

import numpy as np

CTX = mp.get_context("spawn")  # a fresh interpreter: no state shared with the initiator


def address_of(role):
    return os.environ.get("PEERS_TARGET_ADDR" if role == "target" else "PEERS_INITIATOR_ADDR") or "127.0.0.1"


def target_prefix():
    return os.environ.get("PEERS_TARGET_PREFIX", "").split()


def start_targets_under_prefix():
    """Spawned targets start as `PREFIX python ...` (e.g. in another network namespace):
    multiprocessing execs a wrapper script that execs the prefix, which keeps the pipe's
    file descriptors the child is handed."""
    if not target_prefix():
        return
    import shlex
    import tempfile
    with tempfile.NamedTemporaryFile("w", prefix="peers-target-", suffix=".sh", delete=False) as f:
        f.write("#!/bin/sh\nexec " + " ".join(map(shlex.quote, [*target_prefix(), sys.executable]))
                + ' "$@"\n')
    os.chmod(f.name, 0o755)
    CTX.set_executable(f.name)
    return f.name


def version_of(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


# --- engines -----------------------------------------------------------------
# Each class runs on both sides. Target: __init__(buf) registers buf, info()
# is what the initiator needs (picklable). Initiator: __init__(buf),
# connect(info), prepare(op, local_addrs/offsets, remote ones, block) -> a slot
# handle, post(handle) -> token, wait(token) raises on failure.

class Ferry:
    def __init__(self, buf, role):
        import ferry
        # 127.0.0.1 (or PEERS_*_ADDR):<free port>; options from FERRY_* env
        self.engine = ferry.Engine(listen=f"{address_of(role)}:0")
        self.region = self.engine.register(buf)
        self.base = 0  # ferry addresses memory by offsets into the region

    @staticmethod
    def version():
        import ferry
        return ferry.version()

    def info(self):
        return {"meta": self.engine.metadata(), "desc": self.region.advertise(access="rw")}

    def connect(self, info):
        self.peer = self.engine.connect(info["meta"])
        self.desc = info["desc"]
        self.rbase = 0

    def transports(self):  # what the engine runs and what carries host memory (newer builds)
        eng, peer = (getattr(o, "transports", None) for o in (self.engine, self.peer))
        return {"engine": [t["name"] for t in eng() if t["running"]] if eng else None,
                "peer": [t for t in peer() if t["carries"]] if peer else None}

    def prepare(self, op, local, remote, block):
        call = self.peer.write_batch if op == "write" else self.peer.read_batch
        return lambda: call(self.region, local, self.desc, remote_offsets=remote, lengths=block,
                            async_=True)

    def post(self, h):
        return h()

    def wait(self, t):
        t.wait()

    def close(self):
        self.engine.close()


class Nixl:
    def __init__(self, buf, role):
        from nixl._api import nixl_agent, nixl_agent_config
        # NIXL's fastest configuration: the initiator has no progress thread, its
        # polls (check_xfer_state) drive UCX -- no thread competing for the cores.
        # PEERS_NIXL_PROG_THREAD=1 keeps it (NIXL's default), for reference. The
        # target keeps one: over UCX's tcp transport it must receive the bytes.
        prog = role == "target" or os.environ.get("PEERS_NIXL_PROG_THREAD") == "1"
        # On a machine with NVIDIA GPUs NIXL 1.5.1 refuses UCX_TLS=tcp ("does not enable CUDA
        # memory support"); cuda_copy beside it carries no host memory between processes.
        if os.environ.get("UCX_TLS") == "tcp" and os.path.exists("/dev/nvidiactl"):
            os.environ["UCX_TLS"] = "tcp,cuda_copy"
        self.agent = nixl_agent(role, nixl_agent_config(enable_prog_thread=prog, backends=["UCX"]))
        self.agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        self.base = buf.ctypes.data

    @staticmethod
    def version():
        return next((f"{d} {v}" for d in ("nixl-cu13", "nixl-cu12", "nixl")
                     if (v := version_of(d)) != "?"), "nixl ?")

    def info(self):
        return {"meta": self.agent.get_agent_metadata(), "base": self.base}

    def connect(self, info):
        self.remote = self.agent.add_remote_agent(info["meta"])
        self.rbase = info["base"]

    def transports(self):
        return None

    def prepare(self, op, local, remote, block):
        def descs(addrs):  # Nx3: address, length, device id
            return self.agent.get_xfer_descs(
                np.stack([addrs, np.full_like(addrs, block), np.zeros_like(addrs)], axis=1), "DRAM")
        # A handle is posted again and again, one call in flight per handle.
        return self.agent.initialize_xfer(op.upper(), descs(local), descs(remote), self.remote)

    def post(self, h):
        if self.agent.transfer(h) == "ERR":
            raise RuntimeError("nixl: transfer() returned ERR")
        return h

    def wait(self, h):
        while (s := self.agent.check_xfer_state(h)) == "PROC":
            pass  # NIXL has no blocking wait: its users poll
        if s != "DONE":
            raise RuntimeError(f"nixl: transfer state {s}")

    def close(self):
        pass


class Mooncake:
    def __init__(self, buf, role):
        from mooncake.engine import TransferEngine
        self.engine = TransferEngine()
        if self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake: initialize failed")
        if self.engine.register_memory(buf.ctypes.data, buf.nbytes) != 0:
            raise RuntimeError("mooncake: register_memory failed")
        self.base = buf.ctypes.data

    @staticmethod
    def version():
        return "mooncake-transfer-engine-non-cuda " + version_of("mooncake-transfer-engine-non-cuda")

    def info(self):
        return {"segment": f"127.0.0.1:{self.engine.get_rpc_port()}", "base": self.base}

    def connect(self, info):
        self.segment = info["segment"]
        self.rbase = info["base"]

    def transports(self):
        return None

    def prepare(self, op, local, remote, block):
        call = (self.engine.batch_transfer_async_write if op == "write"
                else self.engine.batch_transfer_async_read)
        args = (self.segment, local.tolist(), remote.tolist(), [block] * len(local))
        return lambda: call(*args)

    def post(self, h):
        bid = h()
        if bid == 0 or bid == -1:  # 0: submit failed
            raise RuntimeError("mooncake: batch_transfer_async_* failed to submit")
        return bid

    def wait(self, bid):
        if self.engine.get_batch_transfer_status([bid]) != 0:  # blocks (spins) until done
            raise RuntimeError("mooncake: batch transfer failed")

    def close(self):
        pass


ENGINES = {"ferry": Ferry, "nixl": Nixl, "mooncake": Mooncake}


# --- target process ------------------------------------------------------------
def target_main(kind, size, conn):
    """Owns `size` bytes, sends its info, then answers check/fill commands."""
    try:
        buf = np.ones(size, dtype=np.uint8)  # touched: no page faults during the run
        eng = ENGINES[kind](buf, "target")
        conn.send(("ready", eng.info()))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            cmd, *a = conn.recv()
        except EOFError:
            return
        if cmd == "check":  # offset, nbytes, seed -> how many bytes differ
            off, n, seed = a
            want = np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8)
            conn.send(int(np.count_nonzero(buf[off:off + n] != want)))
        elif cmd == "cpu":  # CPU seconds of this process so far (all its threads)
            conn.send(time.process_time())
        elif cmd == "fill":
            off, n, seed = a
            buf[off:off + n] = np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8)
            conn.send(0)
        else:  # exit
            eng.close()
            conn.send(0)
            os._exit(0)  # see the end of main()


# --- timed loop ------------------------------------------------------------------
def run(eng, slots, secs):
    """Keep len(slots) calls in flight for about `secs`; returns (calls, seconds).
    Time runs from the first post to the last completion (the drain counts)."""
    q = collections.deque((h, eng.post(h)) for h in slots)
    calls, t0 = 0, time.perf_counter()
    deadline = t0 + secs
    while q:
        h, tok = q.popleft()
        eng.wait(tok)
        calls += 1
        if time.perf_counter() < deadline:
            q.append((h, eng.post(h)))
    return calls, time.perf_counter() - t0


def memcpy_run(block, batch, depth, secs, warmup, ops):
    """The same bytes and block layout copied inside one process (numpy copyto of
    a BATCH x BLOCK view per call, slots rotated): the single-copy limit."""
    slot = block * batch
    a = np.ones(depth * slot, dtype=np.uint8)
    b = np.ones(depth * slot, dtype=np.uint8)
    views = [(a[k * slot:(k + 1) * slot].reshape(batch, block),
              b[k * slot:(k + 1) * slot].reshape(batch, block)) for k in range(depth)]
    for op in ops:
        for secs_ in (warmup, secs):
            calls, t0 = 0, time.perf_counter()
            while calls < depth or time.perf_counter() - t0 < secs_:
                dst, src = views[calls % depth] if op == "write" else views[calls % depth][::-1]
                np.copyto(dst, src)
                calls += 1
            el = time.perf_counter() - t0
        ok = np.array_equal(a, b)
        emit(block, batch, {"op": op, "gbps": calls * slot / el / 1e9, "calls": calls, "seconds": el,
                            "verify": "ok" if ok else "FAILED: copies differ"})


def iperf3_run(block, secs, warmup, ops, probe=False):
    """One TCP stream on loopback, iperf3 writing BLOCK bytes per send (at most 1 MiB,
    iperf3's largest): the kernel's
    single-stream limit beside tcp. Its own server on a free port; write: client
    to server, read: -R (server to client). GB/s: bytes received after the first
    `warmup` seconds (--omit) over the timed seconds."""
    import shutil
    import socket
    import subprocess
    exe = shutil.which("iperf3")
    if not exe:
        raise RuntimeError("iperf3 is not installed (Debian package iperf3)")
    if probe:
        v = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.split()
        print(json.dumps({"version": " ".join(v[:2]) or "iperf3", "transports": None}), flush=True)
        return
    host = address_of("target")  # the server: under PEERS_TARGET_PREFIX, on its address
    for op in ops:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))  # a port free here; in a fresh namespace every port is
            port = s.getsockname()[1]
        server = subprocess.Popen([*target_prefix(), exe, "-s", "-1", "-B", host, "-p", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.2)  # the server listens within a few ms; the client retries below
            # iperf3 sends at most 1 MiB per write (its MAX_BLOCKSIZE): larger blocks as 1 MiB.
            cmd = [exe, "-c", host, "-p", str(port), "-l", str(min(block, 1 << 20)), "-J",
                   "-t", str(max(1, round(secs))), "-O", str(max(0, round(warmup + 0.49)))]
            if op == "read":
                cmd.append("-R")
            for _ in range(5):
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=60 + secs + warmup)
                try:
                    res = json.loads(p.stdout or "{}")
                except json.JSONDecodeError:
                    raise RuntimeError(f"iperf3 exit {p.returncode}: {p.stdout[-200:]} {p.stderr[-200:]}")
                if "unable to connect" not in res.get("error", ""):
                    break
                time.sleep(0.2)
            if "error" in res:
                raise RuntimeError(f"iperf3: {res['error']}")
            end = res["end"]["sum_received"]
            emit(block, 1, {"op": op, "gbps": end["bits_per_second"] / 8 / 1e9,
                            "calls": None, "seconds": end["seconds"], "verify": "ok"})
        finally:
            if server.poll() is None:
                server.kill()
            server.wait()


def emit(block, batch, row):
    print(json.dumps({"block": block, "batch": batch, **row}), flush=True)


def measure():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", choices=[*ENGINES, "memcpy", "iperf3"])
    ap.add_argument("--block", default="65536", help="bytes per block (a comma list: several workloads)")
    ap.add_argument("--batch", default="8", help="blocks per call (a comma list, as many as --block)")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--secs", type=float, default=2.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--ops", default="write,read")
    ap.add_argument("--probe", action="store_true", help="import, create an engine, print its version")
    args = ap.parse_args()
    ops = args.ops.split(",")
    blocks = [int(x) for x in args.block.split(",")]
    batches = [int(x) for x in args.batch.split(",")]
    if len(blocks) != len(batches):
        sys.exit("--block and --batch need as many entries")
    workloads = list(zip(blocks, batches))
    if args.engine == "memcpy":
        if args.probe:
            print(json.dumps({"version": "numpy " + np.__version__}))
            return
        for block, batch in workloads:
            memcpy_run(block, batch, args.depth, args.secs, args.warmup, ops)
        return
    if args.engine == "iperf3":
        if args.probe:
            return iperf3_run(0, 0, 0, ops, probe=True)
        for block, _ in workloads:
            iperf3_run(block, args.secs, args.warmup, ops)
        return

    cls = ENGINES[args.engine]
    if args.probe:  # the engine on both sides, on a small buffer
        workloads = [(4096, 1)]
        args.depth = 1
    size = max(block * batch for block, batch in workloads) * args.depth
    wrapper = start_targets_under_prefix()
    conn, child = CTX.Pipe()
    proc = CTX.Process(target=target_main, args=(args.engine, size, child), daemon=True)
    proc.start()
    child.close()
    try:
        if not conn.poll(120):
            sys.exit("target did not start in 120 s")
        tag, info = conn.recv()
        if wrapper:  # the target runs: its wrapper is read (a driver killed later leaves none)
            os.unlink(wrapper)
            wrapper = None
        if tag != "ready":
            sys.exit(f"target: {info}")
        buf = np.ones(size, dtype=np.uint8)
        eng = cls(buf, "initiator")
        eng.connect(info)
        for wi, (block, batch) in enumerate(workloads):
            slot = block * batch
            offs = np.arange(batch, dtype=np.uint64) * np.uint64(block)
            slots = {op: [eng.prepare(op, np.uint64(eng.base + k * slot) + offs,
                                      np.uint64(eng.rbase + k * slot) + offs, block)
                          for k in range(args.depth)] for op in ops}
            if args.probe:
                for op in ops:
                    run(eng, slots[op], 0)
                print(json.dumps({"version": cls.version(), "transports": eng.transports()}), flush=True)
                return
            for i, op in enumerate(ops):
                run(eng, slots[op], args.warmup)
                conn.send(("cpu",))
                cpu0 = time.process_time() + conn.recv()
                calls, el = run(eng, slots[op], args.secs)
                conn.send(("cpu",))
                cpu = time.process_time() + conn.recv() - cpu0  # both processes, every thread
                # Check outside the timed loop: fresh random bytes in slot 0, one call.
                seed = 1000 + 10 * wi + i
                rnd = np.frombuffer(np.random.default_rng(seed).bytes(slot), dtype=np.uint8)
                if op == "write":
                    buf[:slot] = rnd
                    eng.wait(eng.post(slots[op][0]))
                    conn.send(("check", 0, slot, seed))
                    bad = conn.recv()
                else:
                    conn.send(("fill", 0, slot, seed))
                    conn.recv()
                    buf[:slot] = 0
                    eng.wait(eng.post(slots[op][0]))
                    bad = int(np.count_nonzero(buf[:slot] != rnd))
                emit(block, batch, {"op": op, "gbps": calls * slot / el / 1e9, "calls": calls,
                                    "seconds": el, "cpu_seconds": cpu,
                                    "cpu_s_per_gb": cpu / (calls * slot / 1e9),
                                    "verify": "ok" if bad == 0 else f"FAILED: {bad} of {slot} bytes differ",
                                    "transports": eng.transports()})
    finally:
        try:  # the target closes its engine first: ours may still have its connection
            conn.send(("exit",))
            conn.poll(10)
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        if wrapper:
            os.unlink(wrapper)


def main():
    code = 0
    try:
        measure()
    except SystemExit as e:
        if e.code not in (None, 0):
            print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    # Leave without running library destructors: NIXL 1.5.1's bundled libnl-route
    # crashes in its exit handler (SIGSEGV in rtnl_tc_unregister) after all work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
