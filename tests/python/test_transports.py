"""Which transport carries what to a peer, and why: Engine.transports(),
Engine.peer_transports(), Peer.transports(), and forcing tcp by option."""
import os

import numpy as np
import pytest

import ferry
from peer_proc import PeerProcess

MiB = 1 << 20


def running(engine):
    return [t["name"] for t in engine.transports() if t["running"]]


@pytest.fixture(scope="module")
def target():
    with PeerProcess() as p:
        yield p


def routes_by_name(peer):
    return {r["transport"]: r for r in peer.transports()}


def test_engine_lists_its_transports_with_reasons():
    with ferry.Engine() as e:
        listed = e.transports()
        assert {"tcp", "shm"} <= {t["name"] for t in listed}
        for t in listed:
            assert set(t) == {"name", "running", "same_host_only", "detail", "counters"}
            assert t["detail"], f"{t['name']} gives no address or reason"
            assert all(isinstance(v, int) for v in t["counters"].values()), t
            if not t["running"]:
                assert t["counters"] == {}, t
        tcp = next(t for t in listed if t["name"] == "tcp")
        assert tcp["running"] and not tcp["same_host_only"]
        assert tcp["counters"] == {"fence_held_requests": 0}, tcp


def test_same_host_peer_gets_shm_for_host_memory_and_data_moves(target):
    forced = os.environ.get("FERRY_ENGINE_TRANSPORTS", "auto")
    with ferry.Engine() as e:
        if forced != "auto" or "shm" not in running(e):
            pytest.skip(f"shm does not run here: {e.transports()}")
        peer = e.connect(target.metadata)
        routes = routes_by_name(peer)
        assert routes["shm"]["connected"], routes
        assert routes["shm"]["carries"] == "host memory", routes
        assert "shm carries host memory" in routes["tcp"]["reason"], routes
        # How shm reaches the peer: its mode (cross-memory attach, or staging and why).
        shm_mode = os.environ.get("FERRY_SHM_MODE", "auto")
        expect = "shared memory" if shm_mode == "staging" else "cross-memory attach"
        assert expect in routes["shm"]["via"], routes
        assert e.peer_transports(peer.id) == peer.transports()
        rng = np.random.default_rng(7)
        src = rng.integers(0, 256, 2 * MiB, dtype=np.uint8)
        region = e.register(src)
        desc = target.call("alloc", "t1", 2 * MiB, 3, "rw")
        peer.write([(region, 0, 2 * MiB)], [(desc, 0, 2 * MiB)])
        got = np.frombuffer(target.call("get", "t1"), dtype=np.uint8)
        assert np.array_equal(got, src)


def test_forcing_tcp_by_option(target):
    with ferry.Engine(engine_transports="tcp") as e:
        assert running(e) == ["tcp"]
        peer = e.connect(target.metadata)
        routes = peer.transports()
        assert [r["transport"] for r in routes] == ["tcp"]
        assert "host" in routes[0]["carries"]


def test_unknown_transport_name_is_invalid_argument():
    with pytest.raises(ferry.InvalidArgument, match="'warp'"):
        ferry.Engine(engine_transports="tcp,warp")


def test_unknown_peer_is_not_found():
    with ferry.Engine() as e:
        with pytest.raises(ferry.NotFound, match="never connected"):
            e.peer_transports(0x1234)
