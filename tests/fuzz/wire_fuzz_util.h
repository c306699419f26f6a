// Shared by the transport wire decoders' fuzz targets: how an input is read.
//
// The first byte chooses the mode. Below 0x80 the rest is a whole frame: the
// header is decoded and, if accepted, the body after it goes to the decoder
// its opcode names (as a transport's I/O thread does). From 0x80 on, the
// first byte picks a decoder directly and the rest is its body, so that every
// decoder sees bytes even when the fuzzer has not found a valid header yet.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "ferry/types.h"

namespace ferry::fuzz {

struct WireInput {
  bool whole_frame = false;
  uint8_t selector = 0;  // body mode: which decoder
  ByteView rest;
};

inline WireInput split_wire_input(const uint8_t* data, size_t size) {
  if (size == 0) return {};
  return {data[0] < 0x80, static_cast<uint8_t>(data[0] & 0x7F), ByteView(data + 1, size - 1)};
}

// An encoder's output must decode again: encode and decode agree.
#define FERRY_FUZZ_REQUIRE(cond) \
  do {                           \
    if (!(cond)) std::abort();   \
  } while (0)

}  // namespace ferry::fuzz
