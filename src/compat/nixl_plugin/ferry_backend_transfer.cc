// FERRY backend: transfer requests -- checked and built once (prepXfer), then
// posted (postXfer), polled (checkXfer) and released (releaseReqH).
#include <fmt/format.h>

#include <exception>
#include <unordered_map>

#include "ferry_backend.h"
#include "region_metadata.h"
#include "status_mapping.h"
#include "transfer_request.h"

namespace ferry::nixl_plugin {

namespace {

const char* op_name(nixl_xfer_op_t op) {
  return op == NIXL_READ ? "READ" : "WRITE";
}

// Checks descriptor pair i and appends it to `request`; "" or what is wrong.
std::string add_pair(size_t i, const nixlMetaDesc& local, const nixlMetaDesc& remote,
                     const std::string& remote_agent, TransferRequest& request,
                     std::unordered_map<const nixlBackendMD*, size_t>& descriptor_index) {
  if (local.len != remote.len) {
    return fmt::format("descriptor pair {}: local length {} but remote length {}", i, local.len,
                       remote.len);
  }
  const auto* region = dynamic_cast<const LocalRegionMetadata*>(local.metadataP);
  if (region == nullptr) {
    return fmt::format("local descriptor {} [0x{:x}, +{}) has no FERRY registration", i, local.addr,
                       local.len);
  }
  const auto base = reinterpret_cast<uintptr_t>(region->region.address);
  if (local.addr < base || local.len > region->region.length ||
      local.addr - base > region->region.length - local.len) {
    return fmt::format("local descriptor {} [0x{:x}, +{}) lies outside its region {} [0x{:x}, +{})",
                       i, local.addr, local.len, region->region.id, base, region->region.length);
  }
  const auto* peer_region = dynamic_cast<const RemoteRegionMetadata*>(remote.metadataP);
  if (peer_region == nullptr) {
    return fmt::format("remote descriptor {} [0x{:x}, +{}) has no FERRY metadata of agent '{}'", i,
                       remote.addr, remote.len, remote_agent);
  }
  if (peer_region->agent != remote_agent) {
    return fmt::format("remote descriptor {} is memory of agent '{}', not of agent '{}'", i,
                       peer_region->agent, remote_agent);
  }
  const RemoteDescriptor& d = peer_region->descriptor;
  if (remote.addr < d.address || remote.len > d.length ||
      remote.addr - d.address > d.length - remote.len) {
    return fmt::format(
        "remote descriptor {} [0x{:x}, +{}) lies outside the region agent '{}' advertised "
        "[0x{:x}, +{})",
        i, remote.addr, remote.len, remote_agent, d.address, d.length);
  }
  auto [slot, added] = descriptor_index.try_emplace(peer_region, request.descriptors.size());
  if (added) request.descriptors.push_back(d);
  request.local.push_back({reinterpret_cast<void*>(local.addr), local.len});
  // The descriptor pointer is set once `descriptors` stops growing.
  request.remote.push_back({nullptr, remote.addr - d.address, remote.len});
  request.total_bytes += local.len;
  return {};
}

}  // namespace

nixl_status_t FerryBackendEngine::prepXfer(const nixl_xfer_op_t& operation,
                                           const nixl_meta_dlist_t& local,
                                           const nixl_meta_dlist_t& remote,
                                           const std::string& remote_agent,
                                           nixlBackendReqH*& handle,
                                           const nixl_opt_b_args_t*) const {
  const std::string what = fmt::format("prepXfer {} of {} descriptor(s) with agent '{}'",
                                       op_name(operation), local.descCount(), remote_agent);
  if (operation != NIXL_READ && operation != NIXL_WRITE) {
    log_error(fmt::format("prepXfer: unknown operation {}", static_cast<int>(operation)));
    return NIXL_ERR_INVALID_PARAM;
  }
  if (local.descCount() != remote.descCount()) {
    log_error(fmt::format("{}: {} local but {} remote descriptor(s)", what, local.descCount(),
                          remote.descCount()));
    return NIXL_ERR_INVALID_PARAM;
  }
  if (local.descCount() == 0) {
    log_error(what + ": no descriptors");
    return NIXL_ERR_INVALID_PARAM;
  }
  const auto peer = peer_of(remote_agent);
  if (!peer) {
    log_error(what + ": no connection info of agent '" + remote_agent + "' was loaded");
    return NIXL_ERR_NOT_FOUND;
  }
  try {
    auto request = std::make_unique<TransferRequest>();
    request->operation = operation;
    request->remote_agent = remote_agent;
    request->peer = *peer;
    request->local.reserve(local.descCount());
    request->remote.reserve(local.descCount());
    std::unordered_map<const nixlBackendMD*, size_t> descriptor_index;
    std::vector<size_t> owner;  // remote[i] -> its descriptor
    owner.reserve(local.descCount());
    for (int i = 0; i < local.descCount(); ++i) {
      const std::string problem =
          add_pair(i, local[i], remote[i], remote_agent, *request, descriptor_index);
      if (!problem.empty()) {
        log_error(what + ": " + problem);
        return NIXL_ERR_INVALID_PARAM;
      }
      owner.push_back(descriptor_index.at(remote[i].metadataP));
    }
    for (size_t i = 0; i < owner.size(); ++i) {
      request->remote[i].descriptor = &request->descriptors[owner[i]];
    }
    handle = request.release();
    return NIXL_SUCCESS;
  } catch (const std::exception& e) {
    log_error(what + ": " + e.what());
    return NIXL_ERR_BACKEND;
  }
}

nixl_status_t FerryBackendEngine::postXfer(const nixl_xfer_op_t& operation,
                                           const nixl_meta_dlist_t&, const nixl_meta_dlist_t&,
                                           const std::string& remote_agent,
                                           nixlBackendReqH*& handle,
                                           const nixl_opt_b_args_t* opt_args) const {
  auto* request = dynamic_cast<TransferRequest*>(handle);
  if (request == nullptr) {
    log_error("postXfer " + std::string(op_name(operation)) + " to agent '" + remote_agent +
              "': the handle is not a FERRY request (prepXfer makes them)");
    return NIXL_ERR_INVALID_PARAM;
  }
  if (request->in_flight != 0) {
    log_error(fmt::format("postXfer {} to agent '{}': the request is still in flight (transfer {})",
                          op_name(request->operation), request->remote_agent, request->in_flight));
    return NIXL_ERR_REPOST_ACTIVE;
  }
  try {
    std::optional<Bytes> notification;
    if (opt_args != nullptr && opt_args->hasNotif) {
      notification = encode_notification(opt_args->notifMsg);
    }
    request->notification_after_read.reset();
    Result<TransferId> posted = TransferId{0};
    if (request->operation == NIXL_WRITE) {
      std::optional<ByteView> carried;
      if (notification) carried = ByteView(*notification);
      posted = engine_->write_async(request->peer, request->local, request->remote, carried);
    } else {
      posted = engine_->read_async(request->peer, request->local, request->remote);
      request->notification_after_read = std::move(notification);
    }
    if (!posted.ok()) {
      log_error(fmt::format("postXfer {} of {} bytes in {} descriptor(s) to agent '{}': {}",
                            op_name(request->operation), request->total_bytes,
                            request->local.size(), request->remote_agent,
                            posted.status().to_string()));
      request->last_status = to_nixl_status(posted.status());
      return request->last_status;
    }
    request->in_flight = posted.value();
    return checkXfer(request);  // small transfers may be done already
  } catch (const std::exception& e) {
    log_error("postXfer to agent '" + request->remote_agent + "': " + e.what());
    return NIXL_ERR_BACKEND;
  }
}

nixl_status_t FerryBackendEngine::checkXfer(nixlBackendReqH* handle) const {
  auto* request = dynamic_cast<TransferRequest*>(handle);
  if (request == nullptr) {
    log_error("checkXfer: the handle is not a FERRY request");
    return NIXL_ERR_INVALID_PARAM;
  }
  if (request->in_flight == 0) return request->last_status;
  const Status status = engine_->test(request->in_flight);
  if (status.code() == StatusCode::kInProgress) return NIXL_IN_PROG;
  const TransferId finished = request->in_flight;
  request->in_flight = 0;
  if (!status.ok()) {
    log_error(
        fmt::format("{} of {} bytes in {} descriptor(s) with agent '{}' (transfer {}) "
                    "failed: {}",
                    op_name(request->operation), request->total_bytes, request->local.size(),
                    request->remote_agent, finished, status.to_string()));
    request->last_status = to_nixl_status(status);
    return request->last_status;
  }
  request->last_status = NIXL_SUCCESS;
  if (request->notification_after_read) {
    const Status sent = engine_->notify(request->peer, *request->notification_after_read);
    request->notification_after_read.reset();
    if (!sent.ok()) {
      log_error(fmt::format("READ from agent '{}' completed but its notification was not sent: {}",
                            request->remote_agent, sent.to_string()));
      request->last_status = to_nixl_status(sent);
    }
  }
  return request->last_status;
}

// Cancels what is in flight (NIXL releases a running request to abort it).
nixl_status_t FerryBackendEngine::releaseReqH(nixlBackendReqH* handle) const {
  auto* request = dynamic_cast<TransferRequest*>(handle);
  if (request == nullptr) {
    log_error("releaseReqH: the handle is not a FERRY request");
    return NIXL_ERR_INVALID_PARAM;
  }
  if (request->in_flight != 0) {
    const Status cancelled = engine_->cancel(request->in_flight);
    if (!cancelled.ok() && cancelled.code() != StatusCode::kNotFound) {
      log_warning(fmt::format("releaseReqH: cancel of transfer {} with agent '{}': {}",
                              request->in_flight, request->remote_agent, cancelled.to_string()));
    }
    (void)engine_->test(request->in_flight);  // reaps the id
  }
  delete request;
  return NIXL_SUCCESS;
}

}  // namespace ferry::nixl_plugin
