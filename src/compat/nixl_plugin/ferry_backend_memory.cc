// FERRY backend: registration of local memory and the metadata of peers'.
#include <fmt/format.h>

#include <exception>

#include "ferry_backend.h"
#include "region_metadata.h"
#include "status_mapping.h"

namespace ferry::nixl_plugin {

namespace {

std::string describe(const nixlBasicDesc& desc) {
  return fmt::format("[0x{:x}, +{}) device {}", desc.addr, desc.len, desc.devId);
}

std::string mem_type_name(nixl_mem_t mem) {
  switch (mem) {
    case DRAM_SEG:
      return "DRAM";
    case VRAM_SEG:
      return "VRAM";
    case BLK_SEG:
      return "BLOCK";
    case OBJ_SEG:
      return "OBJ";
    case FILE_SEG:
      return "FILE";
  }
  return "memory type " + std::to_string(static_cast<int>(mem));
}

bool kind_matches(nixl_mem_t mem, MemoryKind kind) {
  return (mem == DRAM_SEG && kind == MemoryKind::kHost) ||
         (mem == VRAM_SEG && kind == MemoryKind::kCuda);
}

}  // namespace

nixl_status_t FerryBackendEngine::registerMem(const nixlBlobDesc& mem, const nixl_mem_t& nixl_mem,
                                              nixlBackendMD*& out) {
  if (nixl_mem != DRAM_SEG && nixl_mem != VRAM_SEG) {
    log_error("registerMem " + describe(mem) + ": " + mem_type_name(nixl_mem) +
              " is not memory FERRY moves (DRAM and VRAM)");
    return NIXL_ERR_NOT_SUPPORTED;
  }
  try {
    auto region = engine_->register_memory(reinterpret_cast<void*>(mem.addr), mem.len);
    if (!region.ok()) {
      log_error("registerMem " + mem_type_name(nixl_mem) + " " + describe(mem) + ": " +
                region.status().to_string());
      return to_nixl_status(region.status());
    }
    // NIXL's type and Ferry's detection must agree: a host buffer declared VRAM
    // would be read by the peer as GPU memory.
    if (!kind_matches(nixl_mem, region->kind)) {
      log_error(fmt::format("registerMem {}: declared {} but the memory is {} (region {})",
                            describe(mem), mem_type_name(nixl_mem), memory_kind_name(region->kind),
                            region->id));
      (void)engine_->deregister_memory(region->id);
      return NIXL_ERR_INVALID_PARAM;
    }
    auto advertised = engine_->advertise(region->id);
    if (!advertised.ok()) {
      log_error(fmt::format("registerMem {}: cannot advertise region {}: {}", describe(mem),
                            region->id, advertised.status().to_string()));
      (void)engine_->deregister_memory(region->id);
      return to_nixl_status(advertised.status());
    }
    out = new LocalRegionMetadata(region.value(), advertised->to_bytes());
    return NIXL_SUCCESS;
  } catch (const std::exception& e) {
    log_error("registerMem " + describe(mem) + ": " + e.what());
    return NIXL_ERR_BACKEND;
  }
}

nixl_status_t FerryBackendEngine::deregisterMem(nixlBackendMD* meta) {
  auto* local = dynamic_cast<LocalRegionMetadata*>(meta);
  if (local == nullptr) {
    log_error("deregisterMem: the metadata is not a FERRY local registration");
    return NIXL_ERR_INVALID_PARAM;
  }
  const Status status = engine_->deregister_memory(local->region.id);
  if (!status.ok()) {
    log_error(fmt::format("deregisterMem region {} [{}, +{}): {}", local->region.id,
                          local->region.address, local->region.length, status.to_string()));
    return to_nixl_status(status);
  }
  delete local;
  return NIXL_SUCCESS;
}

nixl_status_t FerryBackendEngine::getPublicData(const nixlBackendMD* meta, std::string& str) const {
  const auto* local = dynamic_cast<const LocalRegionMetadata*>(meta);
  if (local == nullptr) {
    log_error("getPublicData: the metadata is not a FERRY local registration");
    return NIXL_ERR_INVALID_PARAM;
  }
  str.assign(local->advertised.begin(), local->advertised.end());
  return NIXL_SUCCESS;
}

nixl_status_t FerryBackendEngine::loadRemoteMD(const nixlBlobDesc& input,
                                               const nixl_mem_t& nixl_mem,
                                               const std::string& remote_agent,
                                               nixlBackendMD*& output) {
  const std::string what = "loadRemoteMD of agent '" + remote_agent + "' " +
                           mem_type_name(nixl_mem) + " " + describe(input);
  const ByteView bytes(reinterpret_cast<const uint8_t*>(input.metaInfo.data()),
                       input.metaInfo.size());
  auto descriptor = RemoteDescriptor::from_bytes(bytes);
  if (!descriptor.ok()) {
    log_error(what + ": its public data (" + std::to_string(input.metaInfo.size()) +
              " bytes) is not a Ferry descriptor: " + descriptor.status().to_string());
    return NIXL_ERR_INVALID_PARAM;
  }
  const RemoteDescriptor& d = descriptor.value();
  if (input.addr < d.address || input.len > d.length ||
      input.addr - d.address > d.length - input.len) {
    log_error(fmt::format("{}: the Ferry descriptor covers [0x{:x}, +{}) only", what, d.address,
                          d.length));
    return NIXL_ERR_MISMATCH;
  }
  const auto peer = peer_of(remote_agent);
  if (peer && *peer != d.engine_id) {
    log_error(
        fmt::format("{}: the descriptor belongs to Ferry engine {:016x}, but agent '{}' "
                    "runs on engine {:016x}",
                    what, d.engine_id, remote_agent, *peer));
    return NIXL_ERR_MISMATCH;
  }
  if (!kind_matches(nixl_mem, d.kind)) {
    log_error(what + ": the descriptor is of " + std::string(memory_kind_name(d.kind)) + " memory");
    return NIXL_ERR_MISMATCH;
  }
  output = new RemoteRegionMetadata(remote_agent, d);
  return NIXL_SUCCESS;
}

nixl_status_t FerryBackendEngine::loadLocalMD(nixlBackendMD*, nixlBackendMD*& output) {
  output = nullptr;
  log_error("loadLocalMD: FERRY does no transfers within one agent (supportsLocal is false)");
  return NIXL_ERR_NOT_SUPPORTED;
}

nixl_status_t FerryBackendEngine::unloadMD(nixlBackendMD* input) {
  if (dynamic_cast<RemoteRegionMetadata*>(input) == nullptr) {
    log_error("unloadMD: the metadata is not a FERRY remote region");
    return NIXL_ERR_INVALID_PARAM;
  }
  delete input;
  return NIXL_SUCCESS;
}

}  // namespace ferry::nixl_plugin
