"""One NIXL-API program, run over real NIXL and over Ferry (ferry.compat.nixl via the
`nixl` shim), alternately in one invocation: host memory, two processes on this
host, WRITEs through prepared handles (prep_xfer_dlist + make_prepped_xfer,
reposted), `--inflight` requests in flight, and a blocking 4 KiB WRITE for
latency. Prints a table (GB/s = 1e9 payload bytes/s; latency p50/p99 in us) with
the ratio Ferry / NIXL, and --json.

    python bench/nixl/nixl_api_bench.py --nixl-python /path/venv-with-nixl/bin/python \
        --ferry-python .venv/bin/python [--rounds 3] [--json out.json]
    python bench/nixl/nixl_api_bench.py --nixl-python ... --systems nixl,plugin \
        --plugin-dir build/nixl_plugins     # NIXL's agent on UCX vs on libplugin_FERRY.so
    ... --systems nixl,plugin,plugin-nopoll,plugin-staging,plugin-staging-nopoll
        # the plugin with shm's small-request polling on (default) and off, in both
        # shm modes; "plugin@FERRY_X=1:FERRY_Y=2" sets any Ferry options for a row
    ... --systems nixl,plugin,plugin-ring,plugin-ring256,plugin-staging,plugin-staging-ring
        # shm's request ring (shm.request_ring) on and off, in both modes
    ... --systems "nixl,ferry,ferry@FERRY_SHM_REQUEST_RING=true"
        # ferry.compat.nixl with and without an option (no plugin needed)
    ... --place netns   # target and initiator in two network namespaces (a veth
        # between them), both systems over tcp, as between two hosts (root)
    ... --mem vram [--gpus both|one-each] --systems nixl,ferry
        # GPU 0 -> GPU 1 on one host: the initiator's source a torch tensor on GPU 0,
        # the target's arena one on GPU 1, registered and described as VRAM; both
        # processes see both GPUs (both), or each only its own (one-each:
        # CUDA_VISIBLE_DEVICES=0 / =1, each on its cuda:0, device id 0 on both sides)

The initiator runs NIXL's fastest configuration: nixl_agent_config(
enable_prog_thread=False) (it then progresses in the caller's polls); the target
keeps the default. Under Ferry both options are accepted and have no effect.
UCX_TLS is left to the environment (unset: UCX picks cuda_ipc for GPU memory)
except under --place netns. After each workload (outside the timing) the target
compares the slot of the workload's last transfer with the initiator's random
source (GPU memory through a copy to the host; the other slots hold the source
or, never written, zeros), then zeroes them; --no-verify skips it.
The same file is the worker: --role target|initiator (started by the harness).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import netns  # noqa: E402  (bench/netns.py: two network namespaces and their veth pair)

WORKLOADS = [  # (name, block bytes, blocks per call)
    ("4 KiB x 64", 4096, 64),
    ("64 KiB x 64", 65536, 64),
    ("1,179,648 B x 32 (KV page)", 1179648, 32),
]
LAT_BLOCK = 4096


def _wait_file(path: str, timeout: float = 60.0) -> bytes:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path + ".done"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} within {timeout} s")
        time.sleep(0.01)
    with open(path, "rb") as f:
        return f.read()


def _publish(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
    open(path + ".done", "w").close()


def _backend() -> str:
    """The NIXL backend the workers ask for: UCX, or FERRY (the plugin) in the
    'plugin' system, which sets NIXL_BENCH_BACKEND and NIXL_PLUGIN_DIR."""
    return os.environ.get("NIXL_BENCH_BACKEND", "UCX")


def _arena_bytes(inflight: int) -> int:
    return max(b * n for _, b, n in WORKLOADS) * max(inflight, 1)


def _source(nbytes: int):
    """The initiator's bytes (random, the same in every process: the target checks
    against them)."""
    import numpy as np
    return np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)


def _torch_device(args, role: str):
    """torch and the CUDA device index of this side under --mem vram: the
    initiator on GPU 0, the target on GPU 1; with --gpus one-each each process
    sees only its own GPU, its cuda:0. Exits saying what is missing when torch
    or the GPUs are not there."""
    try:
        import torch
    except ImportError as e:
        raise SystemExit(f"--mem vram: {sys.executable} cannot import torch ({e}); install "
                         "torch with CUDA for this interpreter") from None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not torch.cuda.is_available():
        raise SystemExit(f"--mem vram: torch {torch.__version__} in {sys.executable} has no CUDA "
                         f"(built for CUDA {torch.version.cuda}, "
                         f"CUDA_VISIBLE_DEVICES={visible!r}): no GPU or no driver here")
    dev = 1 if role == "target" and args.gpus == "both" else 0
    if torch.cuda.device_count() <= dev:
        raise SystemExit(f"--mem vram --gpus {args.gpus}: the {role} needs cuda:{dev}, torch in "
                         f"{sys.executable} sees {torch.cuda.device_count()} GPU(s) "
                         f"(CUDA_VISIBLE_DEVICES={visible!r}); --gpus both needs two")
    torch.cuda.set_device(dev)
    return torch, dev


class Arena:
    """One side's memory: host memory (numpy), or under --mem vram a torch tensor
    on the side's GPU; `kind` and `dev` as NIXL's descriptors name them."""

    def __init__(self, args, role: str, data=None):
        import numpy as np
        self.nbytes = _arena_bytes(args.inflight)
        self.torch = None
        if args.mem == "vram":
            self.torch, self.dev = _torch_device(args, role)
            device = f"cuda:{self.dev}"
            self.obj = (self.torch.from_numpy(data).to(device) if data is not None
                        else self.torch.zeros(self.nbytes, dtype=self.torch.uint8, device=device))
            self.torch.cuda.synchronize(self.dev)
            self.addr, self.kind = self.obj.data_ptr(), "VRAM"
        else:
            self.obj = data if data is not None else np.zeros(self.nbytes, np.uint8)
            self.addr, self.kind, self.dev = self.obj.ctypes.data, "DRAM", 0

    def register(self, agent) -> None:
        if self.torch is not None:  # NIXL takes the tensor: VRAM, on the tensor's device
            agent.register_memory(self.obj)
        else:
            agent.register_memory([(self.addr, self.nbytes, 0, "")], "DRAM")

    def check(self, size: int, slots: int, last: int, want) -> list:
        """Slots [0, slots) of `size` bytes against want (GPU memory copied to the
        host): the slot of the last transfer must hold want's bytes, every other
        one want's or only zeros (not written: a request that completes at once is
        reposted at once). [slot, wrong bytes] of each slot that fails."""
        import numpy as np
        got = self.obj[:size * slots]
        if self.torch is not None:
            got = got.cpu().numpy()
        failed = []
        for s in range(slots):
            g = got[s * size:(s + 1) * size]
            bad = int(np.count_nonzero(g != want[s * size:(s + 1) * size]))
            if bad and (s == last or np.count_nonzero(g)):
                failed.append([s, bad])
        return failed

    def zero(self, off: int, n: int) -> None:
        if self.torch is not None:
            self.obj[off:off + n].zero_()
            self.torch.cuda.synchronize(self.dev)  # done before the next workload writes
        else:
            self.obj[off:off + n] = 0


def target(args) -> None:
    arena = Arena(args, "target")  # torch (vram) before nixl: NIXL recognises its tensors
    from nixl._api import nixl_agent, nixl_agent_config
    agent = nixl_agent("bench-target", nixl_agent_config(backends=[_backend()]))
    arena.register(agent)
    _publish(os.path.join(args.dir, "target.md"), agent.get_agent_metadata())
    _publish(os.path.join(args.dir, "target.addr"), str(arena.addr).encode())
    _publish(os.path.join(args.dir, "target.dev"), str(arena.dev).encode())
    want, k = None, 0
    while True:
        for msgs in agent.get_new_notifs().values():
            if b"bench-done" in msgs:
                return
        check = os.path.join(args.dir, f"check-{k}")
        if os.path.exists(check + ".done"):  # the initiator's workload k finished: its bytes
            size, slots, last = json.loads(_wait_file(check))
            if want is None:
                want = _source(arena.nbytes)
            failed = arena.check(size, slots, last, want)
            arena.zero(0, size * slots)  # the next workload's bytes are its own
            _publish(os.path.join(args.dir, f"checked-{k}"), json.dumps(failed).encode())
            k += 1
            continue
        time.sleep(0.001)


class NixlApi:
    """The program under test: NIXL's API (real NIXL, or Ferry through the shim)."""

    def __init__(self, args, arena):
        from nixl._api import nixl_agent, nixl_agent_config
        self.agent = nixl_agent("bench-initiator", nixl_agent_config(enable_prog_thread=False,
                                                                     backends=[_backend()]))
        arena.register(self.agent)
        self.name = self.agent.add_remote_agent(_wait_file(os.path.join(args.dir, "target.md")))
        self.remote_base = int(_wait_file(os.path.join(args.dir, "target.addr")))
        self.remote_dev = int(_wait_file(os.path.join(args.dir, "target.dev")))
        self.arena = arena

    def prepare(self, block, count, slot):
        """One request: `count` blocks of `block` bytes in arena slot `slot`; rows
        (address, length, device id) of the memory type both sides registered."""
        a, m = self.agent, self.arena
        base = slot * block * count
        rows = [(m.addr + base + i * block, block, m.dev) for i in range(count)]
        rrows = [(self.remote_base + base + i * block, block, self.remote_dev)
                 for i in range(count)]
        lside = a.prep_xfer_dlist("NIXL_INIT_AGENT", a.get_xfer_descs(rows, m.kind))
        rside = a.prep_xfer_dlist(self.name, a.get_xfer_descs(rrows, m.kind))
        idx = list(range(count))
        return a.make_prepped_xfer("WRITE", lside, idx, rside, idx), (lside, rside)

    def post(self, req) -> bool:
        return self.agent.transfer(req[0]) == "DONE"

    def done(self, req) -> bool:
        return self.agent.check_xfer_state(req[0]) == "DONE"

    def release(self, req) -> None:
        self.agent.release_xfer_handle(req[0])
        for d in req[1]:
            self.agent.release_dlist_handle(d)

    def close(self) -> None:
        self.agent.send_notif(self.name, b"bench-done")


