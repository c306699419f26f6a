// FERRY backend: construction from NIXL's parameters, connection info, peers,
// logging. Memory, transfers and notifications are in their own files.
#include "ferry_backend.h"

#include <spdlog/spdlog.h>

#include <cstdlib>
#include <exception>

#include "status_mapping.h"

namespace ferry::nixl_plugin {

namespace {

constexpr const char* kListenKey = "listen";
constexpr const char* kDefaultListen = "0.0.0.0:0";

std::string default_listen() {
  const char* from_environment = std::getenv("FERRY_NIXL_LISTEN");
  return from_environment != nullptr && *from_environment != '\0' ? from_environment
                                                                  : kDefaultListen;
}

// NIXL's parameters as an EngineConfig. A key Ferry does not know is refused,
// never ignored: a misspelt option would otherwise silently do nothing.
Result<EngineConfig> engine_config_from(const nixl_b_params_t& params) {
  EngineConfig config;
  config.listen = default_listen();
  for (const auto& [key, value] : params) {
    if (key == kListenKey) {
      config.listen = value;
    } else if (key.find('.') != std::string::npos) {
      config.options[key] = value;  // Engine::create checks name and value
    } else {
      return err::InvalidArgument(
          "unknown FERRY backend parameter '" + key + "' (value '" + value +
          "'): FERRY takes 'listen' (host:port) and Ferry options as 'component.name', "
          "e.g. 'tcp.streams'");
    }
  }
  return config;
}

}  // namespace

nixl_b_params_t backend_parameter_defaults() {
  return {{kListenKey, default_listen()}};
}

FerryBackendEngine::FerryBackendEngine(const nixlBackendInitParams* init_params)
    : nixlBackendEngine(init_params) {
  try {
    auto config = engine_config_from(getCustomParams());
    if (!config.ok()) {
      log_error(config.status().message());
      initErr = true;
      return;
    }
    auto engine = Engine::create(config.value());
    if (!engine.ok()) {
      log_error("cannot start the Ferry engine (listen '" + config->listen +
                "'): " + engine.status().to_string());
      initErr = true;
      return;
    }
    engine_ = std::move(engine.value());
    spdlog::info("nixl backend FERRY (agent '{}'): Ferry engine {:016x} listening on {}",
                 localAgent, engine_->id(), engine_->listen_address());
  } catch (const std::exception& e) {
    log_error(std::string("cannot start the Ferry engine: ") + e.what());
    initErr = true;
  }
}

FerryBackendEngine::~FerryBackendEngine() = default;

nixl_mem_list_t FerryBackendEngine::getSupportedMems() const {
  return {DRAM_SEG, VRAM_SEG};
}

void FerryBackendEngine::log_error(const std::string& what) const {
  spdlog::error("nixl backend FERRY (agent '{}'): {}", localAgent, what);
}

void FerryBackendEngine::log_warning(const std::string& what) const {
  spdlog::warn("nixl backend FERRY (agent '{}'): {}", localAgent, what);
}

nixl_status_t FerryBackendEngine::getConnInfo(std::string& str) const {
  const Bytes metadata = engine_->metadata();
  str.assign(metadata.begin(), metadata.end());
  return NIXL_SUCCESS;
}

// Connects at once, as NIXL's UCX backend does when it loads connection info:
// NIXL calls connect() only when the user asks for it (make_connection), and a
// transfer must find the peer connected.
nixl_status_t FerryBackendEngine::loadRemoteConnInfo(const std::string& remote_agent,
                                                     const std::string& remote_conn_info) {
  if (remote_agent == localAgent) {
    log_error("connection info of this agent itself was loaded as a remote agent's");
    return NIXL_ERR_INVALID_PARAM;
  }
  try {
    const ByteView metadata(reinterpret_cast<const uint8_t*>(remote_conn_info.data()),
                            remote_conn_info.size());
    auto peer = engine_->connect(metadata);
    if (!peer.ok()) {
      log_error("cannot connect to agent '" + remote_agent + "' (" +
                std::to_string(remote_conn_info.size()) +
                " bytes of connection info): " + peer.status().to_string());
      return to_nixl_status(peer.status());
    }
    std::lock_guard lock(peers_mutex_);
    peers_[remote_agent] = peer.value();
    return NIXL_SUCCESS;
  } catch (const std::exception& e) {
    log_error("cannot connect to agent '" + remote_agent + "': " + e.what());
    return NIXL_ERR_BACKEND;
  }
}

nixl_status_t FerryBackendEngine::connect(const std::string& remote_agent) {
  if (peer_of(remote_agent)) return NIXL_SUCCESS;  // connected when its info was loaded
  log_error("connect: no connection info of agent '" + remote_agent +
            "' was loaded (add its metadata first)");
  return NIXL_ERR_NOT_FOUND;
}

// Forgets the agent; the Ferry connection stays (the engine caches it by peer,
// and a later loadRemoteConnInfo of the same agent reuses it).
nixl_status_t FerryBackendEngine::disconnect(const std::string& remote_agent) {
  std::lock_guard lock(peers_mutex_);
  peers_.erase(remote_agent);
  return NIXL_SUCCESS;
}

std::optional<PeerId> FerryBackendEngine::peer_of(const std::string& remote_agent) const {
  std::lock_guard lock(peers_mutex_);
  const auto it = peers_.find(remote_agent);
  if (it == peers_.end()) return std::nullopt;
  return it->second;
}

}  // namespace ferry::nixl_plugin
