// Pieces the tcp transport's files share: the iov limit, frame headers, the
// stage trace trailer of responses, revoked pins and the staging helpers (defined
// in tcp_staging.cc) that posting and receiving both use.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fmt/format.h"
#include "transport/tcp/tcp_transport.h"

namespace ferry::tcp::internal {

inline constexpr int kMaxIov = 1024;  // IOV_MAX on Linux

inline std::string hex_id(uint64_t id) {
  return fmt::format("{:016x}", id);
}

inline FrameHeader make_header(Op op, TransferId id) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.op = static_cast<uint8_t>(op);
  h.transfer_id = id;
  return h;
}

// --- stage trace (core/stage_trace.h, docs/trace.md) ---

// A response's trace trailer (tcp_wire.h TraceTrailerHead + the stamps).
inline void append_trailer(std::vector<uint8_t>& aux, const TargetStamps& stamps) {
  const TraceTrailerHead head{kTraceTrailerStages, 0};
  const auto* h = reinterpret_cast<const uint8_t*>(&head);
  aux.insert(aux.end(), h, h + sizeof head);
  const auto* v = reinterpret_cast<const uint8_t*>(stamps.data());
  aux.insert(aux.end(), v, v + sizeof(int64_t) * stamps.size());
}

// Sets one stamp in the trailer of a traced response frame (in place: the
// frame's cursor points at its aux, which is not resized).
inline void put_stamp(TxFrame& f, TraceStage stage, int64_t ns) {
  if (!f.traced) return;
  std::memcpy(f.aux.data() + sizeof(TraceTrailerHead) + sizeof(int64_t) * target_stamp(stage), &ns,
              sizeof ns);
}

inline TargetStamps stamps_of(const TxFrame& f) {
  TargetStamps st{};
  std::memcpy(st.data(), f.aux.data() + sizeof(TraceTrailerHead), sizeof st);
  return st;
}

// The first revoked region among `pins`, or null.
inline Region* first_revoked(const std::vector<RegionPin>& pins) {
  for (const RegionPin& p : pins) {
    if (p.get() != nullptr && p.get()->revoked.load(std::memory_order_acquire)) return p.get();
  }
  return nullptr;
}

// --- staging (tcp_staging.cc, where each is described) ---

bool any_gpu(const std::vector<Segment>& segments, bool local);
std::vector<DeviceCopy> stage_pieces(IovCursor& cursor, const std::vector<Piece>& pieces,
                                     uint8_t* slot, bool to_host);
void stage_write(Stream& s, const std::vector<Piece>& pieces);
void stage_read_response(Pending& p, std::unique_ptr<StagingSlot> slot);

}  // namespace ferry::tcp::internal
