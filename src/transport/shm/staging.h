// The shm transport's staging path: shared memory between two processes that
// may not use cross-memory attach (ptrace policy, different users, user
// namespaces). Each side of a connection creates one area (a sealed memfd)
// for the requests it initiates and passes it to the peer over the Unix
// socket (SCM_RIGHTS) during the handshake. The initiator copies a write's
// bytes into its area and names offsets in the request; the target checks the
// request exactly as in cross-memory attach mode and copies between the area
// and its region. A read is the mirror: the target fills the named range, the
// initiator copies it out after the response.
//
// The area belongs to the initiator: it alone hands out ranges (StagingRing),
// and a range is free again once its response arrived (and, for a read, its
// bytes were copied out). So no credit messages are needed; the response is
// the credit.
//
// The target distrusts the area: it maps it only if the memfd is sealed
// against shrinking (else the peer could truncate it and fault the target
// with SIGBUS) and its size is the one announced, and it checks every offset
// and length of every request against the mapping's size.
//
// Header-only: the transport's sources are listed outside this folder.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "fmt/format.h"
#include "transport/shm/cma.h"

namespace ferry::shm {

constexpr uint64_t kMinStagingBytes = 1ull << 20;
constexpr uint64_t kMaxStagingBytes = 4ull << 30;
// Ranges start on cache-line boundaries: copies into and out of them run at
// full speed, and two requests never share a line.
constexpr uint64_t kStagingAlign = 64;
// What a received area must be sealed with: it can neither shrink (a fault
// in the mapping process) nor lose its seals.
constexpr int kRequiredSeals = F_SEAL_SHRINK | F_SEAL_SEAL;

// One mapped memfd: created here (ours) or received from the peer (theirs).
class StagingArea {
 public:
  StagingArea() = default;
  StagingArea(const StagingArea&) = delete;
  StagingArea& operator=(const StagingArea&) = delete;
  StagingArea(StagingArea&& o) noexcept { *this = std::move(o); }
  StagingArea& operator=(StagingArea&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(fd_, o.fd_);
      std::swap(data_, o.data_);
      std::swap(size_, o.size_);
    }
    return *this;
  }
  ~StagingArea() { reset(); }

  // A new area of `bytes` (memfd_create, sized, sealed against shrinking and
  // growing, mapped shared). `name` shows in /proc/<pid>/fd.
  static Result<StagingArea> create(uint64_t bytes, const std::string& name) {
    if (bytes < kMinStagingBytes || bytes > kMaxStagingBytes) {
      return err::InvalidArgument(fmt::format("shm: staging area of {} bytes (allowed {} to {})",
                                              bytes, kMinStagingBytes, kMaxStagingBytes));
    }
    StagingArea a;
    a.fd_ = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (a.fd_ < 0) {
      return err::NotSupported(fmt::format("shm: memfd_create: {}", errno_text(errno)));
    }
    if (::ftruncate(a.fd_, static_cast<off_t>(bytes)) != 0) {
      return err::Internal(
          fmt::format("shm: sizing the staging area to {} bytes: {}", bytes, errno_text(errno)));
    }
    if (::fcntl(a.fd_, F_ADD_SEALS, kRequiredSeals | F_SEAL_GROW) != 0) {
      return err::Internal(fmt::format("shm: sealing the staging area: {}", errno_text(errno)));
    }
    if (Status s = a.map(bytes); !s.ok()) return s;
    return a;
  }

  // Maps an area the peer sent (takes `fd`, closing it on failure): it must be
  // a memfd sealed as kRequiredSeals says, of exactly `announced` bytes.
  static Result<StagingArea> adopt(int fd, uint64_t announced) {
    StagingArea a;
    a.fd_ = fd;
    if (announced < kMinStagingBytes || announced > kMaxStagingBytes) {
      return err::ProtocolError(
          fmt::format("shm: the peer announced a staging area of {} bytes (allowed {} to {})",
                      announced, kMinStagingBytes, kMaxStagingBytes));
    }
    const int seals = ::fcntl(fd, F_GET_SEALS);
    if (seals < 0) {
      return err::ProtocolError(
          fmt::format("shm: the peer's staging area is not a sealable memfd: F_GET_SEALS: {}",
                      errno_text(errno)));
    }
    if ((seals & kRequiredSeals) != kRequiredSeals) {
      return err::ProtocolError(
          fmt::format("shm: the peer's staging area has seals {:#x}, expected at least {:#x} "
                      "(F_SEAL_SHRINK | F_SEAL_SEAL): it could shrink under our mapping",
                      seals, kRequiredSeals));
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      return err::Internal(
          fmt::format("shm: fstat of the peer's staging area: {}", errno_text(errno)));
    }
    if (static_cast<uint64_t>(st.st_size) != announced) {
      return err::ProtocolError(
          fmt::format("shm: the peer's staging area is {} bytes, it announced {}",
                      static_cast<uint64_t>(st.st_size), announced));
    }
    if (Status s = a.map(announced); !s.ok()) return s;
    a.close_fd();  // the mapping keeps the memory
    return a;
  }

