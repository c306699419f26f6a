// Symmetric GPU memory for a group of processes on one host: every member
// allocates a buffer of the same size, the members exchange small "cards"
// (bytes, like engine metadata: send them any way you like -- a
// torch.distributed all_gather_object, a file, the etcd directory), and each
// member then reaches every other member's buffer from its kernels through
// NVLink (include/ferry/device.cuh) or posts the same operations from the host.
//
//   auto mem = ferry::SymmetricMemory::create({.device = 0, .data_bytes = 1 << 30,
//                                              .rank = r, .size = n}).value();
//   std::vector<std::vector<uint8_t>> cards = all_gather(mem->card());  // yours
//   mem->join(cards);                    // maps every peer, builds the device table
//   my_kernel<<<...>>>(mem->team(), ...);  // ferry::device::put / signal / wait
//
// Access goes through cuda_ipc's handles (the same export and import as the
// cuda_ipc transport). join() refuses, naming the member: a card from another
// host, different sizes, a GPU pair without peer access, a member's GPU that
// this process does not see. Nothing falls back to a slower path.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ferry/device_team.h"
#include "ferry/status.h"

namespace ferry {

struct SymmetricOptions {
  int device = -1;             // the GPU's ordinal in this process; -1: the current one
  uint64_t data_bytes = 0;     // data area, the same on every member
  uint32_t signal_slots = 64;  // 64-bit signal slots, the same on every member
  int rank = 0;                // this member, in [0, size)
  int size = 1;                // members in the group
  uint64_t wait_timeout_ns = 10'000'000'000ull;  // device waits give up (and say so) after this
};

class SymmetricMemory {
 public:
  // Allocates this member's buffer (cudaMalloc, zeroed) and the host-mapped
  // error record. InvalidArgument names a bad option; NotSupported without a GPU.
  static Result<std::unique_ptr<SymmetricMemory>> create(const SymmetricOptions& options);
  ~SymmetricMemory();
  SymmetricMemory(const SymmetricMemory&) = delete;
  SymmetricMemory& operator=(const SymmetricMemory&) = delete;

  // This member's card: host, process, GPU (UUID), sizes and the IPC handle of
  // its buffer. Valid as long as this object lives.
  std::vector<uint8_t> card() const;
  // Maps every other member's buffer; `cards[r]` is member r's card (this
  // member's own included). Checked before anything is mapped.
  Status join(const std::vector<std::vector<uint8_t>>& cards);
  bool joined() const;

  int rank() const;
  int size() const;
  int device() const;
  uint64_t data_bytes() const;
  uint32_t signal_slots() const;
  // This member's data and signal slots (device pointers).
  void* local_data() const;
  uint64_t* local_signals() const;
  // Member r's data / signal slots as mapped in this process (device
  // pointers; after join). Null for r out of range.
  void* peer_data(int r) const;
  uint64_t* peer_signals(int r) const;

  // The table for kernels, by value (after join). device_team_ptr(): the same
  // table in device memory, for kernels that take a pointer.
  DeviceTeam team() const;
  const DeviceTeam* device_team_ptr() const;
  // The device arrays of peer data / signal pointers (uint64 x size).
  const uint64_t* device_peer_data() const;
  const uint64_t* device_peer_signals() const;

  // The first error a device call recorded (a wait timed out, a bad peer, slot
  // or range), as a Status naming it; Ok if none. clear_device_error() forgets it.
  Status device_error() const;
  void clear_device_error();

  // The device operations posted from the host, ordered on `stream`
  // (a cudaStream_t; nullptr: the legacy default stream). Arguments are
  // checked here: a bad peer, slot or range is InvalidArgument at once.
  // put: local device memory `src` -> member `peer`'s data at `dst_offset`
  // (a kernel of stores, every thread ending with quiet(), so a signal after
  // it on the stream is ordered after every byte). signal: release, system
  // scope, on the peer's slot.
  // wait: the stream waits (a one-thread kernel) until this member's slot is
  // >= at_least; a timeout shows in device_error().
  Status put(int peer, uint64_t dst_offset, const void* src, uint64_t bytes, void* stream);
  Status signal(int peer, uint32_t slot, uint64_t value, bool add, void* stream);
  Status wait(uint32_t slot, uint64_t at_least, void* stream, uint64_t timeout_ns = 0);
  // All members' earlier work on their streams is complete and visible before
  // any member's later work on `stream` starts (device-side, through the
  // reserved slots; every member must call it the same number of times).
  Status barrier(void* stream);
  // This member's slot as the host sees it now.
  uint64_t read_signal(uint32_t slot) const;

  struct Impl;

 private:
  explicit SymmetricMemory(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry
