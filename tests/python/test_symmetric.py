"""ferry.symmetric from torch: two member processes (one GPU each, spawned),
cards exchanged through torch.distributed (gloo). Symmetric buffers as torch
tensors (DLPack), peer pointers as a tensor, the host-posted operations, a
timeout read back as ferry.Timeout, and MoE dispatch/combine against a torch
reference: exact for dispatch, bf16 tolerance for combine. Skipped without
torch or two GPUs."""
import os
import tempfile
import traceback

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="two CUDA GPUs needed (one per member process)",
)

WORLD = 2


def _run(target):
    ctx = torch.multiprocessing.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "rendezvous")
        procs = [ctx.Process(target=_member, args=(target, r, init, q)) for r in range(WORLD)]
        for p in procs:
            p.start()
        reports = [q.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    failures = [r for r in reports if r]
    assert not failures, "\n".join(failures)


def _member(target, rank, init, q):
    try:
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
        target(rank)
        dist.barrier()
        dist.destroy_process_group()
        q.put("")
    except Exception:  # noqa: BLE001 -- reported to the parent
        q.put(f"member {rank}: {traceback.format_exc()}")


def _tensors_and_host_ops(rank):
    import ferry
    from ferry.symmetric import SymmetricMemory

    n = (1 << 20) + 64
    mem = SymmetricMemory(n, rank=rank, size=WORLD, device=rank)
    assert mem.data.dtype == torch.uint8 and mem.data.shape == (n,)
    assert mem.data.device == torch.device("cuda", rank)
    assert mem.data.data_ptr() == mem._native.data_ptr
    assert mem.peer_pointers.dtype == torch.int64 and mem.peer_pointers.shape == (WORLD,)
    assert mem.peer_pointers.tolist() == mem.peer_data_addresses()
    assert mem.peer_pointers.tolist()[rank] == mem.data.data_ptr()
    assert mem.team_ptr != 0
    peer = (rank + 1) % WORLD
    g = torch.Generator(device="cuda").manual_seed(99 + rank)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
    mem.put(peer, 0, src)
    mem.signal(peer, 0, 1, add=True)
    mem.wait(0, 1)
    torch.cuda.synchronize()
    g2 = torch.Generator(device="cuda").manual_seed(99 + peer)
    want = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g2)
    assert torch.equal(mem.data, want), "the peer's put did not land byte for byte"
    assert mem.read_signal(0) == 1
    assert int(mem.signals[0]) == 1
    v = mem.view(torch.bfloat16, (16, 8), offset=256)
    assert v.data_ptr() == mem.data.data_ptr() + 256
    with pytest.raises(ferry.OutOfRange):
        mem.view(torch.bfloat16, (n,))
    with pytest.raises(ferry.InvalidArgument, match="member 2 of a group of 2"):
        mem.put(2, 0, src)
    # A wait nobody answers: the stream goes on, the host reads why.
    mem.wait(9, 1, timeout_s=0.02)
    torch.cuda.synchronize()
    with pytest.raises(ferry.Timeout, match="signal slot 9"):
        mem.check_device_error()
    mem.clear_device_error()
    mem.check_device_error()
    mem.barrier()
    torch.cuda.synchronize()


def test_symmetric_tensors_and_host_operations():
    _run(_tensors_and_host_ops)


def _moe(rank):
    import torch.distributed as dist
    from ferry.symmetric import MoeExchange

    E, T, H, K = 3, 40, 256, 4
    moe = MoeExchange(max_tokens=T, hidden=H, top_k=K, experts_per_rank=E, rank=rank,
                      size=WORLD, device=rank)
    experts = E * WORLD
    dev = torch.device("cuda", rank)
    for case, (tokens, mode) in enumerate([(0, "random"), (1, "random"), (40, "random"),
                                           (33, "one"), (17, "missing"), (40, "member0"),
                                           (1, "one")]):
        g = torch.Generator(device=dev).manual_seed(1000 * case + rank)
        x = torch.randn((tokens, H), device=dev, generator=g).to(torch.bfloat16)
        topk = torch.rand((tokens, experts), device=dev, generator=g).argsort(dim=1)[:, :K]
        topk = topk.to(torch.int64).contiguous()
        if mode == "one":
            topk.fill_(-1)
            topk[:, 0] = 4
        elif mode == "missing":
            topk[::2, 1] = -1
        elif mode == "member0":  # member 0's experts only, uneven counts
            topk.fill_(-1)
            topk[:, :E] = torch.arange(E, device=dev)
        w = torch.rand((tokens, K), device=dev, generator=g)
        # Everyone's inputs, for the reference.
        xs = [None] * WORLD
        ts = [None] * WORLD
        dist.all_gather_object(xs, x.cpu())
        dist.all_gather_object(ts, topk.cpu())
        recv_x, recv_count, recv_src = moe.dispatch(x, topk, w)
        torch.cuda.synchronize()
        moe.memory.check_device_error()
        scale = torch.tensor([1.0 + 0.25 * e for e in range(experts)], device=dev)
        y = torch.zeros_like(recv_x)
        for le in range(E):
            e = rank * E + le
            for s in range(WORLD):
                want = (ts[s] == e).nonzero()[:, 0].tolist()  # one entry per (token, k) choice
                n = int(recv_count[le, s])
                assert n == len(want), f"case {case}: expert {e} from {s}: {n} rows, {len(want)}"
                rows = slice(s * T, s * T + n)
                src = recv_src[le, rows].tolist()
                assert sorted(src) == sorted(want), f"case {case}: expert {e} from {s}: tokens"
                assert torch.equal(recv_x[le, rows].cpu(), xs[s][src]), f"case {case}: rows"
                y[le, rows] = (recv_x[le, rows].float() * scale[e]).to(torch.bfloat16)
        out = moe.combine(y)
        torch.cuda.synchronize()
        moe.memory.check_device_error()
        assert out.shape == (tokens, H)
        valid = topk >= 0
        scaled = (x.float()[:, None, :] * scale[topk.clamp(min=0)][:, :, None]).to(torch.bfloat16)
        terms = scaled.float() * (w * valid)[:, :, None]
        ref = terms.sum(dim=1)
        # Each other member returns its partial sum rounded to bf16: at most
        # 2^-8 of its magnitude off, on top of the bf16 tolerance.
        owner = topk.clamp(min=0) // E
        rounding = torch.zeros_like(ref)
        for d in range(WORLD):
            if d != rank:
                rounding += (terms * (owner == d)[:, :, None]).sum(dim=1).abs() / 256
        err = (out.float() - ref).abs()
        bound = 1e-2 + 1e-2 * ref.abs() + rounding
        assert bool((err <= bound).all()), (
            f"case {case}: combine off by up to {float((err - bound).max()):.4g} past the bound")


def test_moe_dispatch_and_combine_match_torch():
    _run(_moe)
