"""ferry.copy_blocks and ferry.CopyStream: batched host<->GPU block copies.

On a machine with a GPU every direction and block size is checked against
random data: each block lands at a random slot of a poisoned destination,
every byte of it is compared, and every byte outside the blocks must still be
poison. Without a GPU the calls must answer NotSupported with the reason, and
bad arguments are refused before anything reaches CUDA (those tests run
everywhere).
"""
import re

import numpy as np
import pytest

import ferry
from cudart import CUDART, NO_GPU_REASON, CudaBuffer, PinnedBuffer

POISON = 0xA5
needs_gpu = pytest.mark.skipif(CUDART is None, reason=NO_GPU_REASON)


def buffer(kind, nbytes):
    return CudaBuffer(nbytes) if kind == "gpu" else PinnedBuffer(nbytes)


def scattered_case(rng, count, block, align):
    """Random source bytes and two random slot orders; slots are `block` rounded up to `align`."""
    stride = -(-block // align) * align
    data = rng.integers(0, 256, count * stride, dtype=np.uint8)
    src_slot = rng.permutation(count)
    dst_slot = rng.permutation(count)
    return data, stride, src_slot, dst_slot


def expected_destination(data, stride, block, src_slot, dst_slot, nbytes):
    want = np.full(nbytes, POISON, np.uint8)
    for s, d in zip(src_slot, dst_slot):
        want[d * stride:d * stride + block] = data[s * stride:s * stride + block]
    return want


def assert_same(got, want):
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)
        pytest.fail(f"{bad.size} bytes differ, first at offset {bad[0]}: "
                    f"got {got[bad[0]]:#x}, want {want[bad[0]]:#x}")


# ----------------------------------------------------------------- everywhere


def test_availability_is_consistent():
    available = ferry.cuda_available()
    reason = ferry.cuda_unavailable_reason()
    assert available == (reason == "")
    assert (ferry.cuda_device_count() > 0) == available


@pytest.mark.parametrize("dst, src, sizes, message", [
    ([1, 2], [3], 4096, "one entry per block: got 2, 1 and 2"),
    (1, [2, 3], 4096, "one entry per block: got 1, 2 and 1"),
    ([1], [2], [4, 4], "one entry per block: got 1, 1 and 2"),
    ([-1], [2], 4, "dst[0] = -1 is negative"),
    ([1], np.array([5, -3])[1:], 4, "src[0] = -3 is negative"),
    ([1], [2], -5, "sizes = -5 is negative"),
    (np.zeros((2, 2), np.uint64), [1, 2], 4, "dst must be one-dimensional, got shape (2, 2)"),
    ([1.5], [2], 4, "dst must hold integers, got float64"),
    (["a"], [2], 4, "dst must hold integers"),
    ([1 << 64], [2], 4, "is not a 64-bit unsigned value"),
])
def test_bad_columns_are_refused_before_cuda(dst, src, sizes, message):
    with pytest.raises(ferry.InvalidArgument, match=re.escape(message)):
        ferry.copy_blocks(dst, src, sizes)


def test_without_gpu_the_answer_is_not_supported_with_the_reason():
    if ferry.cuda_available():
        pytest.skip("a GPU is present: this checks the answer of a machine without one")
    reason = ferry.cuda_unavailable_reason()
    assert reason
    with pytest.raises(ferry.NotSupported) as e:
        ferry.copy_blocks([1], [2], 4)
    assert reason in str(e.value)
    with pytest.raises(ferry.NotSupported) as e:
        ferry.CopyStream()
    assert reason in str(e.value)


# ------------------------------------------------------------------ on a GPU


@needs_gpu
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
@pytest.mark.parametrize("block, count, align", [
    (4096, 512, 4096),       # the KV-page case: kernel path
    (3000, 300, 8),          # odd size, 8-byte aligned: kernel's narrow accesses
    (65536, 64, 65536),
    (1 << 20, 6, 1 << 20),   # copy-engine path
])
@pytest.mark.parametrize("sm_budget", [16, 8, 0])
def test_copy_blocks_every_direction(direction, block, count, align, sm_budget):
    rng = np.random.default_rng(hash((direction, block, sm_budget)) & 0xFFFFFFFF)
    data, stride, src_slot, dst_slot = scattered_case(rng, count, block, align)
    nbytes = count * stride
    src = buffer("host" if direction == "h2d" else "gpu", nbytes)
    dst = buffer("host" if direction == "d2h" else "gpu", nbytes)
    src.upload(data)
    dst.upload(np.full(nbytes, POISON, np.uint8))
    ferry.copy_blocks(dst.data_ptr() + dst_slot * stride, src.data_ptr() + src_slot * stride, block,
                      sm_budget=sm_budget)
    assert_same(dst.download(), expected_destination(data, stride, block, src_slot, dst_slot, nbytes))


