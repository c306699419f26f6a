#!/usr/bin/env python3
"""Host memory between two processes of one kernel, as containers place them:
both in one PID namespace (the reference: shm by cross-memory attach), the target
in a child PID namespace (shm stages through shared memory: the target cannot see
the initiator's pid), and the target also with a private /tmp (no shm socket in
common: a network transport on loopback). Alternating rounds, medians, GB/s of
writes of SIZE bytes in BLOCK-byte iovs, 4 in flight; every round's first write
checked byte for byte on the target. Needs root (unshare, mount).

    PYTHONPATH=build/python python3 bench/peers/namespaces.py [--rounds 5] [--size 8388608]
        [--block 1048576] [--secs 1.0]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "python"))
from test_namespaces import PID_NS, PRIVATE_TMP, WHY_NOT, Peer  # noqa: E402

CASES = [("same namespace", []), ("target in a child PID namespace", PID_NS),
         ("target in a child PID namespace, private /tmp", PRIVATE_TMP)]


def one_round(prefix, size, block, secs, seed):
    target = Peer("target", prefix)
    initiator = Peer("initiator", [])
    try:
        answer = initiator.ask(f"connect {target.ready[1]} {target.ready[2]}")
        assert answer.startswith("connected "), answer
        transports = json.loads(answer[len("connected "):])
        carrier = next(t for t in transports if "host memory" in (t.get("carries") or ""))
        assert initiator.ask(f"write {seed} {size}") == "wrote"
        check = target.ask(f"check {seed} {size}")
        gbps = float(initiator.ask(f"bench {size} {block} {secs}").split()[1])
        return gbps, check, f"{carrier['transport']}: {carrier['via']}"
    finally:
        initiator.close()
        target.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size", type=int, default=8 << 20)
    ap.add_argument("--block", type=int, default=1 << 20)
    ap.add_argument("--secs", type=float, default=1.0)
    a = ap.parse_args()
    if WHY_NOT:
        sys.exit(f"namespaces.py: {WHY_NOT}")
    import test_namespaces
    test_namespaces.SIZE = a.size
    runs = {name: [] for name, _ in CASES}
    how = {}
    for r in range(a.rounds):
        order = CASES[r % len(CASES):] + CASES[:r % len(CASES)]
        for name, prefix in order:
            gbps, check, via = one_round(prefix, a.size, a.block, a.secs, 100 + r)
            if check != "ok":
                sys.exit(f"{name}: data check {check}")
            runs[name].append(gbps)
            how[name] = via
            print(f"round {r + 1} {name:48} {gbps:7.3f} GB/s", file=sys.stderr, flush=True)
    base = statistics.median(runs[CASES[0][0]])
    print(f"\nwrites of {a.size:,} B in {a.block:,}-byte iovs, 4 in flight; medians of {a.rounds} "
          "alternating rounds; data checked every round")
    print(f"{'case':48} {'GB/s':>8} {'min-max':>15} {'/ same ns':>9}  carried by")
    for name, _ in CASES:
        v = runs[name]
        print(f"{name:48} {statistics.median(v):8.3f} {min(v):7.2f}-{max(v):<7.2f} "
              f"{statistics.median(v) / base:9.2f}  {how[name]}")


if __name__ == "__main__":
    main()