class FerryApi:
    """The same requests through Ferry's own Python API (prepare_write, post,
    Transfer.done): what the NIXL layer costs on top of it."""

    def __init__(self, args, arena):
        import ferry
        from ferry.compat.nixl import _metadata
        md = _metadata.decode(_wait_file(os.path.join(args.dir, "target.md")))
        self.remote_base = int(_wait_file(os.path.join(args.dir, "target.addr")))
        self.region_desc = {r.address: r.handle for r in md.regions}[self.remote_base]
        self.engine = ferry.Engine("0.0.0.0:0")
        self.region = self.engine.register(arena.obj)  # a numpy array or a CUDA tensor
        self.peer = self.engine.connect(md.engine)
        self.frame = b"FNX1" + struct.pack("<H", 15) + b"bench-initiator"

    def prepare(self, block, count, slot):
        import numpy as np
        offs = slot * block * count + block * np.arange(count, dtype=np.uint64)
        return [self.peer.prepare_write(self.region, offs, self.region_desc, remote_offsets=offs,
                                        lengths=block), None]

    def post(self, req) -> bool:
        req[1] = req[0].post()
        return req[1].done()

    def done(self, req) -> bool:
        return req[1].done()

    def release(self, req) -> None:
        pass

    def close(self) -> None:
        self.peer.notify(self.frame + b"bench-done")  # the target is a NIXL-API agent


