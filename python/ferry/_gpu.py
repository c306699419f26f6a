"""Batched local copies between host and GPU memory (``ferry.copy_blocks``,
``ferry.CopyStream``), for KV-cache offload and similar traffic: thousands of
small blocks per call, in any direction (host->GPU, GPU->host, GPU->GPU).

Blocks are given as three columns of equal length -- destination addresses,
source addresses and sizes in bytes -- each a list of ints, a NumPy array or
anything NumPy reads as integers (a CPU tensor of int64 offsets added to a
``data_ptr()`` works). ``sizes`` may be one int for every block; ``dst`` and
``src`` may be single ints for a single block. Host memory
must be pinned (``cudaHostAlloc`` / ``cudaHostRegister``, e.g.
``torch.empty(..., pin_memory=True)``) for blocks below ``kernel_max_block``.
The memory must stay valid until the copy is done: Ferry sees only addresses.
"""
from __future__ import annotations

import numpy as np

from . import _ferry
from ._errors import InvalidArgument

# Defaults of ferry::CopyOptions (include/ferry/gpu.h).
DEFAULT_SM_BUDGET = 16
DEFAULT_KERNEL_MAX_BLOCK = 512 * 1024


def _column(values, name: str) -> np.ndarray:
    """One column as contiguous uint64, refusing what is not a list of addresses or sizes."""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"{name}: cannot read as integers ({e})") from None
    if arr.ndim != 1:
        raise InvalidArgument(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
        if arr.dtype == object and all(isinstance(v, int) for v in arr.tolist()):
            values = arr.tolist()
            bad = next((i for i, v in enumerate(values) if v < 0 or v >= 1 << 64), None)
            if bad is not None:
                raise InvalidArgument(f"{name}[{bad}] = {values[bad]} is not a 64-bit unsigned value")
            return np.array(values, dtype=np.uint64)
        raise InvalidArgument(f"{name} must hold integers, got {arr.dtype}")
    if np.issubdtype(arr.dtype, np.signedinteger) and (arr < 0).any():
        bad = int(np.argmax(arr < 0))
        raise InvalidArgument(f"{name}[{bad}] = {int(arr[bad])} is negative")
    return np.ascontiguousarray(arr, dtype=np.uint64)


def _address_column(values, name: str) -> np.ndarray:
    """Like _column, and one int is a single block."""
    if isinstance(values, (int, np.integer)) and not isinstance(values, bool):
        values = [int(values)]
    return _column(values, name)


def _columns(dst, src, sizes):
    d = _address_column(dst, "dst")
    s = _address_column(src, "src")
    if isinstance(sizes, (int, np.integer)) and not isinstance(sizes, bool):
        if sizes < 0:
            raise InvalidArgument(f"sizes = {sizes} is negative")
        n = np.full(len(d), sizes, dtype=np.uint64)
    else:
        n = _column(sizes, "sizes")
    if not (len(d) == len(s) == len(n)):
        raise InvalidArgument(
            f"dst, src and sizes must have one entry per block: got {len(d)}, {len(s)} and {len(n)}")
    return d, s, n


def copy_blocks(dst, src, sizes, *, device: int = 0, sm_budget: int = DEFAULT_SM_BUDGET,
                kernel_max_block: int = DEFAULT_KERNEL_MAX_BLOCK,
                use_batch_api: bool = True) -> None:
    """Copy every block (dst[i] <- src[i], sizes[i] bytes) on ``device`` and wait.

    Small blocks go through an SM gather/scatter kernel that occupies at most
    ``sm_budget`` SMs (0: copy engine only); blocks of ``kernel_max_block``
    bytes or more through the copy engine. Raises NotSupported without a GPU
    (with the reason) and InvalidArgument naming the first bad block (null
    address, pageable host memory on the kernel path); nothing is copied then.
    """
    d, s, n = _columns(dst, src, sizes)
    _ferry._copy_blocks(d, s, n, device, sm_budget, kernel_max_block, use_batch_api)


class CopyStream:
    """An ordered copy stream on one GPU: batches run and complete in submission order.

    ``submit`` returns a ticket (1, 2, 3, ...) at once; ``poll(ticket)`` says
    whether that batch is done (raising its error if it failed), ``wait``
    blocks for it. ``completed_through`` is the highest ticket such that it
    and every earlier one are done, so an offload loop can retire batches in
    order. ``native_stream`` is the cudaStream_t (an int), to order other
    work after the copies (e.g. ``torch.cuda.ExternalStream``).
    """

    def __init__(self, device: int = 0, *, sm_budget: int = DEFAULT_SM_BUDGET,
                 kernel_max_block: int = DEFAULT_KERNEL_MAX_BLOCK, use_batch_api: bool = True):
        self._s = _ferry._CopyStream(device, sm_budget, kernel_max_block, use_batch_api)

    def submit(self, dst, src, sizes) -> int:
        d, s, n = _columns(dst, src, sizes)
        return self._s.submit(d, s, n)

    def poll(self, ticket: int) -> bool:
        return self._s.poll(ticket)

    def wait(self, ticket: int, timeout: float | None = None) -> None:
        """Wait for batch ``ticket``; Timeout after ``timeout`` seconds (the copy goes on)."""
        self._s.wait(ticket, timeout)

    def stats(self) -> dict:
        """Counters: batches, kernel_blocks, engine_blocks, kernel_launches, max_ctas, sms_used."""
        return self._s.stats()

    @property
    def device(self) -> int:
        return self._s.device

    @property
    def options(self) -> dict:
        return self._s.options

    @property
    def completed_through(self) -> int:
        return self._s.completed_through

    @property
    def last_submitted(self) -> int:
        return self._s.last_submitted

    @property
    def native_stream(self) -> int:
        return self._s.native_stream

    def __repr__(self) -> str:
        return (f"CopyStream(device={self.device}, submitted={self.last_submitted}, "
                f"done_through={self.completed_through})")
