// NIXL backend "FERRY": NIXL's backend engine (plugin API v1) over one
// ferry::Engine. NIXL's agent keeps the descriptor lists, the metadata exchange
// between agents and the transfer handles; this class moves the bytes.
//
// What NIXL hands the backend and what it means here:
//   conn info (getConnInfo)       ferry::Engine::metadata(), the peer connects with it
//   public data (getPublicData)   a 64-byte RemoteDescriptor of one registered region
//   local MD  (registerMem)       LocalRegionMetadata: the Ferry region
//   remote MD (loadRemoteMD)      RemoteRegionMetadata: the peer's RemoteDescriptor
//   request   (prepXfer)          TransferRequest: Ferry iovs, built once, posted many times
//   notification                  a Ferry notification carrying the sender's agent name
//
// Threads: NIXL may call from several threads at once (its progress, listener
// and user threads); ferry::Engine is thread-safe and the agent -> peer table
// has its own lock. A request is used by one thread at a time (NIXL's rule).
// Errors: every refusal returns a NIXL status and logs what was wrong through
// Ferry's logger; nothing here throws into NIXL or aborts.
#pragma once

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "backend/backend_engine.h"
#include "ferry/engine.h"

namespace ferry::nixl_plugin {

class FerryBackendEngine : public nixlBackendEngine {
 public:
  explicit FerryBackendEngine(const nixlBackendInitParams* init_params);
  ~FerryBackendEngine() override;

  // Remote transfers with notifications; no transfers within one agent (a
  // Ferry engine moves bytes between engines) and so no local metadata.
  bool supportsRemote() const override { return true; }
  bool supportsLocal() const override { return false; }
  bool supportsNotif() const override { return true; }
  nixl_mem_list_t getSupportedMems() const override;

  // --- memory (ferry_backend_memory.cc) -------------------------------------
  nixl_status_t registerMem(const nixlBlobDesc& mem, const nixl_mem_t& nixl_mem,
                            nixlBackendMD*& out) override;
  nixl_status_t deregisterMem(nixlBackendMD* meta) override;
  nixl_status_t getPublicData(const nixlBackendMD* meta, std::string& str) const override;
  nixl_status_t loadRemoteMD(const nixlBlobDesc& input, const nixl_mem_t& nixl_mem,
                             const std::string& remote_agent, nixlBackendMD*& output) override;
  nixl_status_t loadLocalMD(nixlBackendMD* input, nixlBackendMD*& output) override;
  nixl_status_t unloadMD(nixlBackendMD* input) override;

  // --- peers (ferry_backend.cc) ---------------------------------------------
  nixl_status_t getConnInfo(std::string& str) const override;
  nixl_status_t loadRemoteConnInfo(const std::string& remote_agent,
                                   const std::string& remote_conn_info) override;
  nixl_status_t connect(const std::string& remote_agent) override;
  nixl_status_t disconnect(const std::string& remote_agent) override;

  // --- transfers (ferry_backend_transfer.cc) --------------------------------
  nixl_status_t prepXfer(const nixl_xfer_op_t& operation, const nixl_meta_dlist_t& local,
                         const nixl_meta_dlist_t& remote, const std::string& remote_agent,
                         nixlBackendReqH*& handle,
                         const nixl_opt_b_args_t* opt_args = nullptr) const override;
  nixl_status_t postXfer(const nixl_xfer_op_t& operation, const nixl_meta_dlist_t& local,
                         const nixl_meta_dlist_t& remote, const std::string& remote_agent,
                         nixlBackendReqH*& handle,
                         const nixl_opt_b_args_t* opt_args = nullptr) const override;
  nixl_status_t checkXfer(nixlBackendReqH* handle) const override;
  nixl_status_t releaseReqH(nixlBackendReqH* handle) const override;

  // --- notifications (ferry_backend_notifications.cc) -----------------------
  nixl_status_t getNotifs(notif_list_t& notif_list) override;
  nixl_status_t genNotif(const std::string& remote_agent, const std::string& msg) const override;

  // The Ferry peer NIXL's agent `remote_agent` runs on (loadRemoteConnInfo).
  std::optional<PeerId> peer_of(const std::string& remote_agent) const;
  // A notification as it goes over Ferry: this agent's name, then `msg`.
  Bytes encode_notification(const std::string& msg) const;
  // Logs one refusal or failure, naming this agent: "nixl backend FERRY (agent
  // 'a'): <what>".
  void log_error(const std::string& what) const;
  void log_warning(const std::string& what) const;
  const std::string& agent_name() const { return localAgent; }
  Engine& engine() const { return *engine_; }

 private:
  std::unique_ptr<Engine> engine_;
  mutable std::mutex peers_mutex_;
  std::unordered_map<std::string, PeerId> peers_;  // agent name -> Ferry peer
};

// The backend parameters NIXL shows for FERRY (get_plugin_params) and their
// defaults: "listen" (host:port the engine listens on; FERRY_NIXL_LISTEN when
// absent, else 0.0.0.0:0) and any Ferry option as "component.name" (e.g.
// "tcp.streams"), as ferry::EngineConfig::options takes them.
nixl_b_params_t backend_parameter_defaults();

}  // namespace ferry::nixl_plugin
