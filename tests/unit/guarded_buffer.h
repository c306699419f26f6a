// A copy of some bytes placed so that the last byte sits right before a
// PROT_NONE page (and the first byte right after one when the data fills whole
// pages): a decoder that reads one byte past its span crashes the test instead
// of silently reading neighbouring heap memory.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>

namespace ferry::testing {

class GuardedBuffer {
 public:
  explicit GuardedBuffer(std::span<const uint8_t> data) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t data_pages = (data.size() + page - 1) / page;
    map_len_ = (data_pages + 2) * page;  // guard + data + guard
    void* m = mmap(nullptr, map_len_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::runtime_error("mmap failed");
    map_ = static_cast<uint8_t*>(m);
    if (data_pages > 0 && mprotect(map_ + page, data_pages * page, PROT_READ | PROT_WRITE) != 0) {
      throw std::runtime_error("mprotect failed");
    }
    uint8_t* end = map_ + page + data_pages * page;  // first byte of the trailing guard
    data_ = end - data.size();
    if (!data.empty()) std::memcpy(data_, data.data(), data.size());
    size_ = data.size();
    if (data_pages > 0) mprotect(map_ + page, data_pages * page, PROT_READ);
  }
  ~GuardedBuffer() { munmap(map_, map_len_); }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;

  std::span<const uint8_t> span() const { return {data_, size_}; }

 private:
  uint8_t* map_ = nullptr;
  size_t map_len_ = 0;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace ferry::testing
