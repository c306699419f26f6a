"""A NIXL transfer request on Ferry: the descriptor pairs of one READ or WRITE to
one remote agent, checked and built once as one Ferry prepared transfer (local
side by address, so a request may span every layer of a KV cache registered
region by region), posted by ``transfer`` as often as the caller likes, polled
by ``check_xfer_state``.

Notifications keep NIXL's promise -- the target sees the message only after
every byte of the transfer is in place: a WRITE carries the message itself
(Ferry delivers it after the data); a READ sends it as a standalone
notification once the read has completed, at the ``transfer`` or
``check_xfer_state`` call that sees the completion (NIXL with its progress
thread off does the same).
"""
from __future__ import annotations

import time

import numpy as np

from ... import _errors, _ferry
from ._types import (
    nixl_status_t,
    nixl_xfer_op_t,
    nixlNotPostedError,
    nixlRepostActiveError,
    from_ferry,
)

_IN_PROG = nixl_status_t.NIXL_IN_PROG
_SUCCESS = nixl_status_t.NIXL_SUCCESS
_OK = _ferry.StatusCode.Ok
# The wall clock at one instant of perf_counter: telemetry's startTime without a
# time.time_ns() call per post.
_EPOCH_NS, _PERF_NS = time.time_ns(), time.perf_counter_ns()


class nixlXferTelemetry:
    """What NIXL reports per transfer: times in microseconds (``startTime`` since
    the epoch), bytes, descriptors."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime=0, postDuration=0, xferDuration=0, totalBytes=0, descCount=0):
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self) -> str:
        return (f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
                f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, "
                f"descCount={self.descCount})")


class XferRequest:
    """Built by the agent (``initialize_xfer`` / ``make_prepped_xfer``)."""

    def __init__(self, agent, op, remote: str, peer, local_addresses, lengths, remote_descs,
                 remote_index, remote_offsets, notif: bytes):
        self.agent = agent
        self.op = nixl_xfer_op_t(op)
        self.remote = remote
        self.peer = peer
        self.notif = notif
        self.desc_count = int(lengths.size)
        self.total_bytes = int(lengths.sum())
        self._transfer = None          # the Ferry transfer of the last post
        self._pending_notif = None     # a READ's notification, sent once it completed
        self._framed = None            # self.notif with the sender's name, built once
        self._posted = False
        self._done = False
        self._error = None
        self._t_post_ns = 0
        self._t0 = 0
        self._t_done_ns = 0
        self._is_write = self.op == nixl_xfer_op_t.NIXL_WRITE
        # Times are taken only for an agent that reports telemetry: three clock
        # reads a post are a tenth of the layer's cost on a 4 KiB write.
        self._timed = agent.telemetry
        prepare = peer.prepare_write if self._is_write else peer.prepare_read
        try:
            # region=None: the local column is addresses (checked against this
            # agent's registrations already; the engine checks them again per post).
            self._part = prepare(None, local_addresses, remote_descs,
                                 remote_index.astype(np.uint32), remote_offsets, lengths)
        except _errors.FerryError as exc:
            raise from_ferry(exc, f"preparing {self.describe()}") from None

    def describe(self) -> str:
        return (f"{self.op.name[5:]} of {self.desc_count} descriptor(s), {self.total_bytes} bytes, "
                f"with agent '{self.remote}'")

    @property
    def active(self) -> bool:
        return self._posted and not self._done and self._error is None

    def post(self, notif: bytes) -> nixl_status_t:
        if self._posted and not self._done and self._error is None:
            if not self._transfer.done():
                raise nixlRepostActiveError(f"{self.describe()} is still in progress; wait for "
                                            "DONE (check_xfer_state) before posting it again")
            self._finish()  # it completed; settle it before the new post
        if notif and notif != self.notif:
            self.notif, self._framed = notif, None  # transfer()'s message replaces the request's
        if self._framed is None and self.notif:
            self._framed = self.agent.frame_notif(self.notif)
        self._posted, self._done, self._error = True, False, None
        if self._timed:
            self._t0 = time.perf_counter_ns()  # startTime derives from it (telemetry())
        try:
            # Positional, and only with a message: nanobind parses no keywords then.
            if self._is_write and self._framed is not None:
                self._transfer = self._part.post(self._framed)
            else:
                self._transfer = self._part.post()
                if not self._is_write:
                    self._pending_notif = self._framed
        except _errors.FerryError as exc:
            self._error = from_ferry(exc, f"posting {self.describe()}")
            raise self._error from None
        finally:
            if self._timed:
                self._t_post_ns = time.perf_counter_ns() - self._t0
        if self._transfer.done():
            self._finish()
            return _SUCCESS
        return _IN_PROG

    def status(self) -> nixl_status_t:
        if self._done:
            return _SUCCESS
        if self._error is not None:
            raise self._error
        if not self._posted:
            raise nixlNotPostedError(f"{self.describe()} was never posted (call transfer first)")
        if not self._transfer.done():
            return _IN_PROG
        self._finish()
        return _SUCCESS

    def _finish(self) -> None:
        """The transfer has completed: raise its failure, else send the
        notification that had to wait for the data."""
        if self._timed:
            self._t_done_ns = time.perf_counter_ns() - self._t0
        try:
            if self._transfer.status != _OK:
                self._transfer.wait(0)  # raises the failure with its message
        except _errors.FerryError as exc:
            self._error = from_ferry(exc, f"{self.describe()} failed")
            raise self._error from None
        if self._pending_notif is not None:
            msg, self._pending_notif = self._pending_notif, None
            try:
                self.peer.notify(msg)
            except _errors.FerryError as exc:
                self._error = from_ferry(exc, f"{self.describe()} completed, but its notification "
                                              "could not be sent")
                raise self._error from None
        self._done = True

    def cancel(self) -> None:
        """Release: a running transfer is cancelled; one that completed unobserved
        still sends its READ notification (the target may be waiting for it)."""
        t = self._transfer
        if t is not None and self.active:
            if t.done():
                try:
                    self._finish()
                except Exception:
                    pass  # released: nobody asks for its failure any more
            else:
                t.cancel()
        self._transfer = None
        self._posted = False

    def telemetry(self) -> nixlXferTelemetry:
        # Whole microseconds, rounded up: a posted request never reports 0.
        post_us = -(-self._t_post_ns // 1000)
        xfer_us = -(-self._t_done_ns // 1000) if self._done else 0
        start_us = (_EPOCH_NS + self._t0 - _PERF_NS) // 1000 if self._posted else 0
        return nixlXferTelemetry(start_us, post_us, xfer_us, self.total_bytes, self.desc_count)
