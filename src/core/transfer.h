// One transfer (a batch write, read or notification) as seen by core and by
// the transport executing it. Shared by both: core keeps it in the transfer
// table until the caller has observed the final status; the transport holds
// it while frames are in flight.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/stage_trace.h"
#include "ferry/status.h"
#include "ferry/types.h"

namespace ferry {

class PeerWindows;
class Transport;

enum class TransferOp : uint8_t { kWrite, kRead, kNotify };

class Transfer {
 public:
  Transfer(TransferId id, TransferOp op, PeerId peer) : id_(id), op_(op), peer_(peer) {}

  TransferId id() const { return id_; }
  TransferOp op() const { return op_; }
  PeerId peer() const { return peer_; }

  // Sets the final status; the first call wins and wakes waiters.
  bool complete(Status status);
  bool finished() const { return finished_.load(std::memory_order_acquire); }
  // The final status, or InProgress.
  Status status() const;
  // Blocks until finished or the deadline, spinning for up to `spin` before
  // sleeping; returns finished().
  bool wait_until(std::chrono::steady_clock::time_point deadline,
                  std::chrono::microseconds spin = std::chrono::microseconds(0)) const;
  // The same with a timeout; a transfer already finished costs no clock read.
  bool wait_for(std::chrono::milliseconds timeout, std::chrono::microseconds spin) const;

  // --- transport bookkeeping -------------------------------------------------
  // Frames (or other units) still to be answered.
  std::atomic<uint64_t> outstanding{0};
  // First error seen on any unit; reported when the last unit is answered.
  void note_error(const Status& s);
  Status first_error() const;
  // Payload bytes of the batch (set by core when posting).
  uint64_t bytes = 0;
  // The transport the batch was posted on (set by core; cancel goes there).
  Transport* transport = nullptr;
  // The transport's own record of the transfer, where it keeps one (set and
  // read under the transport's lock; core never touches it).
  void* transport_state = nullptr;
  // Room this transfer holds in its peer's window (core/peer_window.h), given
  // back once: by complete(), or by core when posting failed.
  void hold_window(PeerWindows* windows, uint64_t window_bytes, uint64_t window_iovs);
  void release_window();
  // Payload of a notification sent after the write completes (empty: none).
  Bytes notification;
  bool has_notification = false;
  // Stage trace (core/stage_trace.h): null unless the transport traces this
  // transfer. Set by the transport before any of its frames is published,
  // never reset while the transfer lives; marked from any thread.
  std::unique_ptr<StageTrace> trace;

  // --- cancellation ----------------------------------------------------------
  // An I/O thread holds io_mu while it places bytes into the caller's local
  // memory; cancel() takes it to set `cancelled`, so after cancel() returns no
  // more bytes land there.
  std::mutex io_mu;
  bool cancelled = false;  // guarded by io_mu
  // Frames of this transfer partly on the wire (they read the caller's memory
  // until fully sent); cancel waits for them.
  void tx_begin();
  void tx_end();
  void wait_tx_idle();

 private:
  const TransferId id_;
  const TransferOp op_;
  const PeerId peer_;
  std::atomic<bool> finished_{false};
  std::atomic<bool> completing_{false};  // a complete() call won
  // Threads asleep (or about to sleep) on cv_ for finished_: complete() takes
  // mu_ to wake them only then, not on every call.
  mutable std::atomic<uint32_t> sleepers_{0};
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  Status status_;
  Status first_error_;
  uint32_t tx_active_ = 0;  // guarded by mu_
  std::atomic<PeerWindows*> window_{nullptr};
  uint64_t window_bytes_ = 0;
  uint64_t window_iovs_ = 0;
};

// Live transfers by id. Ids grow from 1 and are never reused.
//
// An open-addressing table (Robin Hood linear probing, an id's home slot is
// id & mask): no node allocation per transfer. Live ids are mostly one run
// of consecutive ids, so each usually sits in its home slot.
class TransferTable {
 public:
  TransferTable();
  std::shared_ptr<Transfer> create(TransferOp op, PeerId peer);
  std::shared_ptr<Transfer> find(TransferId id) const;
  // The same; one that has finished also leaves the table (*taken: its final
  // status is the caller's to report) -- one lookup where find and erase
  // took two.
  std::shared_ptr<Transfer> find(TransferId id, bool* taken);
  void erase(TransferId id);
  size_t size() const;
  // Completes every live transfer with `status` (engine shutdown).
  void fail_all(const Status& status);

 private:
  static constexpr TransferId kEmpty = 0;
  struct Slot {
    TransferId id = kEmpty;
    std::shared_ptr<Transfer> transfer;
  };
  static constexpr size_t kMinSlots = 64;
  // mu_ held: the slot holding `id`, or slots_.size().
  size_t index_of(TransferId id) const;
  void place(Slot s);
  void erase_at(size_t i);
  void resize(size_t slots);

  mutable std::mutex mu_;
  std::vector<Slot> slots_;  // a power of two, at most half full
  size_t live_ = 0;
  TransferId next_id_ = 1;
};

}  // namespace ferry
