// The view of a symmetric group that a GPU kernel takes: plain C types only, so
// that host code (C++20, include/ferry/symmetric.h) and device code (CUDA C++17,
// include/ferry/device.cuh) share one definition.
//
// A group is N processes on one host, each with one GPU and one symmetric
// buffer of the same size: `data_bytes` of data followed by `signal_slots`
// 64-bit signal slots. Member r's buffer appears in every member's address
// space (through cuda_ipc's handles), so a kernel reaches byte `o` of member r's
// data at `data[r] + o` and its signal slot s at `signals[r] + s`.
#pragma once

#include <stdint.h>

namespace ferry {

// What went wrong on the device, recorded once (the first error wins) in host
// memory mapped for the GPU, so that the host can read it while a kernel still
// runs and after it returned. SymmetricMemory::device_error() turns it into a Status.
enum DeviceErrorCode : uint32_t {
  kDeviceErrorNone = 0,
  kDeviceErrorWaitTimeout = 1,  // wait(): the slot stayed below `expected` for timeout_ns
  kDeviceErrorBadPeer = 2,      // a put/signal named a member outside [0, size)
  kDeviceErrorBadSlot = 3,      // a signal/wait named a slot outside [0, signal_slots)
  kDeviceErrorOutOfRange = 4,   // a put outside [0, data_bytes)
  kDeviceErrorLineTimeout = 5,  // a low-latency line from `peer` kept an older flag for timeout_ns
  kDeviceErrorFlagTimeout =
      6,  // a staged group's flag from `peer` kept an older round for timeout_ns
};

struct DeviceError {
  uint32_t code;  // DeviceErrorCode; 0 while nothing went wrong
  int32_t rank;   // the member whose kernel recorded it
  int32_t peer;   // the member named by the failing call (-1: none)
  uint32_t slot;  // the signal slot (wait, signal)
  uint64_t
      expected;  // wait: the value waited for; put: offset + bytes asked for; line, flag: round
  uint64_t observed;  // wait: the slot's last value; put: data_bytes; line, flag: the flag seen
  uint64_t waited_ns;
  uint32_t block;  // blockIdx.x and threadIdx.x of the recording thread
  uint32_t thread;
};

// Kept in device memory by SymmetricMemory (device_team()), and passed by value
// to kernels (team()). Pointers are as mapped in the process that holds this
// copy: never send them to another process.
struct DeviceTeam {
  int32_t rank;              // this member
  int32_t size;              // members in the group
  uint64_t data_bytes;       // of every member's data area
  uint32_t signal_slots;     // 64-bit slots per member, usable by the application
  uint32_t reserved_slots;   // slots after those, used by the group itself (barrier)
  uint64_t timeout_ns;       // how long wait() polls before it records a timeout
  uint8_t* const* data;      // device array [size]: member r's data as mapped here
  uint64_t* const* signals;  // device array [size]: member r's signal slots as mapped here
  DeviceError* error;        // host-mapped; written by the device, read by the host
};

}  // namespace ferry
