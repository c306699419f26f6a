"""The CUDA runtime through ctypes, for the GPU tests (no torch, no cupy).

``CUDART`` is None when there is no runtime library or no device; tests skip
then, with that reason.
"""
import ctypes
import ctypes.util

import numpy as np

H2D, D2H = 1, 2


def _cudart():
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        n = ctypes.c_int(0)
        if lib.cudaGetDeviceCount(ctypes.byref(n)) == 0 and n.value > 0:
            return lib
        return None
    return None


CUDART = _cudart()
NO_GPU_REASON = "no CUDA device (or no CUDA runtime)"


class CudaBuffer:
    """Device memory that looks like a torch tensor to ferry (data_ptr, nbytes)."""

    def __init__(self, nbytes):
        p = ctypes.c_void_p()
        assert CUDART.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(nbytes)) == 0
        self.ptr, self.nbytes = p.value, nbytes

    def data_ptr(self):
        return self.ptr

    def upload(self, arr):
        assert CUDART.cudaMemcpy(ctypes.c_void_p(self.ptr), arr.ctypes.data_as(ctypes.c_void_p),
                                 ctypes.c_size_t(arr.nbytes), H2D) == 0

    def download(self):
        out = np.empty(self.nbytes, np.uint8)
        assert CUDART.cudaMemcpy(out.ctypes.data_as(ctypes.c_void_p), ctypes.c_void_p(self.ptr),
                                 ctypes.c_size_t(self.nbytes), D2H) == 0
        return out

    def __del__(self):
        if CUDART is not None and self.ptr:
            CUDART.cudaFree(ctypes.c_void_p(self.ptr))


class PinnedBuffer:
    """Pinned host memory (cudaHostAlloc) viewed as a uint8 NumPy array (``.array``)."""

    def __init__(self, nbytes):
        p = ctypes.c_void_p()
        assert CUDART.cudaHostAlloc(ctypes.byref(p), ctypes.c_size_t(nbytes), 0) == 0
        self.ptr, self.nbytes = p.value, nbytes
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.ptr))

    def data_ptr(self):
        return self.ptr

    def upload(self, arr):
        self.array[:] = arr

    def download(self):
        return self.array.copy()

    def __del__(self):
        if CUDART is not None and self.ptr:
            self.array = None
            CUDART.cudaFreeHost(ctypes.c_void_p(self.ptr))
