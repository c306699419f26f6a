// Ferry status codes as NIXL status codes, so that NIXL's agent (and its Python
// binding, which raises an exception class per code) reacts as it would to its
// own backends: a dead peer is NIXL_ERR_REMOTE_DISCONNECT (the agent then drops
// that agent's metadata), a refused key is NIXL_ERR_NOT_ALLOWED.
#pragma once

#include "ferry/status.h"
#include "nixl_types.h"

namespace ferry::nixl_plugin {

inline nixl_status_t to_nixl_status(const Status& status) {
  switch (status.code()) {
    case StatusCode::kOk:
      return NIXL_SUCCESS;
    case StatusCode::kInProgress:
      return NIXL_IN_PROG;
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
      return NIXL_ERR_INVALID_PARAM;
    case StatusCode::kNotFound:
      return NIXL_ERR_NOT_FOUND;
    case StatusCode::kPermissionDenied:
      return NIXL_ERR_NOT_ALLOWED;
    case StatusCode::kPeerDisconnected:
      return NIXL_ERR_REMOTE_DISCONNECT;
    case StatusCode::kCancelled:
      return NIXL_ERR_CANCELED;
    case StatusCode::kNotSupported:
      return NIXL_ERR_NOT_SUPPORTED;
    case StatusCode::kTimeout:
    case StatusCode::kBusy:
    case StatusCode::kProtocolError:
    case StatusCode::kInternal:
      break;
  }
  return NIXL_ERR_BACKEND;
}

}  // namespace ferry::nixl_plugin
