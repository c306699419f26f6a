"""Symmetric GPU memory and MoE dispatch/combine over NVLink, from torch.

A group of processes on one host (one GPU each) allocates buffers of the same
size, exchanges small "cards" (bytes) any way it likes -- by default through
``torch.distributed.all_gather_object`` -- and then reaches every member's
buffer from kernels (Ferry's ``include/ferry/device.cuh``, or your own CUDA or
Triton kernels through ``peer_pointers``)::

    import torch, torch.distributed as dist
    from ferry.symmetric import SymmetricMemory, MoeExchange

    mem = SymmetricMemory(1 << 30, rank=dist.get_rank(), size=dist.get_world_size())
    mem.data                # torch.uint8 tensor over this member's buffer (DLPack)
    mem.peer_pointers       # torch.int64 tensor [size]: each member's buffer as mapped here

    moe = MoeExchange(max_tokens=4096, hidden=7168, top_k=8, experts_per_rank=8,
                      rank=dist.get_rank(), size=dist.get_world_size())
    recv_x, recv_count, recv_src = moe.dispatch(x, topk_idx, topk_weights)  # bf16 [E, size*T, H]
    out = moe.combine(expert_outputs)                          # bf16 [T, H]

Every call is ordered on the current torch stream (or ``stream=``) of the
member's GPU and returns without waiting. See docs/device_api.md.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from . import _ferry

__all__ = ["SymmetricMemory", "MoeExchange", "moe_layout", "exchange_by_torch_distributed"]


def _torch():
    import torch  # imported on use: the package itself does not need torch

    return torch


def exchange_by_torch_distributed(card: bytes, group=None) -> List[bytes]:
    """All members' cards by rank, through torch.distributed (any backend)."""
    import torch.distributed as dist

    out: List[Optional[bytes]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, card, group=group)
    return [bytes(c) for c in out]  # type: ignore[arg-type]


def _stream_handle(stream, device: int) -> int:
    torch = _torch()
    if stream is None:
        stream = torch.cuda.current_stream(device)
    return int(stream.cuda_stream)


class SymmetricMemory:
    """This member's symmetric buffer, joined to the group on construction.

    ``exchange(card) -> [card of member 0, card of member 1, ...]`` delivers the
    cards; ``None`` uses torch.distributed. Raises ferry.InvalidArgument when the
    members' sizes differ or a member is on another host, ferry.NotSupported
    when a GPU pair has no peer access or a member's GPU is not visible here.
    """

    def __init__(
        self,
        data_bytes: int,
        *,
        rank: int,
        size: int,
        device: Optional[int] = None,
        signal_slots: int = 64,
        wait_timeout_s: float = 10.0,
        exchange: Optional[Callable[[bytes], Sequence[bytes]]] = None,
    ):
        torch = _torch()
        if device is None:
            device = torch.cuda.current_device()
        self._native = _ferry._SymmetricMemory(
            data_bytes, rank, size, device, signal_slots, max(1, int(wait_timeout_s * 1e9))
        )
        cards = (exchange or exchange_by_torch_distributed)(self._native.card())
        self._native.join(list(cards))
        self.device = device
        self.rank = rank
        self.size = size
        self.data_bytes = data_bytes
        self.signal_slots = signal_slots
        # Views made once; each keeps the native object alive through DLPack.
        self.data = torch.utils.dlpack.from_dlpack(self._native._data_dlpack())
        self.signals = torch.utils.dlpack.from_dlpack(self._native._signals_dlpack())
        self.peer_pointers = torch.utils.dlpack.from_dlpack(
            self._native._peer_pointers_dlpack(signals=False)
        )
        self.peer_signal_pointers = torch.utils.dlpack.from_dlpack(
            self._native._peer_pointers_dlpack(signals=True)
        )

    @property
    def team_ptr(self) -> int:
        """Device address of the ferry::DeviceTeam (include/ferry/device_team.h)."""
        return self._native.team_ptr

    def peer_data_addresses(self) -> List[int]:
        return self._native.peer_data()

    def view(self, dtype, shape: Sequence[int], offset: int = 0):
        """A tensor of `dtype` and `shape` over this member's data at byte `offset`."""
        torch = _torch()
        n = 1
        for s in shape:
            n *= int(s)
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + nbytes > self.data_bytes:
            from ._errors import OutOfRange

            raise OutOfRange(
                f"symmetric: a view of {nbytes} bytes at offset {offset} ends past the "
                f"{self.data_bytes} data bytes"
            )
        return self.data[offset : offset + nbytes].view(dtype).view(*shape)

    # The device operations posted from the host (ordered on the stream).
    def put(self, peer: int, dst_offset: int, src, stream=None) -> None:
        """Copies tensor `src` (this member's GPU) into member `peer`'s data at dst_offset."""
        _check_cuda_tensor(src, "src", self.device)
        self._native.put(
            peer, dst_offset, src.data_ptr(), src.numel() * src.element_size(),
            _stream_handle(stream, self.device),
        )

    def signal(self, peer: int, slot: int, value: int, *, add: bool = False, stream=None) -> None:
        self._native.signal(peer, slot, value, add, _stream_handle(stream, self.device))

    def wait(self, slot: int, at_least: int, *, timeout_s: float = 0.0, stream=None) -> None:
        """The stream waits until this member's slot >= at_least (timeout: check_device_error)."""
        self._native.wait(slot, at_least, _stream_handle(stream, self.device),
                          int(timeout_s * 1e9))

    def barrier(self, stream=None) -> None:
        self._native.barrier(_stream_handle(stream, self.device))

    def read_signal(self, slot: int) -> int:
        return self._native.read_signal(slot)

    def check_device_error(self) -> None:
        """Raises the first error a device call recorded (ferry.Timeout for a wait)."""
        self._native.check_device_error()

    def clear_device_error(self) -> None:
        self._native.clear_device_error()


