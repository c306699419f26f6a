#include "ferry/status.h"

#include <string>

namespace ferry {

std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "Ok";
    case StatusCode::kInProgress: return "InProgress";
    case StatusCode::kInvalidArgument: return "InvalidArgument";
    case StatusCode::kNotFound: return "NotFound";
    case StatusCode::kPermissionDenied: return "PermissionDenied";
    case StatusCode::kOutOfRange: return "OutOfRange";
    case StatusCode::kPeerDisconnected: return "PeerDisconnected";
    case StatusCode::kTimeout: return "Timeout";
    case StatusCode::kCancelled: return "Cancelled";
    case StatusCode::kNotSupported: return "NotSupported";
    case StatusCode::kBusy: return "Busy";
    case StatusCode::kProtocolError: return "ProtocolError";
    case StatusCode::kInternal: return "Internal";
  }
  return "Unknown";
}

std::string Status::to_string() const {
  std::string s(status_code_name(code_));
  if (!message_.empty()) {
    s += ": ";
    s += message_;
  }
  return s;
}

}  // namespace ferry
