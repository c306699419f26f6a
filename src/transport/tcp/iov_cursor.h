// A position inside a list of iovecs, for resuming partial readv/writev.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace ferry::tcp {

class IovCursor {
 public:
  void add(void* base, size_t length) {
    if (length == 0) return;
    iov_.push_back({base, length});
    remaining_ += length;
  }
  void clear() {
    iov_.clear();
    index_ = offset_ = 0;
    remaining_ = 0;
  }
  void reserve(size_t n) { iov_.reserve(n); }
  uint64_t remaining() const { return remaining_; }
  bool done() const { return remaining_ == 0; }

  // Copies up to `max` iovecs starting at the cursor into `out`.
  int fill(iovec* out, int max) const {
    int n = 0;
    for (size_t i = index_; i < iov_.size() && n < max; ++i, ++n) {
      out[n] = iov_[i];
      if (i == index_) {
        out[n].iov_base = static_cast<uint8_t*>(out[n].iov_base) + offset_;
        out[n].iov_len -= offset_;
      }
    }
    return n;
  }

  // Copies the bytes not yet consumed into `owned` and points the cursor at
  // that copy, so the original memory is no longer referenced.
  void detach_into(std::vector<uint8_t>* owned) {
    owned->resize(remaining_);
    size_t at = 0;
    for (size_t i = index_; i < iov_.size(); ++i) {
      const size_t skip = i == index_ ? offset_ : 0;
      std::memcpy(owned->data() + at, static_cast<uint8_t*>(iov_[i].iov_base) + skip,
                  iov_[i].iov_len - skip);
      at += iov_[i].iov_len - skip;
    }
    const uint64_t n = remaining_;
    clear();
    add(owned->data(), n);
  }

  void advance(size_t n) {
    remaining_ -= n;
    while (n > 0) {
      const size_t left = iov_[index_].iov_len - offset_;
      if (n < left) {
        offset_ += n;
        return;
      }
      n -= left;
      ++index_;
      offset_ = 0;
    }
    while (index_ < iov_.size() && iov_[index_].iov_len == offset_) {
      ++index_;
      offset_ = 0;
    }
  }

 private:
  std::vector<iovec> iov_;
  size_t index_ = 0;
  size_t offset_ = 0;
  uint64_t remaining_ = 0;
};

}  // namespace ferry::tcp
