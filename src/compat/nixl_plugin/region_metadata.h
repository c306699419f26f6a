// What the FERRY backend keeps next to each descriptor NIXL's agent holds: a
// local registration (registerMem) or a peer's advertised region (loadRemoteMD).
#pragma once

#include <string>
#include <utility>

#include "backend/backend_aux.h"
#include "ferry/types.h"

namespace ferry::nixl_plugin {

// One Ferry registration of one NIXL descriptor, and the RemoteDescriptor
// peers get as its public data.
class LocalRegionMetadata : public nixlBackendMD {
 public:
  LocalRegionMetadata(const MemoryRegion& registered, Bytes descriptor_bytes)
      : nixlBackendMD(true), region(registered), advertised(std::move(descriptor_bytes)) {}
  MemoryRegion region;
  Bytes advertised;  // RemoteDescriptor::to_bytes() of the whole region
};

// A region agent `agent` registered, as its RemoteDescriptor.
class RemoteRegionMetadata : public nixlBackendMD {
 public:
  RemoteRegionMetadata(std::string owner, const RemoteDescriptor& advertised)
      : nixlBackendMD(false), agent(std::move(owner)), descriptor(advertised) {}
  std::string agent;
  RemoteDescriptor descriptor;
};

}  // namespace ferry::nixl_plugin
