"""Smoke test of an installed ferry wheel (packaging/check_wheel.sh runs it
from a directory outside the source tree, with `python -I`).

Checks that `ferry` comes from site-packages (not a source tree), that its
versions agree (ferry.__version__, ferry.version(), the installed
distribution's metadata), that CUDA answers (False with a reason on a
machine without a GPU or driver), and that two engines in one process move
1 MiB of random bytes host->host, by write and by read, intact.
"""
import importlib.metadata
import os
import sys
import sysconfig

import numpy as np

import ferry


def mapped(name):
    with open("/proc/self/maps") as f:
        return any(name in line for line in f)


# Importing loads neither the CUDA driver (the bundled runtime opens
# libcuda.so.1 only when a CUDA call is made) nor needs it.
assert not mapped("libcuda.so"), "import ferry loaded libcuda"

site = os.path.realpath(sysconfig.get_paths()["purelib"])
where = os.path.realpath(ferry.__file__)
assert where.startswith(site + os.sep), f"ferry imported from {where}, not from {site}"
print(f"ferry from {os.path.dirname(where)}")

dist_version = importlib.metadata.version("ferry")
assert ferry.__version__ == ferry.version() == dist_version, (
    ferry.__version__, ferry.version(), dist_version)
print(f"ferry {ferry.__version__} (wheel {dist_version}), protocol {ferry.protocol_version()}")

if ferry.cuda_available():
    print(f"CUDA: available, {ferry.cuda_device_count()} device(s)")
else:
    reason = ferry.cuda_unavailable_reason()
    assert reason, "cuda_available() is False without a reason"
    assert ferry.cuda_device_count() == 0
    print(f"CUDA: not available ({reason})")

N = 1 << 20
rng = np.random.default_rng()
with ferry.Engine() as target, ferry.Engine() as initiator:
    dst = np.zeros(N, dtype=np.uint8)
    src = rng.integers(0, 256, N, dtype=np.uint8)
    dst_region = target.register(dst)
    src_region = initiator.register(src)
    peer = initiator.connect(target.metadata())

    # WRITE: initiator's src -> target's dst, with a notification.
    peer.write([(src_region, 0, N)], [(dst_region.advertise(access="w"), 0, N)], notify=b"smoke")
    got = target.wait_notifications(timeout=10)
    assert [p for _, p in got] == [b"smoke"], got
    assert np.array_equal(dst, src), "write: the target's bytes differ"

    # READ it back into a second buffer of the initiator.
    back = np.zeros(N, dtype=np.uint8)
    back_region = initiator.register(back)
    peer.read([(back_region, 0, N)], [(dst_region.advertise(access="r"), 0, N)])
    assert np.array_equal(back, src), "read: the bytes read back differ"
print("two engines, one process: 1 MiB of random bytes written and read back host->host, identical")
print("smoke test: passed")