def verify(args, k: int, what: str, size: int, slots: int, last: int) -> None:
    """Asks the target to check the workload's arena slots against the source,
    `last` the slot of its last transfer (check-k), and waits for its answer
    (checked-k); outside the timing."""
    if args.no_verify:
        return
    _publish(os.path.join(args.dir, f"check-{k}"), json.dumps([size, slots, last]).encode())
    failed = json.loads(_wait_file(os.path.join(args.dir, f"checked-{k}"), timeout=300))
    if failed:
        raise SystemExit(f"verify: {what} ({args.mem}, api {args.api}): wrong bytes on the target, "
                         f"[slot, of its {size}]: {failed} (the last transfer's slot: {last})")


def initiator(args) -> None:
    arena = Arena(args, "initiator", _source(_arena_bytes(args.inflight)))
    api = (FerryApi if args.api == "ferry" else NixlApi)(args, arena)
    out = {}
    for k, (wname, block, count) in enumerate(WORKLOADS):
        reqs = [api.prepare(block, count, s) for s in range(args.inflight)]
        calls = max(8, min(2000, int(args.bytes_per_point // (block * count))))
        for n in (4, calls):  # a warm-up, then the measured run
            t0 = time.perf_counter()
            posted = 0
            free, live = list(reqs), []
            while posted < n or live:
                while posted < n and free:  # repost only a request that completed
                    # lifo: the request that completed last (a system whose post
                    # completes at once reposts one request, one arena slot,
                    # whose bytes stay in cache); fifo: the one that completed
                    # first, so every system cycles through all slots.
                    req = free.pop(-1 if args.slot_order == "lifo" else 0)
                    (free if api.post(req) else live).append(req)
                    posted += 1
                still = []
                for r in live:
                    (free if api.done(r) else still).append(r)
                live = still
            dt = time.perf_counter() - t0
        out[wname] = calls * block * count / dt / 1e9
        last = next(s for s, r in enumerate(reqs) if r is req)  # the slot posted last
        for req in reqs:
            api.release(req)
        verify(args, k, wname, block * count, args.inflight, last)
    req = api.prepare(LAT_BLOCK, 1, 0)
    samples = []
    for i in range(args.lat_iters + 50):
        t0 = time.perf_counter_ns()
        if not api.post(req):
            while not api.done(req):
                pass
        if i >= 50:
            samples.append((time.perf_counter_ns() - t0) / 1000)
    samples.sort()
    out["lat_p50_us"] = samples[len(samples) // 2]
    out["lat_p99_us"] = samples[int(len(samples) * 0.99)]
    verify(args, len(WORKLOADS), "blocking 4 KiB WRITE", LAT_BLOCK, 1, 0)
    api.close()
    print("RESULT " + json.dumps(out), flush=True)


def place_of(args, side: int) -> tuple[list, dict]:
    """Command prefix and environment of one side (netns.TARGET / netns.INITIATOR).
    --place netns: the side runs in its network namespace, as on a host of its own,
    and both systems keep to the network: NIXL's UCX to tcp on the veth
    (UCX_TLS=tcp, UCX_NET_DEVICES), Ferry to tcp on the veth's address
    (FERRY_ENGINE_TRANSPORTS=tcp, FERRY_NIXL_LISTEN), so neither takes a same-host
    path that two hosts would not have. On a machine with NVIDIA GPUs NIXL refuses
    UCX_TLS=tcp alone ("does not enable CUDA memory support"): there cuda_copy is
    added, which moves no host memory between processes."""
    if args.place != "netns":
        return [], {}
    tls = "tcp,cuda_copy" if os.path.exists("/dev/nvidia0") else "tcp"
    return netns.prefix("netns", side), {
        "UCX_TLS": tls, "UCX_NET_DEVICES": netns.VETH[side],
        "FERRY_ENGINE_TRANSPORTS": "tcp", "FERRY_NIXL_LISTEN": f"{netns.ADDR[side]}:0"}


def gpus_of(args, side: int) -> dict:
    """CUDA_VISIBLE_DEVICES of one side: --gpus one-each shows the initiator only
    GPU 0 and the target only GPU 1 (of those this process sees), as serving
    stacks launch their workers; otherwise the environment is left as it is."""
    if args.mem != "vram" or args.gpus != "one-each":
        return {}
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in seen.split(",") if x.strip()] if seen else ["0", "1"]
    if len(ids) < 2:
        raise SystemExit(f"--gpus one-each: CUDA_VISIBLE_DEVICES={seen!r} names fewer than "
                         "two GPUs")
    return {"CUDA_VISIBLE_DEVICES": ids[0] if side == netns.INITIATOR else ids[1]}


def worker_args(args, d: str) -> list:
    return ["--dir", d, "--inflight", str(args.inflight), "--lat-iters", str(args.lat_iters),
            "--bytes-per-point", str(args.bytes_per_point), "--mem", args.mem,
            "--slot-order", args.slot_order] \
        + (["--gpus", args.gpus] if args.mem == "vram" else []) \
        + (["--no-verify"] if args.no_verify else [])


def check_gpus(args, systems) -> None:
    """--mem vram: every interpreter the systems run (with its environment)
    imports torch and sees the GPUs each side needs, or the run stops here,
    saying what is missing. Prints what the initiator's interpreter found."""
    if args.mem != "vram":
        return
    me, seen = os.path.abspath(__file__), set()
    for python, env_extra, _ in systems:
        key = (python, env_extra.get("PYTHONPATH"))
        if key in seen:
            continue
        seen.add(key)
        # --gpus both: one look (the target's cuda:1 needs both GPUs); one-each: each side.
        roles = ["target"] if args.gpus == "both" else ["initiator", "target"]
        for role in roles:
            side = netns.TARGET if role == "target" else netns.INITIATOR
            res = subprocess.run([python, me, "--role", "gpu-check", "--side", role]
                                 + worker_args(args, "."),
                                 env=dict(os.environ, **env_extra, **gpus_of(args, side)),
                                 capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                lines = ((res.stderr or res.stdout).strip().splitlines()
                         or [f"exit {res.returncode}"])
                raise SystemExit(lines[-1] if lines[-1].startswith("--mem") else
                                 f"--mem vram: {python} cannot run the {role} on its GPU:\n"
                                 + "\n".join(lines[-15:]))
            if len(seen) == 1:
                print(res.stdout.strip())


def gpu_check(args) -> None:
    torch, dev = _torch_device(args, args.side)
    print(f"{args.side}: cuda:{dev} = {torch.cuda.get_device_name(dev)} "
          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, "
          f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s) visible)")


def run_once(python: str, env_extra: dict, api: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="nixl-bench-") as d:
        env = dict(os.environ, **env_extra)
        me = os.path.abspath(__file__)
        common = worker_args(args, d)
        t_prefix, t_env = place_of(args, netns.TARGET)
        i_prefix, i_env = place_of(args, netns.INITIATOR)
        t_env.update(gpus_of(args, netns.TARGET))
        i_env.update(gpus_of(args, netns.INITIATOR))
        t_log = open(os.path.join(d, "target.log"), "w")
        t = subprocess.Popen(t_prefix + [python, me, "--role", "target"] + common,
                             env=dict(env, **t_env), stdout=subprocess.DEVNULL,
                             stderr=t_log)
        try:
            res = subprocess.run(i_prefix + [python, me, "--role", "initiator", "--api", api]
                                 + common, env=dict(env, **i_env), capture_output=True, text=True,
                                 timeout=600)
            if res.returncode != 0 and "RESULT " in res.stdout:
                # NIXL 1.5.1's agent can crash in its destructor at exit (SIGSEGV)
                # after the run finished; the measurement stands, the crash is noted.
                print(f"note: {python} initiator exited {res.returncode} after its result",
                      file=sys.stderr)
            elif res.returncode != 0:
                t_log.flush()
                with open(os.path.join(d, "target.log")) as f:
                    t_tail = f.read()[-2000:]
                raise RuntimeError(f"initiator failed ({python}, exit {res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
                                   + (f"\ntarget's stderr:\n{t_tail}" if t_tail else ""))
            t.wait(30)
        finally:
            if t.poll() is None:
                t.kill()
            t_log.close()
        line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
        return json.loads(line[len("RESULT "):])


def ferry_shim_env(args) -> dict:
    """The environment under which `import nixl` is ferry.compat.nixl: a folder
    holding the shim (ferry.compat.nixl.shim) first on PYTHONPATH."""
    shim = tempfile.mkdtemp(prefix="ferry-nixl-shim-")
    # FERRY_PYTHONPATH: a build's package folder, when ferry is not installed.
    ferry_env = {"PYTHONPATH": os.pathsep.join(p for p in (shim, os.environ.get(
        "FERRY_PYTHONPATH"), os.environ.get("PYTHONPATH")) if p)}
    subprocess.run([args.ferry_python, "-m", "ferry.compat.nixl.shim", shim], check=True,
                   capture_output=True, env=dict(os.environ, **ferry_env))
    return ferry_env


def print_place(args) -> None:
    if args.place == "netns":
        print(f"target in network namespace {netns.NS[0]}, initiator in {netns.NS[1]}, a veth "
              "between them; NIXL with UCX_TLS=tcp, Ferry with FERRY_ENGINE_TRANSPORTS=tcp")
    if args.mem == "vram":
        if args.gpus == "both":
            how = "both processes see both GPUs: the initiator on cuda:0, the target on cuda:1"
        else:
            i, t = (gpus_of(args, side)["CUDA_VISIBLE_DEVICES"]
                    for side in (netns.INITIATOR, netns.TARGET))
            how = (f"each process sees only its own GPU (initiator CUDA_VISIBLE_DEVICES={i}, "
                   f"target ={t}), its cuda:0: device id 0 in both sides' descriptors")
        tls = os.environ.get("UCX_TLS")
        print(f"GPU memory (VRAM), GPU 0 -> GPU 1; {how}; UCX_TLS "
              + (f"={tls} from the environment" if tls else "unset (UCX picks, cuda_ipc)"))


def memory_of(args) -> str:
    """What the rows move (and, with --slot-order fifo, how), for the table's header."""
    order = ", slots fifo" if args.slot_order == "fifo" else ""
    if args.mem == "dram":
        return "host memory" + order
    return "GPU 0 -> GPU 1, " + ("both GPUs visible" if args.gpus == "both" else
                                 "one GPU each") + order


def write_json(args, runs, med) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rounds": runs, "median": med, "inflight": args.inflight, "mem": args.mem,
                       "gpus": args.gpus, "place": args.place, "verified": not args.no_verify,
                   "slot_order": args.slot_order},
                      f, indent=1)


def harness(args) -> None:
    print_place(args)
    if args.systems != "nixl,ferry,ferry-native":
        return harness_of(args, args.systems.split(","))
    ferry_env = ferry_shim_env(args)
    nixl_env = {"PYTHONPATH": os.environ.get("NIXL_PYTHONPATH", "")}
    systems = {"nixl": (args.nixl_python, nixl_env, "nixl"),
               "ferry": (args.ferry_python, ferry_env, "nixl"),
               "ferry-native": (args.ferry_python, ferry_env, "ferry")}
    check_gpus(args, systems.values())
    runs = {k: [] for k in systems}
    order = list(systems)
    for r in range(args.rounds):  # alternate: the machine's slow spells hit every system
        for which in (order if r % 2 == 0 else order[::-1]):
            py, env, api = systems[which]
            runs[which].append(run_once(py, env, api, args))
            print(f"round {r + 1} {which}: {runs[which][-1]}", file=sys.stderr, flush=True)
    shutil.rmtree(ferry_env["PYTHONPATH"].split(os.pathsep)[0], ignore_errors=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
    first = f"workload (WRITE, {memory_of(args)}, {args.inflight} in flight)"
    w = max(42, len(first))
    print(f"{first:<{w}}"
          f"{'NIXL (UCX)':>11}{'Ferry':>9}{'Ferry/NIXL':>11}{'Ferry API':>11}{'layer':>8}")
    for wname, _, _ in WORKLOADS:
        n, f, fn = (med[k][wname] for k in ("nixl", "ferry", "ferry-native"))
        print(f"{wname + ' GB/s':<{w}}{n:>11.3f}{f:>9.3f}{f / n:>11.2f}{fn:>11.3f}{f / fn:>8.2f}")
    for m in ("lat_p50_us", "lat_p99_us"):
        n, f, fn = (med[k][m] for k in ("nixl", "ferry", "ferry-native"))
        print(f"{'blocking 4 KiB WRITE ' + m[4:7] + ' us':<{w}}{n:>11.1f}{f:>9.1f}{n / f:>11.2f}"
              f"{fn:>11.1f}{fn / f:>8.2f}")
    print(f"(medians of {args.rounds} alternating rounds; 'Ferry' runs the NIXL-API program on "
          "ferry.compat.nixl, 'Ferry API' the same requests through Ferry's own Python API; "
          "ratios > 1 favour the first named; latency ratios are inverted so that > 1 = faster)")
    write_json(args, runs, med)


def harness_of(args, names) -> None:
    """Any of the systems, side by side against the first: 'nixl' (NIXL on UCX) and
    'plugin' (NIXL's own agent on libplugin_FERRY.so, --plugin-dir) need only
    --nixl-python; 'ferry' and 'ferry-native' are the default harness's."""
    nixl_env = {"PYTHONPATH": os.environ.get("NIXL_PYTHONPATH", "")}
    plugin_env = dict(nixl_env, NIXL_BENCH_BACKEND="FERRY",
                      NIXL_PLUGIN_DIR=os.path.abspath(args.plugin_dir))
    # The same plugin with shm's small-request polling off (the waiting caller
    # leaves the socket to the I/O thread, which sleeps at once): shm as it was
    # before shm.caller_polls and shm.busy_poll_us; and both in staging mode.
    polls_off = {"FERRY_SHM_CALLER_POLLS": "false", "FERRY_SHM_BUSY_POLL_US": "0"}
    staging = {"FERRY_SHM_MODE": "staging"}
    # Small requests through shm's shared-memory request ring (shm.request_ring),
    # up to its default 64 KiB, or up to 256 KiB (a 4 KiB x 64 call is one
    # request of 256 KiB).
    ring = {"FERRY_SHM_REQUEST_RING": "true"}
    ring256 = dict(ring, FERRY_SHM_RING_MAX_BYTES="256KiB")
    known = {"nixl": (args.nixl_python, nixl_env, "nixl"),
             "plugin": (args.nixl_python, plugin_env, "nixl"),
             "plugin-nopoll": (args.nixl_python, dict(plugin_env, **polls_off), "nixl"),
             "plugin-staging": (args.nixl_python, dict(plugin_env, **staging), "nixl"),
             "plugin-staging-nopoll": (args.nixl_python, dict(plugin_env, **staging, **polls_off),
                                       "nixl"),
             "plugin-ring": (args.nixl_python, dict(plugin_env, **ring), "nixl"),
             "plugin-ring256": (args.nixl_python, dict(plugin_env, **ring256), "nixl"),
             "plugin-staging-ring": (args.nixl_python, dict(plugin_env, **staging, **ring),
                                     "nixl")}
    # "ferry" / "ferry-native": the NIXL-API program on ferry.compat.nixl (through
    # the `nixl` shim) / the same requests on Ferry's own Python API.
    if any(n == "ferry" or n.startswith(("ferry@", "ferry-native")) for n in names):
        ferry_env = ferry_shim_env(args)
        known["ferry"] = (args.ferry_python, ferry_env, "nixl")
        known["ferry-native"] = (args.ferry_python, ferry_env, "ferry")
    # "plugin@NAME=VALUE:NAME=VALUE" / "ferry@..." / "ferry-native@...": the
    # plugin / the compat layer / Ferry's own API with Ferry options set in the environment of both processes (an A/B of an
    # option in one run).
    for n in names:
        if n.startswith(("plugin@", "ferry@", "ferry-native@")):
            base, _, opts = n.partition("@")
            extra = dict(kv.split("=", 1) for kv in opts.split(":"))
            py, env, api = (args.nixl_python, plugin_env, "nixl") if base == "plugin" \
                else known[base]
            known[n] = (py, dict(env, **extra), api)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--systems: {unknown} (this harness runs {sorted(known)})")
    check_gpus(args, [known[n] for n in names])
    runs = {k: [] for k in names}
    for r in range(args.rounds):  # alternate: the machine's slow spells hit every system
        for which in (names if r % 2 == 0 else names[::-1]):
            py, env, api = known[which]
            runs[which].append(run_once(py, env, api, args))
            print(f"round {r + 1} {which}: {runs[which][-1]}", file=sys.stderr, flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
    label = {"nixl": "NIXL (UCX)", "plugin": "NIXL FERRY", "plugin-nopoll": "FERRY nopoll",
             "plugin-staging": "FERRY stg", "plugin-staging-nopoll": "stg nopoll",
             "plugin-ring": "FERRY ring", "plugin-ring256": "ring 256K",
             "plugin-staging-ring": "stg ring"}
    legend = []
    for i, n in enumerate(names):
        if n not in label:  # an option row: a column number, named below the table
            label[n] = n if len(n) <= 11 else f"[{i}]"
            if label[n] != n:
                legend.append(f"{label[n]} = {n}")
    first = names[0]
    head = f"workload (WRITE, {memory_of(args)}, {args.inflight} in flight)"
    w = max(42, len(head))
    head = f"{head:<{w}}"
    head += "".join(f"{label[k]:>12}" for k in names)
    short = {"nixl": "UCX", "plugin": "FERRY", "plugin-nopoll": "nopoll",
             "plugin-staging": "stg", "plugin-staging-nopoll": "stgnp", "plugin-ring": "ring",
             "plugin-ring256": "r256", "plugin-staging-ring": "stgr"}
    for n in names:
        short.setdefault(n, label[n] if len(label[n]) <= 5 else n[:5])
    head += "".join(f"{short[k] + '/' + short[first]:>12}" for k in names[1:])
    print(head)
    for wname, _, _ in WORKLOADS:
        row = f"{wname + ' GB/s':<{w}}" + "".join(f"{med[k][wname]:>12.3f}" for k in names)
        print(row + "".join(f"{med[k][wname] / med[first][wname]:>12.2f}" for k in names[1:]))
    for m in ("lat_p50_us", "lat_p99_us"):
        row = f"{'blocking 4 KiB WRITE ' + m[4:7] + ' us':<{w}}"
        row += "".join(f"{med[k][m]:>12.1f}" for k in names)
        print(row + "".join(f"{med[first][m] / med[k][m]:>12.2f}" for k in names[1:]))
    print(f"(medians of {args.rounds} alternating rounds, one NIXL wheel; ratios > 1 favour the "
          "later column; latency ratios are inverted so that > 1 = faster)")
    for line in legend:
        print(line)
    write_json(args, runs, med)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=["harness", "target", "initiator", "gpu-check"],
                   default="harness")
    p.add_argument("--dir")
    p.add_argument("--api", choices=["nixl", "ferry"], default="nixl")
    p.add_argument("--nixl-python", default="python3")
    p.add_argument("--ferry-python", default=sys.executable)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--lat-iters", type=int, default=2000)
    p.add_argument("--bytes-per-point", type=float, default=2e9)
    p.add_argument("--json")
    p.add_argument("--systems", default="nixl,ferry,ferry-native",
                   help="comma list; 'nixl,plugin' compares NIXL's UCX backend with "
                        "libplugin_FERRY.so under the same NIXL wheel (needs --plugin-dir)")
    p.add_argument("--place", choices=["host", "netns"], default="host",
                   help="host: both processes on this host as they are; netns: the target in "
                        f"network namespace {netns.NS[0]} ({netns.ADDR[0]}), the initiator in "
                        f"{netns.NS[1]} ({netns.ADDR[1]}), joined by a veth pair, both systems "
                        "over tcp as between two hosts (bench/netns.py; needs root)")
    p.add_argument("--plugin-dir", default="build/nixl_plugins",
                   help="folder holding libplugin_FERRY.so, for the 'plugin' system")
    p.add_argument("--mem", choices=["dram", "vram"], default="dram",
                   help="dram: host memory (numpy) on both sides; vram: GPU 0 -> GPU 1 on this "
                        "host, torch tensors registered and described as VRAM (needs torch with "
                        "CUDA in every interpreter, and two GPUs)")
    p.add_argument("--gpus", choices=["both", "one-each"],
                   help="with --mem vram (default both): both = both processes see both GPUs "
                        "(initiator cuda:0, target cuda:1); one-each = the initiator runs with "
                        "CUDA_VISIBLE_DEVICES=0, the target with =1, each on its cuda:0")
    p.add_argument("--slot-order", choices=["lifo", "fifo"], default="lifo",
                   help="which completed request is reposted next: lifo (default, as before) "
                        "the last to complete -- NIXL's CMA put completes inside transfer(), so "
                        "it reposts one request and rewrites one arena slot whose bytes stay in "
                        "the CPU's cache; fifo the first to complete, so that every system "
                        "cycles through all --inflight slots (equal working sets)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the target's check of each workload's bytes (outside the timing)")
    p.add_argument("--side", choices=["initiator", "target"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mem == "vram" and args.place == "netns":
        p.error("--mem vram is GPU memory between two processes of one host; --place netns "
                "moves host memory only (two namespaces as two hosts, over tcp): use one or the "
                "other")
    if args.gpus is not None and args.mem != "vram":
        p.error("--gpus goes with --mem vram (host memory uses no GPU)")
    if args.mem == "vram" and args.gpus is None:
        args.gpus = "both"
    if args.role != "harness" or args.place != "netns":
        {"harness": harness, "target": target, "initiator": initiator,
         "gpu-check": gpu_check}[args.role](args)
        return
    netns.up()
    try:
        harness(args)
    finally:
        netns.down()  # always: a namespace left behind keeps its veth


if __name__ == "__main__":
    main()
