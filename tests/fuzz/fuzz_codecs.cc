// libFuzzer target: the descriptor and metadata decoders must reject or
// accept any byte string without reading out of bounds, and whatever they
// accept must re-encode to the same bytes.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/metadata.h"
#include "ferry/types.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const ferry::ByteView in(data, size);
  if (auto d = ferry::RemoteDescriptor::from_bytes(in); d.ok()) {
    const ferry::Bytes again = d->to_bytes();
    if (again.size() != size || std::memcmp(again.data(), data, size) != 0) std::abort();
  }
  if (auto m = ferry::EngineMetadata::decode(in); m.ok()) {
    const ferry::Bytes again = m->encode();
    if (again.size() != size || std::memcmp(again.data(), data, size) != 0) std::abort();
  }
  return 0;
}
