"""Disaggregated prefill → decode under torchrun: engines find each other by name.

    torchrun --nproc_per_node=4 examples/disagg_torchrun.py           # 2 prefill + 2 decode ranks
    torchrun --nproc_per_node=4 examples/disagg_torchrun.py --directory etcd://127.0.0.1:2379/demo

Ranks [0, P) are prefill workers, [P, world) decode workers (P = world // 2, or --prefill).
Each decode worker owns a paged KV pool (CPU memory here; a CUDA tensor works the same) and
publishes its engine as "decode-<i>" with the pool's descriptor under "kv-pool". Each prefill
worker publishes itself as "prefill-<j>", computes the KV pages of its requests (seeded random
bytes standing in for attention output), and for each request connects *by name* to the decode
worker that serves it and writes the pages into that worker's pool in one batched call, with a
notification naming the request and its slots. Decode workers wait for their requests and check
every page. Nothing but names crosses between processes: no metadata or descriptor is passed by
hand.

The directory is torchrun's own TCPStore (MASTER_ADDR:MASTER_PORT, leases emulated by a
heartbeat) unless --directory names an etcd server. torch is used only for the store.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import numpy as np

import ferry


def torchrun_store(timeout: float):
    """A client of the TCPStore that torchrun's agent serves at MASTER_ADDR:MASTER_PORT."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timedelta(seconds=timeout))


def kv_pages(request: int, pages: int, page_size: int, seed: int) -> np.ndarray:
    """The KV pages request `request` produces (deterministic, so decode can check them)."""
    rng = np.random.default_rng([seed, request])
    return rng.integers(0, 256, pages * page_size, dtype=np.uint8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--directory", help="etcd://host:port/prefix (default: torchrun's TCPStore)")
    ap.add_argument("--prefill", type=int, help="prefill ranks (default: world // 2)")
    ap.add_argument("--requests", type=int, default=16, help="requests in all")
    ap.add_argument("--pages", type=int, default=8, help="KV pages per request")
    ap.add_argument("--page-size", type=int, default=64 << 10, help="bytes per KV page")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds any wait may take")
    args = ap.parse_args()

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("launch with torchrun, e.g.: torchrun --nproc_per_node=4 " + sys.argv[0],
              file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    n_prefill = args.prefill if args.prefill is not None else world // 2
    n_decode = world - n_prefill
    if n_prefill < 1 or n_decode < 1:
        print(f"need at least one prefill and one decode rank (world {world}, prefill "
              f"{n_prefill})", file=sys.stderr)
        return 2
    if args.directory:
        directory = args.directory
        options = {}
    else:
        directory = torchrun_store(args.timeout)
        run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        options = {"prefix": f"ferry/{run}/attempt-{attempt}"}

    page = args.page_size
    # Request r is served by decode worker r % n_decode, in its slots
    # [(r // n_decode) * pages, ... + pages); prefill worker r % n_prefill computes it.
    mine_decode = [r for r in range(args.requests) if r % n_decode == rank - n_prefill]
    mine_prefill = [r for r in range(args.requests) if r % n_prefill == rank]
    per_decode = -(-args.requests // n_decode)

    engine = ferry.Engine()
    if rank >= n_prefill:
        i = rank - n_prefill
        pool = np.zeros(per_decode * args.pages * page, dtype=np.uint8)
        region = engine.register(pool)
        with ferry.directory.attach(engine, directory, f"decode-{i}", **options) as me:
            me.publish("kv-pool", region, access="w")
            print(f"[decode-{i}] rank {rank}: KV pool of {pool.nbytes >> 20} MiB published; "
                  f"waiting for {len(mine_decode)} requests", flush=True)
            # Done when every request is here and checked and every prefill worker said bye.
            pending, byes = set(mine_decode), set()
            deadline = time.monotonic() + args.timeout
            while pending or len(byes) < n_prefill:
                left = deadline - time.monotonic()
                if left <= 0:
                    print(f"[decode-{i}] timed out: requests {sorted(pending)} missing, "
                          f"byes from {sorted(byes)}", file=sys.stderr)
                    return 1
                for _, payload in engine.wait_notifications(timeout=min(left, 1.0)):
                    note = json.loads(payload)
                    if "bye" in note:
                        byes.add(note["bye"])
                        continue
                    r, slots = note["request"], note["slots"]
                    got = np.concatenate([pool[s * page:(s + 1) * page] for s in slots])
                    if not np.array_equal(got, kv_pages(r, args.pages, page, args.seed)):
                        print(f"[decode-{i}] request {r} from {note['from']}: KV pages differ",
                              file=sys.stderr)
                        return 1
                    pending.discard(r)
            print(f"[decode-{i}] verified {len(mine_decode)} requests, "
                  f"{len(mine_decode) * args.pages} pages", flush=True)
    else:
        name = f"prefill-{rank}"
        staging = np.zeros(args.pages * page, dtype=np.uint8)
        region = engine.register(staging)
        with ferry.directory.attach(engine, directory, name, **options) as me:
            peers, pools = {}, {}  # decode worker -> Peer, KV pool descriptor
            moved, start = 0, time.perf_counter()
            for r in mine_prefill:
                d = r % n_decode
                staging[:] = kv_pages(r, args.pages, page, args.seed)   # "run the model"
                if d not in peers:  # by name, waiting until that worker has published
                    peers[d] = me.connect(f"decode-{d}", timeout=args.timeout)
                    pools[d] = me.lookup(f"decode-{d}", "kv-pool", timeout=args.timeout)
                peer, pool = peers[d], pools[d]
                first = (r // n_decode) * args.pages
                slots = list(range(first, first + args.pages))
                note = json.dumps({"request": r, "slots": slots, "from": name}).encode()
                peer.write([(region, k * page, page) for k in range(args.pages)],
                           [(pool, s * page, page) for s in slots], notify=note)
                moved += args.pages * page
            seconds = time.perf_counter() - start
            print(f"[{name}] rank {rank}: {len(mine_prefill)} requests, {moved >> 20} MiB of KV "
                  f"to decode workers by name in {seconds:.3f} s", flush=True)
            # Every decode worker waits for a bye from every prefill worker before it
            # leaves (notify returns once the decode worker has it).
            for d in range(n_decode):
                peer = peers.get(d) or me.connect(f"decode-{d}", timeout=args.timeout)
                peer.notify(json.dumps({"bye": name}).encode())
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
