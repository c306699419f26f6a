"""Two NIXL agents on the FERRY backend plugin, one per process, through NIXL's
own Python API (the `nixl` wheel from PyPI, not ferry.compat.nixl).

    NIXL_PLUGIN_DIR=build/nixl_plugins python two_peers.py --role target --port P
    NIXL_PLUGIN_DIR=build/nixl_plugins python two_peers.py --role initiator --port P

Metadata goes over NIXL's listener sockets; the bytes over Ferry. The initiator
READs the target's random bytes in 64 shuffled pieces (with a notification),
WRITEs its own random bytes into the target (with a notification, after which
the target checks every byte), reposts the READ, then checks that the backend
refuses what it must: metadata whose Ferry descriptor was changed, a READ of
memory the target deregistered, backend parameters FERRY does not know, and a
WRITE to the target after its process exited. Prints PASS on success; any failure raises.
"""

import argparse
import os
import pickle
import struct
import sys
import time

import numpy as np

import nixl._api as nixl_api
from nixl._api import nixl_agent, nixl_agent_config

SIZE = 4 << 20
PIECES = 64
DEADLINE_S = 60


def log(role, msg):
    print(f"[{role}] {msg}", flush=True)


def wait_for(what, predicate, timeout=DEADLINE_S):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.001)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


def expect_notif(agent, sender, expected, received):
    """Waits for the next notification from `sender`, which must be `expected`."""

    def poll():
        for name, msgs in agent.get_new_notifs().items():
            received.setdefault(name, []).extend(msgs)
        return bool(received.get(sender))

    wait_for(f"notification {expected!r} from {sender}", poll)
    got = received[sender].pop(0)
    if expected is not None and got != expected:
        raise AssertionError(f"notification from {sender}: expected {expected!r}, got {got!r}")
    return got


def make_agent(name, port):
    config = nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=True, listen_port=port, backends=["FERRY"]
    )
    agent = nixl_agent(name, config)
    plugins = agent.get_plugin_list()
    if "FERRY" not in plugins:
        raise AssertionError(
            f"NIXL found no FERRY plugin (plugins {plugins}, "
            f"NIXL_PLUGIN_DIR={os.environ.get('NIXL_PLUGIN_DIR')})"
        )
    if "FERRY" not in agent.backends:
        raise AssertionError("NIXL did not create the FERRY backend (see its log above)")
    mems = agent.get_backend_mem_types("FERRY")
    if not {"DRAM_SEG", "VRAM_SEG"} <= set(mems):
        raise AssertionError(f"FERRY backend memory types: {mems}")
    return agent


def descs_of(array):
    """Registration descriptors (address, length, device, meta) of an array."""
    return [(array.ctypes.data, array.nbytes, 0, "")]


def xfer_descs_of(array):
    return [(array.ctypes.data, array.nbytes, 0)]


def target(args, rng_read, rng_write):
    agent = make_agent("target", args.port)
    readable = rng_read.integers(0, 256, SIZE, dtype=np.uint8)
    writable = np.zeros(SIZE, dtype=np.uint8)
    reg_read = agent.register_memory(agent.get_reg_descs(descs_of(readable), "DRAM"))
    agent.register_memory(agent.get_reg_descs(descs_of(writable), "DRAM"))
    expected_write = rng_write.integers(0, 256, SIZE, dtype=np.uint8)

    wait_for("the initiator's metadata", lambda: agent.check_remote_metadata("initiator"))
    offer = (
        agent.get_serialized_descs(agent.get_xfer_descs(xfer_descs_of(readable), "DRAM")),
        agent.get_serialized_descs(agent.get_xfer_descs(xfer_descs_of(writable), "DRAM")),
        agent.get_agent_metadata(),
    )
    agent.send_notif("initiator", pickle.dumps(offer))
    log("target", "sent its descriptors")

    received = {}
    expect_notif(agent, "initiator", b"read-done", received)
    expect_notif(agent, "initiator", b"write-done", received)
    # The WRITE's notification comes after every byte of the write is placed.
    if not np.array_equal(writable, expected_write):
        bad = int(np.argmax(writable != expected_write))
        raise AssertionError(f"written bytes differ from byte {bad} on")
    log("target", f"all {SIZE} written bytes verified after the WRITE's notification")
    expect_notif(agent, "initiator", b"read-again", received)

    agent.deregister_memory(reg_read)
    agent.send_notif("initiator", b"deregistered")
    expect_notif(agent, "initiator", b"bye", received)
    # Exits with `writable` registered: the initiator's next WRITE finds it gone.
    log("target", "PASS")
    os._exit(0)


