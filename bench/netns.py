"""Two network namespaces joined by a veth pair: the closest thing to two hosts on
one machine. A (ferryabA, fvabA, 10.78.78.1) holds the target side, B (ferryabB,
fvabB, 10.78.78.2) the initiator side; 10.78.78.0/24 exists on the veth only, inside
the two namespaces (no route of the host's can collide with it). Not link-local
169.254/16: UCX's tcp transport ignores interfaces with only such an address.
Needs root and iproute2. Used by bench/tcp_ab.py and bench/peers/bench.py.

    import netns
    try:
        netns.up()
        subprocess.run(netns.prefix("netns", netns.TARGET) + [...])
    finally:
        netns.down()  # always: a namespace left behind keeps its veth
"""
from __future__ import annotations

import subprocess

NS = ("ferryabA", "ferryabB")
VETH = ("fvabA", "fvabB")
ADDR = ("10.78.78.1", "10.78.78.2")
TARGET, INITIATOR = 0, 1  # side 0: target / server in A; side 1: initiator / client in B


def sh(*argv, check=True):
    return subprocess.run(argv, capture_output=True, text=True, check=check)


def up():
    """Both namespaces, the veth pair between them and its addresses (any left over
    from an interrupted run are deleted first)."""
    down()
    try:
        for ns in NS:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
        for i in range(2):
            sh("ip", "link", "set", VETH[i], "netns", NS[i])
            sh("ip", "-n", NS[i], "addr", "add", ADDR[i] + "/24", "dev", VETH[i])
            sh("ip", "-n", NS[i], "link", "set", VETH[i], "up")
            sh("ip", "-n", NS[i], "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        down()
        raise RuntimeError(f"netns: `{' '.join(e.cmd)}` failed: {e.stderr.strip()} "
                           "(needs root and iproute2)") from e


def down():
    """Deletes both namespaces (and with them the veth pair); quiet when absent."""
    for ns in NS:
        sh("ip", "netns", "del", ns, check=False)


def prefix(place, side):
    """The command prefix that runs a process of `side` at `place` (loopback: none)."""
    return ["ip", "netns", "exec", NS[side]] if place == "netns" else []


def addr(place, side):
    return ADDR[side] if place == "netns" else "127.0.0.1"
