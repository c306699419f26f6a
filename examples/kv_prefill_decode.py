#!/usr/bin/env python3
"""Disaggregated prefill/decode: move paged KV cache from a "prefill" process to a
"decode" process with Ferry, then tell the decoder it is there.

    python examples/kv_prefill_decode.py [--pages 298] [--page-bytes 1179648]

The decode process owns a paged KV pool (registered once, advertised once) and
picks free page slots for the request. The prefill process computes the
request's KV pages (here: deterministic pseudo-random bytes per page), writes all
of them into the decoder's slots in ONE batched call (numpy columns, no Python
loop per page) carrying a notification, and the decoder - which does nothing
during the transfer - wakes up on the notification and checks every page.

The default shape is one long request: 298 pages of 1,179,648 bytes (1.125 MiB,
e.g. 16 tokens x 36 layers x 4 KV heads x 128 dims x K,V x 2 bytes), 351.5 MB.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np

import ferry


def page_content(request_id: int, page: int, page_bytes: int) -> np.ndarray:
    """What prefill 'computes' for a page: reproducible, so decode can check it."""
    rng = np.random.default_rng((request_id << 20) + page)
    return rng.integers(0, 256, page_bytes, dtype=np.uint8)


def decode(conn, args):
    engine = ferry.Engine(args.listen, tcp_streams=args.streams)
    pool_pages = args.pages + args.spare_pages
    kv_pool = np.zeros((pool_pages, args.page_bytes), dtype=np.uint8)  # the paged KV cache
    region = engine.register(kv_pool)
    pool_desc = region.advertise(access="w")  # prefill may only write into it

    # The scheduler hands this request some free slots, in no particular order.
    slots = np.random.default_rng(7).permutation(pool_pages)[: args.pages].astype(np.uint64)
    conn.send({"metadata": engine.metadata(), "pool": pool_desc, "slots": slots,
               "request_id": args.request_id})

    t0 = time.perf_counter()
    notes = engine.wait_notifications(timeout=args.timeout)
    waited = time.perf_counter() - t0
    if not notes:
        conn.send({"ok": False, "error": f"no notification within {args.timeout} s"})
        return
    peer_id, payload = notes[0]
    expect = f"kv-ready request={args.request_id} pages={args.pages}".encode()
    if payload != expect:
        conn.send({"ok": False, "error": f"unexpected notification {payload!r}"})
        return

    # The notification arrives only after every byte of the write is placed.
    bad = [p for p in range(args.pages)
           if not np.array_equal(kv_pool[int(slots[p])],
                                 page_content(args.request_id, p, args.page_bytes))]
    untouched = np.setdiff1d(np.arange(pool_pages), slots.astype(np.int64))
    spare_clean = all(not kv_pool[s].any() for s in untouched)
    conn.send({"ok": not bad and spare_clean, "bad_pages": bad, "spare_clean": spare_clean,
               "waited_s": waited, "from": peer_id})
    region.deregister()
    engine.close()


def prefill(info, args):
    engine = ferry.Engine(args.listen, tcp_streams=args.streams)
    # "Compute" the request's KV pages into a contiguous staging area.
    kv = np.empty((args.pages, args.page_bytes), dtype=np.uint8)
    for p in range(args.pages):
        kv[p] = page_content(info["request_id"], p, args.page_bytes)
    region = engine.register(kv)
    peer = engine.connect(info["metadata"])

    local_offsets = np.arange(args.pages, dtype=np.uint64) * args.page_bytes
    remote_offsets = info["slots"] * np.uint64(args.page_bytes)
    note = f"kv-ready request={info['request_id']} pages={args.pages}".encode()
    t0 = time.perf_counter()
    peer.write_batch(region, local_offsets, info["pool"], None, remote_offsets,
                     args.page_bytes, notify=note, timeout=args.timeout)
    elapsed = time.perf_counter() - t0
    total = args.pages * args.page_bytes
    print(f"[prefill] wrote {args.pages} pages x {args.page_bytes} B = {total / 1e6:.1f} MB "
          f"in {elapsed * 1e3:.1f} ms ({total / elapsed / 1e9:.2f} GB/s), notification sent")
    engine.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=298)
    ap.add_argument("--page-bytes", type=int, default=1_179_648)
    ap.add_argument("--spare-pages", type=int, default=32, help="free slots left in the pool")
    ap.add_argument("--request-id", type=int, default=42)
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--streams", type=int, default=4, help="tcp streams per peer")
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args()

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    dec = ctx.Process(target=decode, args=(child, args), name="decode")
    dec.start()
    child.close()
    if not parent.poll(60):
        raise SystemExit("decode process did not start")
    info = parent.recv()
    prefill(info, args)
    if not parent.poll(args.timeout):
        raise SystemExit("decode process did not report")
    result = parent.recv()
    dec.join(30)
    if result["ok"]:
        print(f"[decode] notification received after {result['waited_s'] * 1e3:.1f} ms; "
              f"all {args.pages} pages verified, {args.spare_pages} spare slots untouched")
    else:
        raise SystemExit(f"[decode] FAILED: {result}")


if __name__ == "__main__":
    main()
