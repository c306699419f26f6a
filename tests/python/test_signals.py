"""Ctrl-C interrupts blocking waits with KeyboardInterrupt and leaves the engine usable."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

# A child started from a background job inherits SIGINT ignored, and Python
# then installs no KeyboardInterrupt handler: each child restores it first.
RESTORE_CTRL_C = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"

CHILD_WAIT_NOTIFICATIONS = RESTORE_CTRL_C + textwrap.dedent("""
    import sys, numpy as np, ferry
    a, b = ferry.Engine(), ferry.Engine()
    print("waiting", flush=True)
    try:
        b.wait_notifications()          # no timeout: blocks until Ctrl-C
        print("returned?!", flush=True)
        sys.exit(3)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    # the engines still work
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros_like(src)
    rs, rd = a.register(src), b.register(dst)
    peer = a.connect(b.metadata())
    peer.write([(rs, 0, src.size)], [(rd.advertise(), 0, src.size)], notify=b"after")
    assert b.wait_notifications(10) == [(a.id, b"after")]
    assert (dst == src).all()
    print("usable", flush=True)
""")

# The target is stopped (SIGSTOP), so a large write blocks once the socket
# buffers fill; Ctrl-C must interrupt it, cancel it, and leave the engine usable.
TARGET = textwrap.dedent("""
    import sys, numpy as np, ferry
    e = ferry.Engine()
    buf = np.zeros(256 << 20, np.uint8)
    r = e.register(buf)
    print(e.metadata().hex(), r.advertise().hex(), flush=True)
    sys.stdin.read()
""")

CHILD_BLOCKED_WRITE = RESTORE_CTRL_C + textwrap.dedent("""
    import os, signal, sys, time, subprocess, numpy as np, ferry
    target = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    line = target.stdout.readline()
    while line.startswith("["):  # engine log lines
        line = target.stdout.readline()
    meta_hex, desc_hex = line.split()
    meta, desc = bytes.fromhex(meta_hex), bytes.fromhex(desc_hex)
    e = ferry.Engine()
    src = np.ones(256 << 20, np.uint8)
    r = e.register(src)
    peer = e.connect(meta)
    peer.write([(r, 0, 4096)], [(desc, 0, 4096)])
    os.kill(target.pid, signal.SIGSTOP)
    print("blocking", flush=True)
    t0 = time.monotonic()
    try:
        peer.write([(r, 0, 256 << 20)], [(desc, 0, 256 << 20)])
        print("finished-before-interrupt", flush=True)
    except KeyboardInterrupt:
        print("interrupted %.2f" % (time.monotonic() - t0), flush=True)
    os.kill(target.pid, signal.SIGCONT)
    peer.write([(r, 0, 1 << 20)], [(desc, 0, 1 << 20)], timeout=30)
    print("usable", flush=True)
    target.stdin.close()
    target.wait(30)
""")


def _lines(out):
    """stdout lines without the engine's log lines ("[time] [level] ...")."""
    return [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("[")]


def _run_and_interrupt(code, ready_line, delay=0.5, timeout=60, args=()):
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        if line != ready_line:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"child did not get ready: {line!r}\n{out}\n{err}")
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


def test_ctrl_c_interrupts_wait_notifications():
    rc, out, err = _run_and_interrupt(CHILD_WAIT_NOTIFICATIONS, "waiting")
    assert rc == 0, (out, err)
    assert _lines(out) == ["interrupted", "usable"], (out, err)


def test_ctrl_c_interrupts_blocked_write():
    rc, out, err = _run_and_interrupt(CHILD_BLOCKED_WRITE, "blocking", delay=1.0,
                                      args=(TARGET,))
    assert rc == 0, (out, err)
    lines = _lines(out)
    assert lines[0].startswith("interrupted") or lines[0] == "finished-before-interrupt", out
    assert "usable" in out, (out, err)
