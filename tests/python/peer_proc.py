"""A Ferry engine in a child process, driven over a multiprocessing Pipe.

Used by the two-process tests: the child owns buffers filled with seeded random
data, advertises them, and answers commands (read back a buffer, wait for a
notification, deregister, write into the parent, exit).
"""
from __future__ import annotations

import multiprocessing as mp
import traceback

import numpy as np

from cross_process import ordered_by_peer

CTX = mp.get_context("spawn")


def _serve(conn, listen, options):
    import ferry

    engine = ferry.Engine(listen, options=options)
    regions, bufs = {}, {}
    conn.send(("ready", engine.metadata(), engine.listen_address, engine.id))
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "alloc":  # name, size, seed, access -> descriptor
                name, size, seed, access = args
                buf = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
                bufs[name] = buf
                regions[name] = engine.register(buf)
                conn.send(("ok", regions[name].advertise(access=access)))
            elif cmd == "advertise":  # name, offset, length, access -> descriptor
                name, offset, length, access = args
                conn.send(("ok", regions[name].advertise(offset, length, access=access)))
            elif cmd == "get":
                with ordered_by_peer():
                    data = bufs[args[0]].tobytes()
                conn.send(("ok", data))
            elif cmd == "fill":  # name, seed
                name, seed = args
                data = np.random.default_rng(seed).integers(0, 256, bufs[name].size,
                                                            dtype=np.uint8)
                with ordered_by_peer():
                    bufs[name][:] = data
                conn.send(("ok", None))
            elif cmd == "dereg":
                regions[args[0]].deregister()
                conn.send(("ok", None))
            elif cmd == "wait_notes":  # count, timeout -> [(peer, bytes)]
                count, timeout = args
                notes = []
                import time
                deadline = time.monotonic() + timeout
                while len(notes) < count and time.monotonic() < deadline:
                    notes += engine.wait_notifications(max(0.0, deadline - time.monotonic()))
                conn.send(("ok", notes))
            elif cmd == "peers":
                conn.send(("ok", engine.peers()))
            elif cmd == "write_back":  # metadata, desc, data -> writes `data` into the parent
                meta, desc, data = args
                src = np.frombuffer(bytearray(data), dtype=np.uint8)
                with engine.register(src) as r:
                    engine.connect(meta).write([(r, 0, len(data))], [(desc, 0, len(data))],
                                               notify=b"written-back")
                conn.send(("ok", None))
            elif cmd == "notify_n":  # metadata, payloads -> notifies the parent with each
                meta, payloads = args
                peer = engine.connect(meta)
                for payload in payloads:
                    peer.notify(payload)
                conn.send(("ok", None))
            elif cmd == "exit":
                engine.close()
                conn.send(("ok", None))
                return
            else:
                conn.send(("error", f"unknown command {cmd}"))
        except Exception as exc:  # report to the parent, keep serving
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class PeerProcess:
    """Handle to the child: `call(cmd, *args)` returns the answer or raises."""

    def __init__(self, listen="127.0.0.1:0", options=None, timeout=60):
        self.timeout = timeout
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=_serve, args=(child, listen, options or {}), daemon=True)
        self.proc.start()
        child.close()
        tag, self.metadata, self.listen_address, self.engine_id = self._recv()
        assert tag == "ready"

    def _recv(self):
        if not self.conn.poll(self.timeout):
            raise TimeoutError("peer process did not answer in time")
        return self.conn.recv()

    def call(self, cmd, *args):
        self.conn.send((cmd, *args))
        tag, value = self._recv()
        if tag != "ok":
            raise RuntimeError(f"peer process: {value}")
        return value

    def close(self):
        if self.proc.is_alive():
            try:
                self.call("exit")
            except Exception:
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def kill(self):
        self.proc.kill()
        self.proc.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def expected(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
