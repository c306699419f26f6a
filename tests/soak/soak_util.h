// Small pieces every soak process uses: the clock all processes share, the
// random shapes of a transfer, a latency histogram that merges across
// processes, and what /proc says about a process.
#pragma once

#include <time.h>

#include <array>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace ferry::soak {

// CLOCK_MONOTONIC in ns: one clock for every process of the host, so a
// worker can compare its transfers' times with the moment the coordinator
// killed a peer.
inline int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

uint64_t Mix64(uint64_t a, uint64_t b);

// Uniform in [lo, hi] on a log scale: as many 1-16 B transfers as 1-16 MiB ones.
uint64_t LogUniform(std::mt19937_64& rng, uint64_t lo, uint64_t hi);

// One piece of a batch: `length` bytes at `remote` (relative to the range
// transferred) that sit at `local` in the local buffer.
struct Piece {
  uint64_t remote = 0;
  uint64_t local = 0;
  uint64_t length = 0;
};
// `bytes` cut at random into at most `iovs` pieces that cover [0, bytes) in
// order on the remote side, laid out locally in a shuffled order, so that
// neighbours are rarely neighbours locally too (and the engine cannot merge
// the batch into one segment).
std::vector<Piece> RandomLayout(std::mt19937_64& rng, uint64_t bytes, uint64_t iovs);

// Latency histogram: 8 buckets per power of two of nanoseconds (~9 %).
class Histogram {
 public:
  static constexpr int kBuckets = 64 * 8;
  void Add(int64_t ns);
  void Merge(const Histogram& other);
  uint64_t count() const { return count_; }
  // The value below which `q` of the samples fall (bucket's upper edge), ns.
  double Quantile(double q) const;
  // "index:count,..." of the non-empty buckets, and back.
  std::string Encode() const;
  void Decode(const std::string& text);

 private:
  std::array<uint64_t, kBuckets> buckets_{};
  uint64_t count_ = 0;
};

// Resident set (bytes) and open descriptors of process `pid` (0: this one).
uint64_t RssBytes(int pid = 0);
// Bytes malloc has handed out and not had back (glibc's mallinfo2, this
// process): beside the RSS it tells a leak (this grows) from memory the
// allocator keeps or fragments (RSS grows, this does not).
uint64_t HeapInUseBytes();
int OpenDescriptors(int pid = 0);

}  // namespace ferry::soak
