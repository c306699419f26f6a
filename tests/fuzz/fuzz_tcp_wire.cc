// libFuzzer target: tcp's frame decoders (src/transport/tcp/tcp_wire.h) fed
// directly -- validate_header, then the segment table or the trace trailer
// that the header announces -- without the engine and its sockets around them
// (fuzz_tcp_frames feeds the same bytes through a real engine, at a few
// thousand inputs a second; this one runs the decoders alone, hundreds of
// times faster). What a decoder accepts must keep its promises: a segment
// table adds up to the header's payload (WRITE) within the frame limit, and a
// trace trailer fits inside the aux it was read from.
#include <algorithm>
#include <cstring>
#include <vector>

#include "transport/tcp/tcp_wire.h"
#include "wire_fuzz_util.h"

namespace {

using namespace ferry;
using namespace ferry::tcp;

void check_frame(const FrameHeader& h, ByteView aux) {
  if (!validate_header(h).ok()) return;
  const auto op = static_cast<Op>(h.op);
  FERRY_FUZZ_REQUIRE(h.payload_bytes <= kMaxFramePayload);
  if (op == Op::kWrite || op == Op::kReadRequest) {
    FERRY_FUZZ_REQUIRE(h.count >= 1 && h.count <= kMaxSegmentsPerFrame);
    FERRY_FUZZ_REQUIRE(h.aux_bytes == h.count * sizeof(WireSegment));
    // The receiver reads exactly aux_bytes of table; the input may hold less.
    std::vector<WireSegment> table(h.count);
    std::memcpy(table.data(), aux.data(), std::min<size_t>(aux.size(), h.aux_bytes));
    uint64_t total = 0;
    if (check_segments(h, table, &total).ok()) {
      uint64_t sum = 0;
      for (const auto& s : table) {
        FERRY_FUZZ_REQUIRE(s.length > 0 && s.length <= kMaxFramePayload - sum);
        sum += s.length;
      }
      FERRY_FUZZ_REQUIRE(sum == total && total <= kMaxFramePayload);
      if (op == Op::kWrite) FERRY_FUZZ_REQUIRE(total == h.payload_bytes);
    }
    return;
  }
  if (op == Op::kNotify) {
    FERRY_FUZZ_REQUIRE(h.aux_bytes <= kMaxNotificationBytes && h.payload_bytes == 0);
    return;
  }
  // Responses: the trace trailer, when flagged, lies inside the aux received.
  const ByteView received = aux.subspan(0, std::min<size_t>(aux.size(), h.aux_bytes));
  if (auto trailer = trace_trailer_size(h, received); trailer.ok()) {
    FERRY_FUZZ_REQUIRE(*trailer <= received.size());
    FERRY_FUZZ_REQUIRE(*trailer <= kMaxTraceTrailerBytes);
    if ((h.flags & kFlagTrace) == 0) FERRY_FUZZ_REQUIRE(*trailer == 0);
  }
  FERRY_FUZZ_REQUIRE(h.status == 0 || h.payload_bytes == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto in = fuzz::split_wire_input(data, size);
  if (in.rest.size() < sizeof(FrameHeader)) return 0;
  FrameHeader h{};
  std::memcpy(&h, in.rest.data(), sizeof h);
  if (!in.whole_frame) {
    // Before the fuzzer finds the magic and an opcode: give it them, so the
    // size checks and the decoders behind them see every input.
    h.magic = kFrameMagic;
    h.op = static_cast<uint8_t>(1 + in.selector % 6);
  }
  check_frame(h, in.rest.subspan(sizeof h));
  return 0;
}
