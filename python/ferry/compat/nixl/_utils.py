"""``nixl._utils`` on Ferry: the raw-memory helpers NIXL's tests and examples use."""
from __future__ import annotations

import ctypes

_libc = ctypes.CDLL(None)
_libc.aligned_alloc.restype = ctypes.c_void_p
_libc.aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]
_ALIGN = 4096  # as NIXL's helper: storage I/O with O_DIRECT wants block alignment


def malloc_passthru(size: int) -> int:
    """Address of `size` bytes of 4 KiB-aligned host memory (free with free_passthru)."""
    size = int(size)
    rounded = (size + _ALIGN - 1) // _ALIGN * _ALIGN or _ALIGN
    addr = _libc.aligned_alloc(_ALIGN, rounded)
    if not addr:
        raise MemoryError(f"malloc_passthru({size}) failed")
    return int(addr)


def free_passthru(addr: int) -> None:
    _libc.free(ctypes.c_void_p(int(addr)))


def ba_buf(addr: int, size: int) -> None:
    """Fills `size` bytes at `addr` with 0xba."""
    ctypes.memset(int(addr), 0xBA, int(size))


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """Asserts that `size` bytes at the two addresses are equal."""
    a = ctypes.string_at(int(addr1), int(size))
    b = ctypes.string_at(int(addr2), int(size))
    if a != b:
        first = next(i for i in range(len(a)) if a[i] != b[i])
        raise AssertionError(f"verify_transfer: byte {first} differs "
                             f"(0x{a[first]:02x} vs 0x{b[first]:02x})")
