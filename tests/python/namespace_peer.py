"""One side of a transfer between two processes that may live in different PID
(and mount) namespaces of one kernel, commanded line by line over stdin/stdout,
so that a launcher can start it under `unshare`. The buffer is host memory, or
with a third argument `gpu` GPU memory (torch, cuda:0 of what this process sees:
the launcher sets CUDA_VISIBLE_DEVICES).

    python namespace_peer.py target SIZE [host|gpu]     -> "ready META_HEX DESC_HEX"
        check SEED N   -> "ok" or "bad K" (K bytes of [0, N) differ from pattern SEED)
    python namespace_peer.py initiator SIZE [host|gpu]  -> "ready"
        connect META_HEX DESC_HEX -> "connected JSON" (peer.transports())
        transports                -> "transports JSON" (peer.transports() now)
        write SEED N              -> "wrote"       (one write of N bytes, pattern SEED)
        bench N BLOCK SECONDS     -> "gbps X"      (writes of N bytes in BLOCK-byte iovs, 4 in flight)
    exit

Used by tests/python/test_namespaces.py.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

GPU = len(sys.argv) > 3 and sys.argv[3] == "gpu"
if GPU:
    import torch  # before ferry: the other order aborted at torch's import (H200, 2026-11-27)

import ferry  # noqa: E402


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def main() -> None:
    role, size = sys.argv[1], int(sys.argv[2])
    engine = ferry.Engine("127.0.0.1:0")
    if GPU:
        torch.cuda.set_device(0)
        buf = torch.zeros(size, dtype=torch.uint8, device="cuda:0")
    else:
        buf = np.zeros(size, dtype=np.uint8)
    region = engine.register(buf)

    def fill(n, data):
        if GPU:
            buf[:n].copy_(torch.from_numpy(data))
            torch.cuda.synchronize()
        else:
            buf[:n] = data

    def read(n):
        return buf[:n].cpu().numpy() if GPU else buf[:n]
    if role == "target":
        print("ready", engine.metadata().hex(), bytes(region.advertise(access="rw")).hex(), flush=True)
    else:
        print("ready", flush=True)
    peer, desc = None, None
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        try:
            if cmd[0] == "exit":
                break
            if cmd[0] == "check":
                seed, n = int(cmd[1]), int(cmd[2])
                bad = int(np.count_nonzero(read(n) != pattern(seed, n)))
                print("ok" if bad == 0 else f"bad {bad}", flush=True)
            elif cmd[0] == "connect":
                peer = engine.connect(bytes.fromhex(cmd[1]))
                desc = bytes.fromhex(cmd[2])
                print("connected", json.dumps(peer.transports(), default=str), flush=True)
            elif cmd[0] == "transports":
                print("transports", json.dumps(peer.transports(), default=str), flush=True)
            elif cmd[0] == "write":
                seed, n = int(cmd[1]), int(cmd[2])
                fill(n, pattern(seed, n))
                peer.write([(region, 0, n)], [(desc, 0, n)], timeout=30)
                print("wrote", flush=True)
            elif cmd[0] == "bench":
                n, block, secs = int(cmd[1]), int(cmd[2]), float(cmd[3])
                local = [(region, off, block) for off in range(0, n, block)]
                remote = [(desc, off, block) for off in range(0, n, block)]
                calls, t0, inflight = 0, time.perf_counter(), []
                while time.perf_counter() - t0 < secs:
                    inflight.append(peer.write(local, remote, async_=True))
                    if len(inflight) == 4:
                        inflight.pop(0).wait(30)
                        calls += 1
                for t in inflight:
                    t.wait(30)
                    calls += 1
                print(f"gbps {calls * n / (time.perf_counter() - t0) / 1e9:.3f}", flush=True)
            else:
                print(f"error unknown command {cmd[0]}", flush=True)
        except Exception as e:  # the launcher reads the reason
            print(f"error {type(e).__name__}: {e}".replace("\n", " "), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
