// Symmetric memory and the device API (include/ferry/symmetric.h,
// include/ferry/device.cuh) between two member processes, one GPU each: host
// and kernel puts at every granularity with every byte checked, data visible
// before its signal, many concurrent signals, timeouts and bad calls that the
// host reads back, and join's refusals. Skips (saying why) with fewer than two GPUs.
#include "ferry/symmetric.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "member_group.h"
#include "symmetric_test_kernels.h"
#include "symmetric_test_util.h"

namespace {

using ferry::SymmetricMemory;
using ferry::SymmetricOptions;
using gputest::Member;
using symtest::Check;

TEST(Symmetric, HostPutSignalWaitMoveEveryByte) {
  const uint64_t seed = std::random_device{}();
  RUN_MEMBERS([&](Member& m) -> std::string {
    Check c;
    SymmetricOptions o;
    o.data_bytes = (4 << 20) + 48;
    auto mem = symtest::make_group(m, o, c);
    if (!c.ok()) return c.report();
    const int peer = (m.rank() + 1) % m.size();
    const auto mine = symtest::random_bytes(seed, m.rank(), o.data_bytes);
    symtest::DeviceBuffer src(mine);
    cudaStream_t s = nullptr;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    c.status(mem->put(peer, 0, src.get(), o.data_bytes, s), "put");
    c.status(mem->signal(peer, 0, 1, true, s), "signal");
    c.status(mem->wait(0, 1, s), "wait");
    c.cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    const int from = (m.rank() + m.size() - 1) % m.size();
    const auto got = symtest::to_host(mem->local_data(), o.data_bytes);
    c.bytes_equal(got, symtest::random_bytes(seed, from, o.data_bytes), "data put by the peer");
    c.equal(mem->read_signal(0), uint64_t{1}, "slot 0 after one add");
    c.status(mem->device_error(), "device_error");
    // The device table: the same pointers the host API reports.
    const auto table = symtest::to_host(mem->device_peer_data(), 8ull * m.size());
    for (int r = 0; r < m.size(); ++r) {
      uint64_t p = 0;
      std::memcpy(&p, table.data() + 8 * r, 8);
      c.equal(p, reinterpret_cast<uint64_t>(mem->peer_data(r)), "device_peer_data[r]");
      c.truth(mem->peer_data(r) != nullptr && mem->peer_signals(r) != nullptr, "peer pointers");
    }
    c.truth(mem->peer_data(m.rank()) == mem->local_data(), "own entry is the local buffer");
    const ferry::DeviceTeam t = mem->team();
    c.truth(t.rank == m.rank() && t.size == m.size() && t.data_bytes == o.data_bytes &&
                t.signal_slots == o.signal_slots,
            "team fields");
    cudaStreamDestroy(s);
    m.barrier();
    return c.report();
  });
}

TEST(Symmetric, HostCallsRefuseBadArguments) {
  RUN_MEMBERS([&](Member& m) -> std::string {
    Check c;
    SymmetricOptions o;
    o.data_bytes = 4096;
    o.rank = m.rank();
    o.size = m.size();
    o.device = m.rank();
    auto created = SymmetricMemory::create(o);
    if (!created.ok()) return "create: " + created.status().message();
    auto& mem = *created;
    void* src = nullptr;
    cudaMalloc(&src, 8192);
    c.error_has(mem->put(0, 0, src, 16, nullptr), ferry::StatusCode::kInvalidArgument, "join()");
    c.status(mem->join(m.all_gather(mem->card())), "join");
    c.error_has(mem->join(m.all_gather(mem->card())), ferry::StatusCode::kInvalidArgument,
                "already");
    const std::string n = std::to_string(m.size());
    c.error_has(mem->put(m.size(), 0, src, 16, nullptr), ferry::StatusCode::kInvalidArgument,
                "member " + n + " of a group of " + n);
    c.error_has(mem->put(0, 4000, src, 200, nullptr), ferry::StatusCode::kOutOfRange,
                "200 bytes at offset 4000");
    c.error_has(mem->signal(0, 64, 1, false, nullptr), ferry::StatusCode::kInvalidArgument,
                "slot 64");
    c.error_has(mem->signal(-1, 0, 1, false, nullptr), ferry::StatusCode::kInvalidArgument,
                "member -1");
    c.error_has(mem->wait(70, 1, nullptr), ferry::StatusCode::kInvalidArgument, "slot 70");
    o.data_bytes = 0;
    o.rank = m.size();
    c.error_has(SymmetricMemory::create(o).status(), ferry::StatusCode::kInvalidArgument,
                "rank " + n);
    cudaFree(src);
    m.barrier();
    return c.report();
  });
}

TEST(Symmetric, JoinRefusesDifferentSizesForeignHostsAndBadCards) {
  RUN_MEMBERS([&](Member& m) -> std::string {
    Check c;
    SymmetricOptions o;
    o.data_bytes = 1 << 20;
    o.rank = m.rank();
    o.size = m.size();
    o.device = m.rank();
    {
      SymmetricOptions uneven = o;
      uneven.data_bytes += m.rank() * 256;  // member 1 asks for more
      auto mem = SymmetricMemory::create(uneven);
      if (!mem.ok()) return "create: " + mem.status().message();
      const ferry::Status s = (*mem)->join(m.all_gather((*mem)->card()));
      c.error_has(s, ferry::StatusCode::kInvalidArgument, "sizes differ: member");
      // Member 0 compares against member 1's size; member r > 1 its own.
      const uint64_t named = (1u << 20) + (m.rank() == 0 ? 1 : m.rank()) * 256;
      c.error_has(s, ferry::StatusCode::kInvalidArgument, std::to_string(named));
      m.barrier();
    }
    auto created = SymmetricMemory::create(o);
    if (!created.ok()) return "create: " + created.status().message();
    auto& mem = *created;
    auto cards = m.all_gather(mem->card());
    const int peer = (m.rank() + 1) % m.size();
    // Another host: the peer's card with its kernel boot id changed.
    auto foreign = cards;
    const std::string boot = symtest::boot_id();
    auto& pc = foreign[static_cast<size_t>(peer)];
    auto at = std::search(pc.begin(), pc.end(), boot.begin(), boot.end());
    c.truth(at != pc.end(), "the card names the boot id");
    if (at != pc.end()) *at = *at == 'a' ? 'b' : 'a';
    c.error_has(mem->join(foreign), ferry::StatusCode::kInvalidArgument,
                "member " + std::to_string(peer) + " is not on this host");
    auto truncated = cards;
    truncated[static_cast<size_t>(peer)].resize(20);
    c.error_has(mem->join(truncated), ferry::StatusCode::kInvalidArgument, "truncated");
    auto garbage = cards;
    garbage[static_cast<size_t>(peer)].assign(64, 0x5a);
    c.error_has(mem->join(garbage), ferry::StatusCode::kInvalidArgument,
                "not a symmetric-memory card");
    c.error_has(mem->join({cards[0]}), ferry::StatusCode::kInvalidArgument, "got 1 cards");
    auto swapped = cards;
    std::swap(swapped[0], swapped[1]);
    c.error_has(mem->join(swapped), ferry::StatusCode::kInvalidArgument, "expected member");
    // Refusals map nothing: the genuine cards still join.
    c.status(mem->join(cards), "join after refusals");
    m.barrier();
    return c.report();
  });
}

TEST(Symmetric, KernelPutsAtThreadWarpAndBlockGranularity) {
  const uint64_t seed = std::random_device{}();
  RUN_MEMBERS([&](Member& m) -> std::string {
    Check c;
    SymmetricOptions o;
    o.data_bytes = 2 << 20;
    auto mem = symtest::make_group(m, o, c);
    if (!c.ok()) return c.report();
    const uint64_t tb = 1001, wo = 1008, wb = 65536, bb = 1 << 20;
    const auto mine = symtest::random_bytes(seed, m.rank(), wo + wb + bb);
    symtest::DeviceBuffer src(mine);
    symtest::DeviceBuffer ok(std::vector<uint8_t>(4, 0));
    const int peer = (m.rank() + 1) % m.size();
    c.cuda(symtest::put_three_ways(mem->team(), peer, src.get(), tb, wb, bb, nullptr), "launch");
    c.cuda(symtest::wait_three(mem->team(), reinterpret_cast<int*>(ok.get()), nullptr), "launch");
    c.cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    c.equal(ok.host_int(), 1, "all three signals arrived");
    const auto got = symtest::to_host(mem->local_data(), wo + wb + bb);
    // What member rank - 1 put here (it puts to its rank + 1).
    auto expect = symtest::random_bytes(seed, (m.rank() + m.size() - 1) % m.size(), wo + wb + bb);
    std::fill(expect.begin() + tb, expect.begin() + wo, 0);  // nobody wrote [tb, wo)
    c.bytes_equal(got, expect, "thread, warp and block puts");
    c.status(mem->device_error(), "device_error");
    m.barrier();
    return c.report();
  });
}

TEST(Symmetric, DataIsVisibleBeforeItsSignal) {
  const uint64_t seed = std::random_device{}();
  RUN_MEMBERS([&](Member& m) -> std::string {
    Check c;
    constexpr int kRegions = 2048, kBlocks = 32;
    constexpr uint64_t kRegion = 16 << 10;
    SymmetricOptions o;
    o.data_bytes = kRegions * kRegion;
    auto mem = symtest::make_group(m, o, c);
    if (!c.ok()) return c.report();
    const int peer = (m.rank() + 1) % m.size(), from = (m.rank() + m.size() - 1) % m.size();
    symtest::DeviceBuffer src(symtest::random_bytes(seed, m.rank(), o.data_bytes));
    symtest::DeviceBuffer expected(symtest::random_bytes(seed, from, o.data_bytes));
    symtest::DeviceBuffer counters(std::vector<uint8_t>(16, 0));
    auto* mismatches = reinterpret_cast<unsigned long long*>(counters.get());
    auto* timeouts = reinterpret_cast<int*>(counters.get() + 8);
    cudaStream_t send = nullptr, check = nullptr;
    cudaStreamCreateWithFlags(&send, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&check, cudaStreamNonBlocking);
    m.barrier();
    c.cuda(symtest::ordered_check(mem->team(), expected.get(), kRegion, kRegions, kBlocks, 0,
                                  mismatches, timeouts, check),
           "launch check");
    c.cuda(symtest::ordered_send(mem->team(), peer, src.get(), kRegion, kRegions, kBlocks, 0, send),
           "launch send");
    c.cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const auto counts = symtest::to_host(counters.get(), 16);
    uint64_t bad = 0;
    int late = 0;
    std::memcpy(&bad, counts.data(), 8);
    std::memcpy(&late, counts.data() + 8, 4);
    c.equal(bad, uint64_t{0}, "bytes not yet visible when their signal was");
    c.equal(late, 0, "regions whose signal never came");
    c.status(mem->device_error(), "device_error");
    cudaStreamDestroy(send);
    cudaStreamDestroy(check);
    m.barrier();
    return c.report();
  });
}

TEST(Symmetric, ManyConcurrentSignalsAllCount) {
  RUN_MEMBERS([&](Member& m) -> std::string {
    Check c;
    SymmetricOptions o;
    o.data_bytes = 256;
    auto mem = symtest::make_group(m, o, c);
    if (!c.ok()) return c.report();
    constexpr int kBlocks = 264, kThreads = 256;
    constexpr uint32_t kSlots = 16, kSetSlot = 16;
    const int peer = (m.rank() + 1) % m.size();
    c.cuda(symtest::signal_storm(mem->team(), peer, kSlots, kSetSlot, kBlocks, kThreads, nullptr),
           "launch");
    c.status(mem->barrier(nullptr), "barrier");  // the peer's storm is complete after it
    c.cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    for (uint32_t s = 0; s < kSlots; ++s) {
      c.equal(mem->read_signal(s), uint64_t{kBlocks * kThreads / kSlots},
              "adds counted on slot " + std::to_string(s));
    }
    const uint64_t last = mem->read_signal(kSetSlot);
    c.truth(last >= 1 && last <= kBlocks * kThreads, "set slot holds one thread's value");
    c.status(mem->device_error(), "device_error");
    m.barrier();
    return c.report();
  });
}

TEST(Symmetric, WaitTimesOutAndTheHostReadsWhy) {
  RUN_MEMBERS([&](Member& m) -> std::string {
    Check c;
    SymmetricOptions o;
    o.data_bytes = 256;
    auto mem = symtest::make_group(m, o, c);
    if (!c.ok()) return c.report();
    symtest::DeviceBuffer out(std::vector<uint8_t>(16, 0));
    auto* result = reinterpret_cast<int*>(out.get());
    auto* observed = reinterpret_cast<uint64_t*>(out.get() + 8);
    // Nobody signals slot 5: the kernel returns after ~20 ms, and says why.
    c.cuda(symtest::wait_one(mem->team(), 5, 1, 20'000'000, result, observed, nullptr), "launch");
    c.cuda(cudaDeviceSynchronize(), "the timed-out kernel finished");
    c.equal(out.host_int(), 0, "wait() returned false");
    c.error_has(mem->device_error(), ferry::StatusCode::kTimeout,
                "member " + std::to_string(m.rank()) + " waited");
    c.error_has(mem->device_error(), ferry::StatusCode::kTimeout, "signal slot 5 for >= 1");
    mem->clear_device_error();
    c.status(mem->device_error(), "after clear_device_error");
    // The host-posted wait times out the same way.
    c.status(mem->wait(7, 3, nullptr, 10'000'000), "wait");
    c.cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    c.error_has(mem->device_error(), ferry::StatusCode::kTimeout, "slot 7 for >= 3");
    mem->clear_device_error();
    // And a wait that is answered returns the value.
    m.barrier();
    const int peer = (m.rank() + 1) % m.size();
    c.status(mem->signal(peer, 6, 42, false, nullptr), "signal");
    c.cuda(symtest::wait_one(mem->team(), 6, 42, 0, result, observed, nullptr), "launch");
    c.cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    c.equal(out.host_int(), 1, "wait() for a value that came");
    const auto o64 = symtest::to_host(observed, 8);
    uint64_t v = 0;
    std::memcpy(&v, o64.data(), 8);
    c.equal(v, uint64_t{42}, "observed value");
    // Bad device calls record why and return false.
    const ferry::StatusCode codes[] = {ferry::StatusCode::kInvalidArgument,
                                       ferry::StatusCode::kInvalidArgument,
                                       ferry::StatusCode::kOutOfRange};
    const ferry::DeviceTeam team = mem->team();
    const std::string n = std::to_string(m.size());
    const std::string words[] = {
        "named member " + n + " of a group of " + n,
        "named signal slot " + std::to_string(team.signal_slots + team.reserved_slots),
        "ends at byte 257"};
    for (int which = 0; which < 3; ++which) {
      mem->clear_device_error();
      c.cuda(symtest::bad_call(mem->team(), which, result, nullptr), "launch");
      c.cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      c.equal(out.host_int(), 1, "bad call " + std::to_string(which) + " returned false");
      c.error_has(mem->device_error(), codes[which], words[which]);
    }
    m.barrier();
    return c.report();
  });
}

}  // namespace
