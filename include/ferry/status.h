// One status type for the whole engine: a code that programs branch on and a
// message that names the thing (region, peer, offset, expected vs got).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace ferry {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInProgress,        // async transfer not finished yet
  kInvalidArgument,   // the caller passed something malformed
  kNotFound,          // region, peer or transfer does not exist (or no longer does)
  kPermissionDenied,  // key mismatch or access not granted
  kOutOfRange,        // [offset, offset+len) outside the region or advertised range
  kPeerDisconnected,  // the peer closed, died or stopped answering
  kTimeout,           // a wait ran out of time; the transfer goes on
  kCancelled,         // cancelled by the caller
  kNotSupported,      // feature missing in this build, on this machine or transport
  kBusy,              // transient: retry later
  kProtocolError,     // the peer sent something that breaks the wire contract
  kInternal,          // a bug or an unexpected system failure
};

// Stable lower-case name of a code, e.g. "PeerDisconnected".
std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "PermissionDenied: key mismatch for region 7 ..."
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Factories that read well at the call site: return err::OutOfRange("...").
namespace err {
inline Status InvalidArgument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status PermissionDenied(std::string m) {
  return {StatusCode::kPermissionDenied, std::move(m)};
}
inline Status OutOfRange(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status PeerDisconnected(std::string m) {
  return {StatusCode::kPeerDisconnected, std::move(m)};
}
inline Status Timeout(std::string m) { return {StatusCode::kTimeout, std::move(m)}; }
inline Status Cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
inline Status NotSupported(std::string m) { return {StatusCode::kNotSupported, std::move(m)}; }
inline Status Busy(std::string m) { return {StatusCode::kBusy, std::move(m)}; }
inline Status ProtocolError(std::string m) { return {StatusCode::kProtocolError, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
}  // namespace err

// A value or the Status explaining why there is none (std::expected is C++23).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {}  // NOLINT(google-explicit-constructor)

  bool ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return ok(); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace ferry