def initiator(args, rng_read, rng_write):
    agent = make_agent("initiator", 0)
    expected_read = rng_read.integers(0, 256, SIZE, dtype=np.uint8)
    landing = np.zeros(SIZE, dtype=np.uint8)
    source = rng_write.integers(0, 256, SIZE, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs(descs_of(landing), "DRAM"))
    agent.register_memory(agent.get_reg_descs(descs_of(source), "DRAM"))

    agent.send_local_metadata("127.0.0.1", args.port)
    agent.fetch_remote_metadata("target", "127.0.0.1", args.port)
    wait_for("the target's metadata", lambda: agent.check_remote_metadata("target"))
    received = {}
    # The target's first notification may come before its metadata did.
    offer = pickle.loads(expect_notif(agent, "target", None, received))
    remote_read = agent.deserialize_descs(offer[0])
    remote_write = agent.deserialize_descs(offer[1])
    read_base, write_base = remote_read[0][0], remote_write[0][0]
    check_tampered_metadata(offer[2], read_base)

    # READ in 64 pieces, local piece i <- remote piece perm[i].
    piece = SIZE // PIECES
    perm = np.random.default_rng(args.seed + 2).permutation(PIECES)
    local = [(landing.ctypes.data + i * piece, piece, 0) for i in range(PIECES)]
    remote = [(read_base + int(p) * piece, piece, 0) for p in perm]
    read = agent.initialize_xfer(
        "READ",
        agent.get_xfer_descs(local, "DRAM"),
        agent.get_xfer_descs(remote, "DRAM"),
        "target",
        b"read-done",
    )
    run(agent, read)
    want = expected_read.reshape(PIECES, piece)[perm].reshape(-1)
    if not np.array_equal(landing, want):
        raise AssertionError(f"read bytes differ from byte {int(np.argmax(landing != want))} on")
    log("initiator", f"READ of {PIECES} shuffled pieces: all {SIZE} bytes verified")

    write = agent.initialize_xfer(
        "WRITE",
        agent.get_xfer_descs(xfer_descs_of(source), "DRAM"),
        agent.get_xfer_descs([(write_base, SIZE, 0)], "DRAM"),
        "target",
        b"write-done",
    )
    run(agent, write)
    agent.release_xfer_handle(write)

    landing[:] = 0
    run(agent, read, b"read-again")  # a prepared request, posted again
    if not np.array_equal(landing, want):
        raise AssertionError("reposted READ: bytes differ")
    log("initiator", "reposted READ verified")

    # Refusals: the target deregisters the region the READ names.
    expect_notif(agent, "target", b"deregistered", received)
    state = "PROC"
    error = None
    try:
        state = agent.transfer(read)
        while state == "PROC":
            state = agent.check_xfer_state(read)
    except Exception as e:  # NIXL's binding raises nixl<Code>Error for some codes
        if not type(e).__name__.startswith("nixl"):
            raise
        error = e
    if error is None and state != "ERR":
        raise AssertionError(f"READ of a deregistered region ended {state!r}, not an error")
    log("initiator", f"READ of the deregistered region refused: {state} {error!r}")
    agent.release_xfer_handle(read)

    for n, params in enumerate(({"bogus": "1"}, {"tcp.streams": "banana"})):
        try:
            other = nixl_agent(f"bad-parameters-{n}", nixl_agent_config(backends=[]))
            other.create_backend("FERRY", params)
        except Exception as e:  # NIXL's binding: nixlBackendError
            log("initiator", f"backend parameters {params} refused: {e!r}")
        else:
            raise AssertionError(f"backend parameters {params} were accepted")

    agent.send_notif("target", b"bye")
    check_dead_peer(agent, source, write_base)
    log("initiator", "PASS")


def check_tampered_metadata(metadata, read_base):
    """The target's metadata with one byte of a region's Ferry descriptor changed
    (its address, which the descriptor's checksum covers): loadRemoteMD refuses it."""
    address = struct.pack("<Q", read_base)
    at = metadata.find(address)
    while at >= 0 and metadata[at - 24 : at - 22] != b"FD":
        at = metadata.find(address, at + 1)
    if at < 0:
        raise AssertionError("no Ferry descriptor of the target's region in its metadata")
    tampered = bytearray(metadata)
    tampered[at] ^= 0x40
    other = make_agent("tamper-check", 0)
    try:
        other.add_remote_agent(bytes(tampered))
    except Exception as e:
        log("initiator", f"metadata with a changed descriptor refused: {e!r}")
    else:
        raise AssertionError("metadata with a changed Ferry descriptor was accepted")


def check_dead_peer(agent, source, write_base):
    """WRITEs until the target's process is gone: then posting fails, not hangs."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        try:
            handle = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(xfer_descs_of(source), "DRAM"),
                agent.get_xfer_descs([(write_base, SIZE, 0)], "DRAM"),
                "target",
            )
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
        except Exception as e:
            if not type(e).__name__.startswith("nixl"):
                raise
            log("initiator", f"WRITE to the exited target refused: {e!r}")
            return
        if state != "DONE":
            log("initiator", f"WRITE to the exited target ended {state}")
            return
        agent.release_xfer_handle(handle)
        time.sleep(0.05)
    raise AssertionError("WRITEs to the target still succeed after it exited")


def run(agent, handle, notif=b""):
    state = agent.transfer(handle, notif) if notif else agent.transfer(handle)
    end = time.monotonic() + DEADLINE_S
    while state == "PROC":
        if time.monotonic() > end:
            raise TimeoutError("transfer did not finish")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise AssertionError(f"transfer ended {state}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["target", "initiator"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    args = parser.parse_args()
    log(args.role, f"seed {args.seed}, nixl from {nixl_api.__file__}")
    rng_read = np.random.default_rng(args.seed)
    rng_write = np.random.default_rng(args.seed + 1)
    (target if args.role == "target" else initiator)(args, rng_read, rng_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
