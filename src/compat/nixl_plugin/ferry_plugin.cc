// The entry points NIXL's plugin manager looks up in libplugin_FERRY.so
// (dlopen, then dlsym "nixl_plugin_init"): the plugin table of API version 1.
#include <spdlog/spdlog.h>

#include <exception>

#include "backend/backend_plugin.h"
#include "ferry/engine.h"
#include "ferry_backend.h"

namespace {

using ferry::nixl_plugin::FerryBackendEngine;

nixlBackendEngine* create_engine(const nixlBackendInitParams* init_params) {
  try {
    return new FerryBackendEngine(init_params);
  } catch (const std::exception& e) {  // NIXL reports a null engine as a creation failure
    spdlog::error("nixl backend FERRY: cannot create the backend: {}", e.what());
    return nullptr;
  }
}

void destroy_engine(nixlBackendEngine* engine) {
  delete engine;
}

const char* plugin_name() {
  return "FERRY";
}

const char* plugin_version() {
  static const std::string version(ferry::version());
  return version.c_str();
}

nixl_b_params_t backend_options() {
  return ferry::nixl_plugin::backend_parameter_defaults();
}

nixl_mem_list_t backend_mems() {
  return {DRAM_SEG, VRAM_SEG};
}

nixlBackendPlugin plugin_table = {
    NIXL_PLUGIN_API_VERSION, create_engine,   destroy_engine, plugin_name,
    plugin_version,          backend_options, backend_mems};

}  // namespace

extern "C" NIXL_PLUGIN_EXPORT nixlBackendPlugin* nixl_plugin_init() {
  return &plugin_table;
}

extern "C" NIXL_PLUGIN_EXPORT void nixl_plugin_fini() {}
