// Bounds-checked little-endian writer/reader used by every codec (metadata,
// descriptors, wire frames). A reader never reads past its span: a short or
// malformed input makes ok() false instead of touching memory it must not.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ferry {

class ByteWriter {
 public:
  explicit ByteWriter(std::vector<uint8_t>& out) : out_(out) {}
  void u8(uint8_t v) { out_.push_back(v); }
  void u16(uint16_t v) { put(&v, sizeof v); }
  void u32(uint32_t v) { put(&v, sizeof v); }
  void u64(uint64_t v) { put(&v, sizeof v); }
  void bytes(const void* p, size_t n) { put(p, n); }
  // Length-prefixed (u16) string.
  void str16(std::string_view s) {
    u16(static_cast<uint16_t>(s.size()));
    put(s.data(), s.size());
  }

 private:
  void put(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  std::vector<uint8_t>& out_;
};

class ByteReader {
 public:
  explicit ByteReader(std::span<const uint8_t> in) : in_(in) {}
  bool ok() const { return ok_; }
  size_t remaining() const { return ok_ ? in_.size() - pos_ : 0; }
  size_t position() const { return pos_; }
  uint8_t u8() { return get<uint8_t>(); }
  uint16_t u16() { return get<uint16_t>(); }
  uint32_t u32() { return get<uint32_t>(); }
  uint64_t u64() { return get<uint64_t>(); }
  std::span<const uint8_t> bytes(size_t n) {
    if (!take(n)) return {};
    return in_.subspan(pos_ - n, n);
  }
  std::string str16() {
    const uint16_t n = u16();
    auto b = bytes(n);
    return ok_ ? std::string(reinterpret_cast<const char*>(b.data()), b.size()) : std::string();
  }

 private:
  bool take(size_t n) {
    if (!ok_ || n > in_.size() - pos_) {
      ok_ = false;
      return false;
    }
    pos_ += n;
    return true;
  }
  template <typename T>
  T get() {
    T v{};
    if (take(sizeof(T))) std::memcpy(&v, in_.data() + pos_ - sizeof(T), sizeof(T));
    return v;
  }
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace ferry
