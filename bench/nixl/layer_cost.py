"""What ferry.compat.nixl adds per call: transfer() and check_xfer_state() of a
prepared 4 KiB WRITE between two agents of one process, against Ferry's own
PreparedTransfer.post() and Transfer.done() on the same request (medians of
3,000; the second block times the Ferry post inside transfer() itself).

    python bench/nixl/layer_cost.py      (ferry importable, or FERRY_PYTHONPATH=...)
"""
import os
import sys
import time

import numpy as np

if os.environ.get("FERRY_PYTHONPATH"):
    sys.path.insert(0, os.environ["FERRY_PYTHONPATH"])
from ferry.compat.nixl import nixl_agent, nixl_agent_config
a = nixl_agent("a", nixl_agent_config(enable_prog_thread=False)); b = nixl_agent("b")
x = np.zeros(1 << 20, np.uint8); y = np.zeros(1 << 20, np.uint8)
a.register_memory([(x.ctypes.data, x.nbytes, 0, "")], "DRAM"); b.register_memory([(y.ctypes.data, y.nbytes, 0, "")], "DRAM")
a.add_remote_agent(b.get_agent_metadata())
l = a.prep_xfer_dlist("", [(x.ctypes.data, 4096, 0)], "DRAM"); r = a.prep_xfer_dlist("b", [(y.ctypes.data, 4096, 0)], "DRAM")
h = a.make_prepped_xfer("WRITE", l, [0], r, [0])
part = h._req._part
post_l, post_n, poll_l, poll_n = [], [], [], []
for i in range(3000):
    t0 = time.perf_counter_ns(); st = a.transfer(h); post_l.append(time.perf_counter_ns() - t0)
    while a.check_xfer_state(h) != "DONE": pass
    t0 = time.perf_counter_ns(); a.check_xfer_state(h); poll_l.append(time.perf_counter_ns() - t0)
    t0 = time.perf_counter_ns(); t = part.post(); post_n.append(time.perf_counter_ns() - t0)
    while not t.done(): pass
    t0 = time.perf_counter_ns(); t.done(); poll_n.append(time.perf_counter_ns() - t0)
med = lambda v: sorted(v)[len(v) // 2] / 1000
print(f"post: NIXL layer {med(post_l):.2f} us, Ferry API {med(post_n):.2f} us; poll of a done request: layer {med(poll_l):.2f} us, Ferry {med(poll_n):.2f} us")
inner, outer = [], []
h._req._timed = True  # the request's own clock (telemetry's), to see the Ferry post inside transfer()
for i in range(3000):
    t0 = time.perf_counter_ns(); a.transfer(h); outer.append(time.perf_counter_ns() - t0); inner.append(h._req._t_post_ns)
    while a.check_xfer_state(h) != "DONE": pass
print(f"layer transfer() {med(outer):.2f} us of which the Ferry post {med(inner):.2f} us")
