#include "soak_util.h"

#include <dirent.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace ferry::soak {

uint64_t Mix64(uint64_t a, uint64_t b) {
  uint64_t z = a ^ (b * 0x9E3779B97F4A7C15ull) ^ 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t LogUniform(std::mt19937_64& rng, uint64_t lo, uint64_t hi) {
  if (hi <= lo) return lo;
  const double a = std::log(static_cast<double>(lo));
  const double b = std::log(static_cast<double>(hi) + 1.0);
  const double x = std::exp(std::uniform_real_distribution<double>(a, b)(rng));
  return std::clamp<uint64_t>(static_cast<uint64_t>(x), lo, hi);
}

std::vector<Piece> RandomLayout(std::mt19937_64& rng, uint64_t bytes, uint64_t iovs) {
  iovs = std::clamp<uint64_t>(iovs, 1, bytes);
  std::vector<uint64_t> cuts;
  cuts.reserve(iovs + 1);
  if (iovs * 2 > bytes) {
    // Dense: pick the cut points by sampling positions without repetition.
    std::vector<uint64_t> all(bytes - 1);
    for (uint64_t i = 0; i + 1 < bytes; ++i) all[i] = i + 1;
    std::shuffle(all.begin(), all.end(), rng);
    cuts.assign(all.begin(), all.begin() + static_cast<long>(iovs - 1));
  } else {
    std::uniform_int_distribution<uint64_t> at(1, bytes - 1);
    for (uint64_t i = 0; i + 1 < iovs; ++i) cuts.push_back(at(rng));
  }
  cuts.push_back(0);
  cuts.push_back(bytes);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<Piece> pieces;
  pieces.reserve(cuts.size() - 1);
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    pieces.push_back({cuts[i], 0, cuts[i + 1] - cuts[i]});
  }
  std::vector<size_t> order(pieces.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  uint64_t local = 0;
  for (size_t i : order) {
    pieces[i].local = local;
    local += pieces[i].length;
  }
  return pieces;
}

void Histogram::Add(int64_t ns) {
  const double v = std::max<double>(1.0, static_cast<double>(ns));
  const int b = std::clamp(static_cast<int>(std::log2(v) * 8.0), 0, kBuckets - 1);
  ++buckets_[b];
  ++count_;
}

void Histogram::Merge(const Histogram& o) {
  for (int i = 0; i < kBuckets; ++i) buckets_[i] += o.buckets_[i];
  count_ += o.count_;
}

double Histogram::Quantile(double q) const {
  if (count_ == 0) return 0;
  const uint64_t rank = static_cast<uint64_t>(std::ceil(q * static_cast<double>(count_)));
  uint64_t seen = 0;
  for (int i = 0; i < kBuckets; ++i) {
    seen += buckets_[i];
    if (seen >= std::max<uint64_t>(rank, 1)) return std::exp2((i + 1) / 8.0);
  }
  return std::exp2(kBuckets / 8.0);
}

std::string Histogram::Encode() const {
  std::string s;
  for (int i = 0; i < kBuckets; ++i) {
    if (buckets_[i] == 0) continue;
    if (!s.empty()) s += ',';
    s += std::to_string(i) + ':' + std::to_string(buckets_[i]);
  }
  return s.empty() ? "-" : s;
}

void Histogram::Decode(const std::string& text) {
  buckets_ = {};
  count_ = 0;
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const size_t colon = item.find(':');
    if (colon == std::string::npos) continue;
    const int i = std::stoi(item.substr(0, colon));
    const uint64_t n = std::stoull(item.substr(colon + 1));
    if (i >= 0 && i < kBuckets) {
      buckets_[i] += n;
      count_ += n;
    }
  }
}

uint64_t RssBytes(int pid) {
  const std::string path =
      pid == 0 ? "/proc/self/statm" : "/proc/" + std::to_string(pid) + "/statm";
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return 0;
  unsigned long long size = 0, resident = 0;
  const int n = std::fscanf(f, "%llu %llu", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE)) : 0;
}

uint64_t HeapInUseBytes() {
  const struct mallinfo2 m = mallinfo2();
  // Small blocks in use plus blocks served by mmap.
  return m.uordblks + m.hblkhd;
}

int OpenDescriptors(int pid) {
  const std::string path = pid == 0 ? "/proc/self/fd" : "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = opendir(path.c_str());
  if (!d) return -1;
  int n = 0;
  while (const dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return pid == 0 ? n - 1 : n;  // less the directory stream's own descriptor
}

}  // namespace ferry::soak
