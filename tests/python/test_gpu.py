"""GPU memory through the Python API (skipped without a CUDA device).

CUDA memory comes from the CUDA runtime through ctypes (no torch, no cupy) and is
registered the way a torch tensor would be (data_ptr() + nbytes) or as a raw
pointer; the engine detects the memory kind.
"""
import numpy as np
import pytest

import ferry
from cudart import CUDART, NO_GPU_REASON, CudaBuffer

pytestmark = pytest.mark.skipif(CUDART is None, reason=NO_GPU_REASON)


@pytest.fixture()
def pair():
    with ferry.Engine() as a, ferry.Engine() as b:
        yield a, b, a.connect(b.metadata())


@pytest.mark.parametrize("src_kind", ["host", "cuda"])
@pytest.mark.parametrize("dst_kind", ["host", "cuda"])
def test_gpu_write_and_read(pair, src_kind, dst_kind):
    a, b, peer = pair
    n = 8 << 20
    data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    if src_kind == "cuda":
        src = CudaBuffer(n)
        src.upload(data)
        rs = a.register(src)
    else:
        src = data.copy()
        rs = a.register(src)
    dst = CudaBuffer(n) if dst_kind == "cuda" else np.zeros(n, np.uint8)
    rd = b.register(dst) if dst_kind == "host" else b.register_ptr(dst.ptr, n)
    assert rs.kind == src_kind and rd.kind == dst_kind
    desc = rd.advertise()
    assert ferry.Descriptor.from_bytes(desc).kind == (ferry.MemoryKind.Cuda if dst_kind == "cuda"
                                                      else ferry.MemoryKind.Host)
    peer.write([(rs, 0, n // 2), (rs, n // 2, n // 2)], [(desc, n // 2, n // 2), (desc, 0, n // 2)],
               notify=b"gpu")
    assert b.wait_notifications(30) == [(a.id, b"gpu")]
    got = dst.download() if dst_kind == "cuda" else dst
    assert np.array_equal(got[: n // 2], data[n // 2:]) and np.array_equal(got[n // 2:], data[: n // 2])
    # read it back into a fresh buffer of the source kind
    back = CudaBuffer(n) if src_kind == "cuda" else np.zeros(n, np.uint8)
    rb = a.register(back)
    peer.read([(rb, 0, n)], [(desc, 0, n)])
    got = back.download() if src_kind == "cuda" else back
    assert np.array_equal(got[: n // 2], data[n // 2:])


def test_gpu_batch(pair):
    a, b, peer = pair
    blocks, block = 4096, 4096
    n = blocks * block
    data = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    src = CudaBuffer(n)
    src.upload(data)
    dst = CudaBuffer(n)
    rs, rd = a.register(src), b.register(dst)
    perm = np.random.default_rng(3).permutation(blocks).astype(np.uint64)
    peer.write_batch(rs, np.arange(blocks, dtype=np.uint64) * block, rd.advertise(), None,
                     perm * np.uint64(block), block)
    got = dst.download().reshape(blocks, block)
    assert np.array_equal(got[perm.astype(np.int64)], data.reshape(blocks, block))