  // Backs every page of the mapping with memory now (MADV_POPULATE_WRITE; on
  // kernels before 5.14 one read per page, which allocates shmem pages too)
  // without changing its bytes. A connection in staging mode copies through
  // all of its areas: populated when it is set up, they cost no page fault on
  // the data path, stay level in RSS from then on, and where memory for them
  // is short the connection fails here with an error naming the area instead
  // of a SIGBUS in a later copy. `what` names the area in the error.
  Status populate(std::string_view what) const {
    if (data_ == nullptr) return Status::Ok();
    if (::madvise(data_, size_, MADV_POPULATE_WRITE) == 0) return Status::Ok();
    const int e = errno;
    if (e != EINVAL) {
      return err::Internal(fmt::format(
          "shm: backing {} ({} bytes) with memory: {} (free memory, or lower shm.staging_bytes)",
          what, size_, errno_text(e)));
    }
    const long page = ::sysconf(_SC_PAGESIZE);
    for (uint64_t off = 0; off < size_; off += static_cast<uint64_t>(page)) {
      (void)*static_cast<volatile const uint8_t*>(data_ + off);
    }
    return Status::Ok();
  }

  bool valid() const { return data_ != nullptr; }
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }
  // True when [offset, offset + length) lies inside the mapping.
  bool contains(uint64_t offset, uint64_t length) const {
    return offset <= size_ && length <= size_ - offset;
  }

  // The descriptor is needed only to pass the area to the peer.
  void close_fd() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  void reset() {
    if (data_) ::munmap(data_, size_);
    if (fd_ >= 0) ::close(fd_);
    data_ = nullptr;
    size_ = 0;
    fd_ = -1;
  }

 private:
  Status map(uint64_t bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) {
      return err::Internal(
          fmt::format("shm: mapping a staging area of {} bytes: {}", bytes, errno_text(errno)));
    }
    data_ = static_cast<uint8_t*>(p);
    size_ = bytes;
    return Status::Ok();
  }

  int fd_ = -1;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// Ranges of the initiator's own area for requests in flight: handed out in
// order around a ring, given back in any order (parallel copy threads answer
// out of order); space comes back once every older range was given back.
// Not thread-safe: the connection's staging mutex guards it.
class StagingRing {
 public:
  StagingRing() = default;
  explicit StagingRing(uint64_t capacity) : capacity_(capacity) {}

  uint64_t capacity() const { return capacity_; }
  size_t ranges() const { return live_.size(); }

  // The offset of `length` contiguous bytes, or nothing while there is no
  // room (a range never wraps around the end).
  std::optional<uint64_t> allocate(uint64_t length) {
    const uint64_t need = (length + kStagingAlign - 1) / kStagingAlign * kStagingAlign;
    if (need == 0 || need > capacity_) return std::nullopt;
    uint64_t at;
    if (spans_.empty()) {
      at = 0;
    } else {
      const uint64_t tail = spans_.front().offset;
      const uint64_t head = spans_.back().offset + spans_.back().length;
      if (spans_.back().offset >= spans_.front().offset) {  // [tail, head) in use
        if (capacity_ - head >= need) {
          at = head;
        } else if (tail >= need) {
          at = 0;  // the end's remainder stays unused until the ring passes it
        } else {
          return std::nullopt;
        }
      } else {  // wrapped: [tail, end) and [0, head) in use
        if (tail - head < need) return std::nullopt;
        at = head;
      }
    }
    live_.emplace(at, first_seq_ + spans_.size());
    spans_.push_back({at, need, false});
    return at;
  }

  // Gives back the range that allocate() returned at `offset`; false if no
  // such range is in use.
  bool release(uint64_t offset) {
    auto it = live_.find(offset);
    if (it == live_.end()) return false;
    spans_[it->second - first_seq_].released = true;
    live_.erase(it);
    while (!spans_.empty() && spans_.front().released) {
      spans_.pop_front();
      ++first_seq_;
    }
    return true;
  }

 private:
  struct Span {
    uint64_t offset;
    uint64_t length;
    bool released;
  };
  uint64_t capacity_ = 0;
  std::deque<Span> spans_;                       // oldest first
  std::unordered_map<uint64_t, uint64_t> live_;  // offset → sequence number
  uint64_t first_seq_ = 0;                       // sequence number of spans_.front()
};

}  // namespace ferry::shm
