// One NIXL transfer request on Ferry: the iovs built once by prepXfer, posted
// by postXfer as often as NIXL reposts it, polled by checkXfer.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "backend/backend_aux.h"
#include "ferry/types.h"

namespace ferry::nixl_plugin {

class TransferRequest : public nixlBackendReqH {
 public:
  nixl_xfer_op_t operation = NIXL_WRITE;
  std::string remote_agent;
  PeerId peer = 0;
  std::vector<LocalIov> local;
  // The peer's descriptors, copied (the agent may unload its metadata while
  // the request lives); remote[i].descriptor points into this vector.
  std::vector<RemoteDescriptor> descriptors;
  std::vector<RemoteIov> remote;
  uint64_t total_bytes = 0;

  // The posted transfer, 0 when none is in flight.
  TransferId in_flight = 0;
  // A READ's notification, sent when the read completes (Ferry's reads carry
  // none; the target learns of the read from it).
  std::optional<Bytes> notification_after_read;
  // The outcome of the last post once it finished.
  nixl_status_t last_status = NIXL_SUCCESS;
};

}  // namespace ferry::nixl_plugin
