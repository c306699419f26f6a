// FERRY backend: NIXL notifications over Ferry notifications.
//
// NIXL delivers a notification with the name of the agent that sent it, and a
// target may receive one before it has loaded the sender's metadata (NIXL's
// examples send the first notification that way). So each notification
// carries its sender's name: "FNN1", the name's length (4 bytes, little
// endian), the name, then NIXL's message.
#include <fmt/format.h>

#include <cstring>
#include <exception>

#include "ferry_backend.h"
#include "status_mapping.h"

namespace ferry::nixl_plugin {

namespace {

constexpr char kMagic[4] = {'F', 'N', 'N', '1'};
constexpr size_t kHeaderSize = sizeof(kMagic) + 4;

struct DecodedNotification {
  std::string sender;
  std::string message;
};

// The notification, or "" in `problem` saying why it is not one of ours.
std::optional<DecodedNotification> decode(const Bytes& payload, std::string& problem) {
  if (payload.size() < kHeaderSize || std::memcmp(payload.data(), kMagic, sizeof(kMagic)) != 0) {
    problem = fmt::format("{} bytes without the FERRY notification header", payload.size());
    return std::nullopt;
  }
  uint32_t name_length = 0;
  for (int i = 3; i >= 0; --i) name_length = (name_length << 8) | payload[sizeof(kMagic) + i];
  if (name_length > payload.size() - kHeaderSize) {
    problem = fmt::format("sender name of {} bytes in a notification of {} bytes", name_length,
                          payload.size());
    return std::nullopt;
  }
  const auto* name = reinterpret_cast<const char*>(payload.data() + kHeaderSize);
  DecodedNotification decoded;
  decoded.sender.assign(name, name_length);
  decoded.message.assign(name + name_length, payload.size() - kHeaderSize - name_length);
  return decoded;
}

}  // namespace

Bytes FerryBackendEngine::encode_notification(const std::string& msg) const {
  Bytes out;
  out.reserve(kHeaderSize + localAgent.size() + msg.size());
  for (const char c : kMagic) out.push_back(static_cast<uint8_t>(c));
  const auto name_length = static_cast<uint32_t>(localAgent.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(name_length >> (8 * i)));
  out.insert(out.end(), localAgent.begin(), localAgent.end());
  out.insert(out.end(), msg.begin(), msg.end());
  return out;
}

nixl_status_t FerryBackendEngine::genNotif(const std::string& remote_agent,
                                           const std::string& msg) const {
  const auto peer = peer_of(remote_agent);
  if (!peer) {
    log_error(fmt::format("genNotif of {} bytes: no connection info of agent '{}' was loaded",
                          msg.size(), remote_agent));
    return NIXL_ERR_NOT_FOUND;
  }
  try {
    const Status sent = engine_->notify(*peer, encode_notification(msg));
    if (!sent.ok()) {
      log_error(fmt::format("genNotif of {} bytes to agent '{}': {}", msg.size(), remote_agent,
                            sent.to_string()));
      return to_nixl_status(sent);
    }
    return NIXL_SUCCESS;
  } catch (const std::exception& e) {
    log_error("genNotif to agent '" + remote_agent + "': " + e.what());
    return NIXL_ERR_BACKEND;
  }
}

// A notification that is not one of ours (a Ferry peer outside NIXL) is
// logged and dropped: NIXL has no sender name to file it under.
nixl_status_t FerryBackendEngine::getNotifs(notif_list_t& notif_list) {
  try {
    for (const Notification& received : engine_->take_notifications()) {
      std::string problem;
      auto decoded = decode(received.payload, problem);
      if (!decoded) {
        log_warning(fmt::format("dropped a notification from Ferry peer {:016x}: {}", received.peer,
                                problem));
        continue;
      }
      notif_list.emplace_back(std::move(decoded->sender), std::move(decoded->message));
    }
    return NIXL_SUCCESS;
  } catch (const std::exception& e) {
    log_error(std::string("getNotifs: ") + e.what());
    return NIXL_ERR_BACKEND;
  }
}

}  // namespace ferry::nixl_plugin