@needs_gpu
def test_copy_stream_runs_batches_in_order():
    # Each batch copies what the one before it wrote: only submission order
    # gives the source bytes at the end.
    rng = np.random.default_rng(7)
    block, count = 4096, 256
    nbytes = block * count
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    host_in, host_out = PinnedBuffer(nbytes), PinnedBuffer(nbytes)
    host_in.upload(data)
    host_out.upload(np.full(nbytes, POISON, np.uint8))
    stages = [CudaBuffer(nbytes) for _ in range(3)]
    chain = [host_in] + stages + [host_out]
    offsets = np.arange(count, dtype=np.uint64) * np.uint64(block)
    stream = ferry.CopyStream(sm_budget=8)
    tickets = []
    for src, dst in zip(chain, chain[1:]):
        tickets.append(stream.submit(dst.data_ptr() + offsets, src.data_ptr() + offsets, block))
    assert tickets == [1, 2, 3, 4]
    assert stream.last_submitted == 4
    stream.wait(tickets[-1], timeout=30)
    assert all(stream.poll(t) for t in tickets)
    assert stream.completed_through == 4
    stream.wait(tickets[0], timeout=0)  # long done: returns at once
    stream.wait(tickets[1], timeout=float("inf"))
    stream.wait(tickets[2], timeout=1e300)
    assert_same(host_out.download(), data)
    stats = stream.stats()
    assert stats["batches"] == 4
    assert stats["kernel_blocks"] + stats["engine_blocks"] == 4 * count
    assert 0 < stats["max_ctas"] <= 8
    assert stream.options == {"sm_budget": 8, "kernel_max_block": 512 * 1024, "use_batch_api": True}
    assert stream.device == 0 and stream.native_stream != 0


@needs_gpu
def test_pageable_host_memory_on_the_kernel_path_is_refused_and_nothing_copied():
    block, count = 4096, 16
    pageable = np.random.default_rng(9).integers(0, 256, block * count, dtype=np.uint8)
    dst = CudaBuffer(block * count)
    dst.upload(np.full(block * count, POISON, np.uint8))
    offsets = np.arange(count, dtype=np.uint64) * np.uint64(block)
    with pytest.raises(ferry.InvalidArgument, match="block 0"):
        ferry.copy_blocks(dst.data_ptr() + offsets, pageable.ctypes.data + offsets, block)
    assert_same(dst.download(), np.full(block * count, POISON, np.uint8))


@needs_gpu
def test_null_address_and_unknown_ticket_are_refused():
    dst = CudaBuffer(8192)
    src = PinnedBuffer(8192)
    with pytest.raises(ferry.InvalidArgument, match="block 1"):
        ferry.copy_blocks([dst.data_ptr(), 0], [src.data_ptr(), src.data_ptr() + 4096], 4096)
    stream = ferry.CopyStream()
    with pytest.raises(ferry.InvalidArgument):
        stream.poll(99)
    with pytest.raises(ferry.InvalidArgument):
        ferry.CopyStream(device=ferry.cuda_device_count())
    with pytest.raises(ferry.InvalidArgument):
        stream.wait(1, timeout=-1)


@needs_gpu
def test_a_late_bad_block_refuses_the_batch_and_nothing_from_it_on_is_copied():
    block, count, bad = 4096, 2048, 1500
    data = np.random.default_rng(11).integers(0, 256, block * count, dtype=np.uint8)
    src, dst = PinnedBuffer(block * count), CudaBuffer(block * count)
    src.upload(data)
    dst.upload(np.full(block * count, POISON, np.uint8))
    offsets = np.arange(count, dtype=np.uint64) * np.uint64(block)
    dst_addr = dst.data_ptr() + offsets
    dst_addr[bad] = 0
    stream = ferry.CopyStream()
    with pytest.raises(ferry.InvalidArgument, match=f"block {bad}: null dst pointer"):
        stream.submit(dst_addr, src.data_ptr() + offsets, block)
    assert stream.last_submitted == 0
    assert_same(dst.download()[bad * block:], np.full((count - bad) * block, POISON, np.uint8))
    # The stream is still usable.
    t = stream.submit(dst.data_ptr() + offsets, src.data_ptr() + offsets, block)
    stream.wait(t, timeout=30)
    assert_same(dst.download(), data)


@needs_gpu
def test_a_single_block_by_plain_ints():
    data = np.random.default_rng(13).integers(0, 256, 5000, dtype=np.uint8)
    src, dst = PinnedBuffer(5000), CudaBuffer(5000)
    src.upload(data)
    dst.upload(np.full(5000, POISON, np.uint8))
    ferry.copy_blocks(dst.data_ptr() + 8, src.data_ptr() + 8, 4096)
    want = np.full(5000, POISON, np.uint8)
    want[8:4104] = data[8:4104]
    assert_same(dst.download(), want)


@needs_gpu
def test_empty_batch_is_a_no_op():
    ferry.copy_blocks([], [], [])
    stream = ferry.CopyStream()
    assert stream.completed_through == 0
