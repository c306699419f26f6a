#include "cuda/copy_stream_knobs.h"

#include <cstdio>
#include <cstdlib>
#include <string>

namespace ferry::cuda {

Result<Knobs> read_knobs() {
  Knobs k;
  if (const char* v = std::getenv("FERRY_COPY_AFTER_DEFAULT"); v != nullptr && *v != 0) {
    const std::string s(v);
    if (s == "blocking") {
      k.after_default = AfterDefault::kBlocking;
    } else if (s == "query") {
      k.after_default = AfterDefault::kQuery;
    } else if (s == "event") {
      k.after_default = AfterDefault::kEvent;
    } else {
      return err::InvalidArgument("FERRY_COPY_AFTER_DEFAULT=" + s +
                                  ": expected blocking, query or event");
    }
  }
  if (const char* v = std::getenv("FERRY_GATHER_HOST_LOAD"); v != nullptr && *v != 0) {
    const std::string s(v);
    if (s == "cv") {
      k.gather.host_load = HostLoad::kFetchAgain;
    } else if (s == "cs") {
      k.gather.host_load = HostLoad::kStreaming;
    } else if (s == "pf256") {
      k.gather.host_load = HostLoad::kPrefetch256;
    } else {
      return err::InvalidArgument("FERRY_GATHER_HOST_LOAD=" + s + ": expected cv, cs or pf256");
    }
  }
  if (const char* v = std::getenv("FERRY_GATHER_CE_EVERY"); v != nullptr && *v != 0) {
    char* end = nullptr;
    const unsigned long n = std::strtoul(v, &end, 10);
    if (end == v || *end != 0 || n > 1000000) {
      return err::InvalidArgument(std::string("FERRY_GATHER_CE_EVERY=") + v +
                                  ": expected a count (0 = off)");
    }
    k.ce_every = static_cast<uint32_t>(n);
  }
  if (const char* v = std::getenv("FERRY_GATHER_SLICES"); v != nullptr && *v != 0) {
    unsigned first = 0, growth = 0, max = 0;
    char extra = 0;
    if (std::sscanf(v, "%u,%u,%u%c", &first, &growth, &max, &extra) != 3 || first == 0 ||
        growth == 0 || growth > 64 || max < first || max > (1u << 24)) {
      return err::InvalidArgument(std::string("FERRY_GATHER_SLICES=") + v +
                                  ": expected first,growth,max (e.g. 256,2,32768)");
    }
    k.first_slice = first;
    k.slice_growth = growth;
    k.max_slice = max;
  }
  if (const char* v = std::getenv("FERRY_RESIDENT_GATE"); v != nullptr && *v != 0) {
    const std::string s(v);
    if (s != "always" && s != "query") {
      return err::InvalidArgument("FERRY_RESIDENT_GATE=" + s + ": expected always or query");
    }
    k.resident_gate_always = s == "always";
  }
  return k;
}

}  // namespace ferry::cuda
