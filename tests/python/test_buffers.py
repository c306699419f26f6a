"""Every accepted kind of buffer, as source and as destination."""
import gc
import weakref

import numpy as np
import pytest

import ferry

N = 256 * 1024


class DLPackOnly:
    """A producer that offers nothing but the DLPack protocol."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, *args, **kwargs):
        return self._arr.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


class FakeTensor:
    """torch-like: data_ptr(), nbytes, is_contiguous(); no buffer protocol, no DLPack."""

    def __init__(self, arr):
        self._arr = arr

    def data_ptr(self):
        return self._arr.ctypes.data

    @property
    def nbytes(self):
        return self._arr.nbytes

    def is_contiguous(self):
        return self._arr.flags.c_contiguous


def make(kind, data):
    """(object to register, numpy view of its bytes, owner to keep alive)."""
    if kind == "numpy":
        a = data.copy()
        return a, a, a
    if kind == "numpy-float32":
        a = data.copy().view(np.float32)
        return a, a.view(np.uint8), a
    if kind == "bytearray":
        b = bytearray(data.tobytes())
        return b, np.frombuffer(b, dtype=np.uint8), b
    if kind == "memoryview":
        b = bytearray(data.tobytes())
        m = memoryview(b)
        return m, np.frombuffer(b, dtype=np.uint8), b
    if kind == "dlpack":
        a = data.copy()
        return DLPackOnly(a), a, a
    if kind == "torch-like":
        a = data.copy()
        return FakeTensor(a), a, a
    raise AssertionError(kind)


KINDS = ["numpy", "numpy-float32", "bytearray", "memoryview", "dlpack", "torch-like"]


@pytest.fixture(scope="module")
def pair():
    with ferry.Engine() as a, ferry.Engine() as b:
        yield a, b, a.connect(b.metadata())


@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", KINDS)
def test_kinds_write_and_read(pair, src_kind, dst_kind):
    a, b, peer = pair
    rng = np.random.default_rng(hash((src_kind, dst_kind)) & 0xFFFF)
    data = rng.integers(0, 256, N, dtype=np.uint8)
    src_obj, src_view, _keep1 = make(src_kind, data)
    dst_obj, dst_view, _keep2 = make(dst_kind, np.zeros(N, np.uint8))
    src = a.register(src_obj)
    dst = b.register(dst_obj)
    assert src.length == dst.length == N and src.kind == "host"
    assert src.source in ("buffer", "dlpack", "data_ptr")
    desc = dst.advertise()
    peer.write([(src, 0, N)], [(desc, 0, N)])
    assert np.array_equal(dst_view, data)
    # read back into a third buffer of the source kind
    back_obj, back_view, _keep3 = make(src_kind, np.zeros(N, np.uint8))
    back = a.register(back_obj)
    peer.read([(back, 0, N)], [(desc, 0, N)])
    assert np.array_equal(back_view, data)


@pytest.mark.parametrize("kind", ["numpy", "bytearray", "memoryview"])
def test_unregistered_buffer_object_inside_a_region(pair, kind):
    """A list entry may name a buffer object (not the Region) lying in registered memory."""
    a, b, peer = pair
    data = np.random.default_rng(7).integers(0, 256, N, dtype=np.uint8)
    obj, view, keep = make(kind, data)
    region = a.register(obj)
    dst = np.zeros(N, np.uint8)
    dreg = b.register(dst)
    desc = dreg.advertise()
    peer.write([(obj, 1000, 5000)], [(desc, 0, 5000)])
    assert np.array_equal(dst[:5000], data[1000:6000])
    del region


def test_register_ptr(pair):
    a, b, peer = pair
    data = np.random.default_rng(8).integers(0, 256, N, dtype=np.uint8)
    src = a.register_ptr(data.ctypes.data, data.nbytes)
    assert src.address == data.ctypes.data and src.obj is None and src.source == "pointer"
    dst = np.zeros(N, np.uint8)
    dreg = b.register(dst)
    peer.write([(src, 0, N)], [(dreg.advertise(), 0, N)])
    assert np.array_equal(dst, data)


def test_region_keeps_buffer_alive():
    with ferry.Engine() as e:
        arr = np.ones(4096, np.uint8)
        ref = weakref.ref(arr)
        region = e.register(arr)
        del arr
        gc.collect()
        assert ref() is not None and region.obj is ref()
        region.deregister()
        gc.collect()
        assert ref() is None


def test_region_context_manager_and_repr():
    with ferry.Engine() as e:
        buf = bytearray(100)
        with e.register(buf) as r:
            assert r.registered and "Region" in repr(r) and len(r) == 100
        assert not r.registered
        buf.extend(b"x")  # released: the bytearray may be resized again


def test_registered_bytearray_cannot_be_resized():
    with ferry.Engine() as e:
        buf = bytearray(100)
        r = e.register(buf)
        with pytest.raises(BufferError):
            buf.extend(b"more")
        r.deregister()
        buf.extend(b"more")


def test_dlpack_noncontiguous_refused():
    with ferry.Engine() as e:
        with pytest.raises(ferry.InvalidArgument, match="contiguous"):
            e.register(DLPackOnly(np.zeros((8, 8), np.float32)[:, ::2]))
        with pytest.raises(ferry.InvalidArgument, match="contiguous"):
            e.register(FakeTensor(np.zeros((8, 8), np.float32)[:, ::2]))


def test_address_of_matches_register():
    a = np.zeros(64, np.uint16)
    addr, nbytes, readonly, source = ferry._ferry._address_of(a)
    assert addr == a.ctypes.data and nbytes == 128 and not readonly and source == "buffer"
