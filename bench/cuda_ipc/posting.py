"""Keeping prepared calls in flight, shared by the two-process benchmarks here
(bidirectional.py, staged_fallback.py)."""
from __future__ import annotations

import time


def gbps_with_calls_in_flight(posts, call_bytes: int, seconds: float) -> float:
    """Posts the prepared calls round-robin (posts[k]() starts call k and returns
    its transfer), keeping len(posts) in flight, for `seconds`; GB/s from the
    first post to the last completion."""
    depth = len(posts)
    inflight, calls, t0 = [], 0, time.perf_counter()
    for k in range(depth):
        inflight.append(posts[k]())
    while True:
        inflight.pop(0).wait(60_000)
        calls += 1
        if time.perf_counter() - t0 >= seconds:
            for t in inflight:
                t.wait(60_000)
            calls += len(inflight)
            return calls * call_bytes / (time.perf_counter() - t0) / 1e9
        inflight.append(posts[calls % depth]())