def _check_cuda_tensor(t, name: str, device: int, dtype=None, shape=None) -> None:
    torch = _torch()
    from ._errors import InvalidArgument

    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cuda" or t.device.index != device:
        raise InvalidArgument(f"{name} is on {t.device}, expected cuda:{device}")
    if not t.is_contiguous():
        raise InvalidArgument(f"{name} must be contiguous")
    if dtype is not None and t.dtype != dtype:
        raise InvalidArgument(f"{name} has dtype {t.dtype}, expected {dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise InvalidArgument(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def moe_layout(*, max_tokens: int, hidden: int, top_k: int, experts_per_rank: int,
               members: int) -> dict:
    """Offsets and sizes the exchange needs in a symmetric buffer (bytes, slots)."""
    return _ferry._moe_layout(max_tokens, hidden, top_k, experts_per_rank, members)


class MoeExchange:
    """Low-latency MoE dispatch and combine (include/ferry/moe.h) over NVLink.

    Global expert e lives on member e // experts_per_rank. Calls alternate
    dispatch, combine, dispatch, ... and every member makes the same calls.

    A call of at most 8 tokens (``moe_layout(...)["ll_tokens"]``, a decode step's) takes
    the low-latency path: its rows travel in stores that carry their own
    completion flag, with no fence or separate signal, and it launches at most
    8 blocks. Larger calls stage each token's row once per member, flagged per
    group of 32 vectors, so that receivers copy each group as it lands. Members
    whose calls differ widely in size stay correct, but the small ones then
    receive the others' rows slowly. A peer that stops sending
    shows as ``ferry.Timeout`` from ``memory.check_device_error()`` after
    ``wait_timeout_s``, naming it.
    """

    def __init__(
        self,
        *,
        max_tokens: int,
        hidden: int,
        top_k: int,
        experts_per_rank: int,
        rank: int,
        size: int,
        device: Optional[int] = None,
        sm_count: int = 0,
        wait_timeout_s: float = 10.0,
        exchange: Optional[Callable[[bytes], Sequence[bytes]]] = None,
    ):
        torch = _torch()
        layout = moe_layout(max_tokens=max_tokens, hidden=hidden, top_k=top_k,
                            experts_per_rank=experts_per_rank, members=size)
        self.memory = SymmetricMemory(
            layout["data_bytes"], rank=rank, size=size, device=device,
            signal_slots=layout["signal_slots"], wait_timeout_s=wait_timeout_s, exchange=exchange,
        )
        self.device = self.memory.device
        self.max_tokens, self.hidden, self.top_k = max_tokens, hidden, top_k
        self.experts_per_rank = experts_per_rank
        self.layout = layout
        self._native = _ferry._MoeExchange(
            self.memory._native, max_tokens, hidden, top_k, experts_per_rank, sm_count
        )
        E, W, T, H = experts_per_rank, size, max_tokens, hidden
        self.recv_x = self.memory.view(torch.bfloat16, (E, W * T, H), layout["recv_x_offset"])
        self.recv_src = self.memory.view(torch.int32, (E, W * T), layout["recv_src_offset"])
        self.recv_count = torch.utils.dlpack.from_dlpack(self._native._recv_count_dlpack())

    def dispatch(self, x, topk_idx, topk_weights, *, stream=None) -> Tuple[object, object, object]:
        """x: bf16 [T, hidden]; topk_idx: int64 [T, top_k] (-1: none); topk_weights:
        float32 [T, top_k] (travel with the tokens; combine uses them); T <= max_tokens.

        Returns (recv_x bf16 [experts_per_rank, size * max_tokens, hidden],
        recv_count int32 [experts_per_rank, size], recv_src int32
        [experts_per_rank, size * max_tokens]): rows of (local expert e, source
        member s) are recv_x[e, s * max_tokens : s * max_tokens + recv_count[e, s]],
        in arrival order; recv_src names each row's token at its source.
        """
        torch = _torch()
        if x.dim() != 2:
            from ._errors import InvalidArgument

            raise InvalidArgument(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
        T = x.shape[0]
        _check_cuda_tensor(x, "x", self.device, torch.bfloat16, (T, self.hidden))
        _check_cuda_tensor(topk_idx, "topk_idx", self.device, torch.int64, (T, self.top_k))
        _check_cuda_tensor(topk_weights, "topk_weights", self.device, torch.float32,
                           (T, self.top_k))
        self._native.dispatch(x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr(), T,
                              _stream_handle(stream, self.device))
        return self.recv_x, self.recv_count, self.recv_src

    def combine(self, y, *, out=None, stream=None):
        """y: bf16 like recv_x (the experts' outputs for the dispatch before).
        Returns out: bf16 [T, hidden] (T: that dispatch's tokens), each token's
        sum of weight x expert output over its choices: every member sums its
        own experts' rows in fp32 and returns one bf16 row per token; the source
        adds those and its own experts' rows in fp32."""
        torch = _torch()
        T = self._native.dispatched_tokens
        _check_cuda_tensor(y, "y", self.device, torch.bfloat16, tuple(self.recv_x.shape))
        if out is None:
            out = torch.empty((T, self.hidden), dtype=torch.bfloat16,
                              device=f"cuda:{self.device}")
        _check_cuda_tensor(out, "out", self.device, torch.bfloat16, (T, self.hidden))
        self._native.combine(y.data_ptr(), out.data_ptr(), _stream_handle(stream, self.device))
        return out
