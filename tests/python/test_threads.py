"""Several Python threads using one engine at once (the GIL is released in calls)."""
import threading

import numpy as np
import pytest

import ferry


@pytest.fixture()
def pair():
    with ferry.Engine() as a, ferry.Engine() as b:
        yield a, b, a.connect(b.metadata())


def test_parallel_writes_from_threads(pair):
    a, b, peer = pair
    n_threads, size = 4, 4 << 20
    srcs = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(n_threads)]
    dst = np.zeros(n_threads * size, np.uint8)
    dreg = b.register(dst)
    desc = dreg.advertise()
    regs = [a.register(s) for s in srcs]
    errors = []

    def work(i):
        try:
            for _ in range(5):
                peer.write([(regs[i], 0, size)], [(desc, i * size, size)])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for i in range(n_threads):
        assert np.array_equal(dst[i * size:(i + 1) * size], srcs[i])


def test_one_transfer_waited_by_two_threads(pair):
    a, b, peer = pair
    size = 32 << 20
    src = np.ones(size, np.uint8)
    dst = np.zeros(size, np.uint8)
    rs, rd = a.register(src), b.register(dst)
    t = peer.write_async(rs, rd.advertise())
    seen = []
    waiters = [threading.Thread(target=lambda: (t.wait(60), seen.append(t.status))) for _ in range(2)]
    for w in waiters:
        w.start()
    for w in waiters:
        w.join(60)
    assert seen == [ferry.StatusCode.Ok] * 2
    assert dst.all()


def test_close_wakes_a_waiting_thread():
    e = ferry.Engine()
    result = []

    def waiter():
        try:
            e.wait_notifications()
        except ferry.FerryError as exc:
            result.append(exc)

    th = threading.Thread(target=waiter)
    th.start()
    th.join(0.2)
    e.close()
    th.join(10)
    assert not th.is_alive()
    assert result and isinstance(result[0], ferry.Cancelled)
