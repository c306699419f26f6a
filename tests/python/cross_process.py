"""Marks a process's accesses of its own buffers that another process orders.

A peer process in these tests (peer_proc.py, the servers of the compat tests)
reads or fills the buffers it registered when the test, in the parent, tells it
to over a multiprocessing Pipe: "dump" after the parent's write into them has
completed, "fill" before the parent reads them. What orders those accesses after
(or before) the copies that Ferry's threads made into (or out of) the same
buffers on the parent's behalf is the parent: it saw its transfer complete, then
sent the command. ThreadSanitizer watches one process at a time and cannot see
that order, so under it (ferry.sh, run_tsan_python_tests) it would report a race
between the peer's own thread and the copy thread, for every 8 bytes of the
buffer, each one matched against tests/tsan.supp: minutes for a MiB.

`ordered_by_peer()` hides the accesses made inside it from ThreadSanitizer
(__tsan_ignore_thread_begin/_end, found in the process when libtsan is loaded);
elsewhere it does nothing. It is the Python tests' counterpart of the C++ tests'
itest::HashBytes and itest::MatchesPattern, which are built without
instrumentation for the same reason. Only a peer's reads and writes of its own
registered buffers on such a command belong inside it; the engine's calls never.
"""
from __future__ import annotations

import contextlib
import ctypes

try:
    _process = ctypes.CDLL(None)
    _begin = _process.__tsan_ignore_thread_begin
    _end = _process.__tsan_ignore_thread_end
except (OSError, AttributeError):  # not under ThreadSanitizer
    _begin = _end = None


@contextlib.contextmanager
def ordered_by_peer():
    if _begin is None:
        yield
        return
    _begin()
    try:
        yield
    finally:
        _end()


def dump(bufs):
    """The bytes of each buffer, read on a peer's command (see above)."""
    with ordered_by_peer():
        return [b.tobytes() for b in bufs]
