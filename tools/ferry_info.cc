// ferry-info: what this build of Ferry is and how it is configured.
//
//   ferry-info            version, protocol version, build features, and the
//                         transports an engine runs here (or why one cannot)
//   ferry-info --config   every option (name, type, value, source, doc), as
//                         resolved for an engine created with default config
//                         plus the FERRY_<COMPONENT>_<NAME> environment
//   ferry-info --json     the same as one JSON object
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "ferry/engine.h"
#include "tool_util.h"

#ifndef FERRY_TOOLS_CUDA_BUILT
#define FERRY_TOOLS_CUDA_BUILT 0
#endif
#ifndef FERRY_TOOLS_BUILD_TYPE
#define FERRY_TOOLS_BUILD_TYPE "unknown"
#endif
#ifndef FERRY_TOOLS_COMPILER
#define FERRY_TOOLS_COMPILER "unknown"
#endif
#ifndef FERRY_TOOLS_SANITIZE
#define FERRY_TOOLS_SANITIZE 0
#endif

int main(int argc, char** argv) {
  CLI::App app{"ferry-info: Ferry version, build features and configuration"};
  bool show_config = false;
  bool json = false;
  std::string listen = "127.0.0.1:0";
  std::vector<std::string> opts;
  app.add_flag("--config", show_config,
               "print every engine option (name, type, value, source, doc)");
  app.add_flag("--json", json, "print as one JSON object");
  app.add_option("--listen", listen, "listen address of the engine created for --config")
      ->capture_default_str();
  app.add_option("-o,--option", opts,
                 "component option NAME=VALUE (repeatable), as an "
                 "application would pass in EngineConfig::options");
  CLI11_PARSE(app, argc, argv);

  nlohmann::json j;
  j["version"] = std::string(ferry::version());
  j["protocol_version"] = ferry::protocol_version();
  j["features"] = {
    {"cuda", FERRY_TOOLS_CUDA_BUILT ? "built" : "not built"},
#if FERRY_TOOLS_CUDA_BUILT && defined(FERRY_TOOLS_CUDA_VERSION)
    {"cuda_toolkit", FERRY_TOOLS_CUDA_VERSION},
#endif
    {"build_type", FERRY_TOOLS_BUILD_TYPE},
    {"compiler", FERRY_TOOLS_COMPILER},
    {"sanitizers", FERRY_TOOLS_SANITIZE ? "address,undefined" : "off"},
  };

  {
    ferry::EngineConfig cfg;
    cfg.listen = listen;
    for (const auto& kv : opts) {
      auto eq = kv.find('=');
      if (eq == std::string::npos) {
        std::fprintf(stderr, "ferry-info: --option wants NAME=VALUE, got '%s'\n", kv.c_str());
        return 2;
      }
      cfg.options[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    auto engine = ferry::Engine::create(cfg);
    if (!engine.ok()) {
      std::fprintf(stderr, "ferry-info: cannot create an engine: %s\n",
                   engine.status().to_string().c_str());
      return 1;
    }
    nlohmann::json transports = nlohmann::json::array();
    for (const auto& t : (*engine)->transports()) {
      nlohmann::json counters = nlohmann::json::object();
      for (const auto& [name, value] : t.counters) counters[name] = value;
      transports.push_back({{"name", t.name},
                            {"running", t.running},
                            {"same_host_only", t.same_host_only},
                            {"detail", t.detail},
                            {"counters", counters}});
    }
    j["transports"] = transports;
    if (show_config) {
      nlohmann::json arr = nlohmann::json::array();
      for (const auto& o : (*engine)->options()) {
        arr.push_back({{"name", o.name},
                       {"type", o.type},
                       {"value", o.value},
                       {"source", o.source},
                       {"doc", o.doc}});
      }
      j["options"] = arr;
      j["listen_address"] = (*engine)->listen_address();
    }
  }

  if (json) {
    std::cout << j.dump(2) << "\n";
    return 0;
  }

  std::printf("ferry %s\n", std::string(ferry::version()).c_str());
  std::printf("protocol version: %u\n", static_cast<unsigned>(ferry::protocol_version()));
  std::printf("build:\n");
  for (auto it = j["features"].begin(); it != j["features"].end(); ++it) {
    std::printf("  %-14s %s\n", it.key().c_str(), it.value().get<std::string>().c_str());
  }
  std::printf("transports (preference order; -o engine.transports=... forces or disables):\n");
  for (const auto& t : j["transports"]) {
    std::printf("  %-6s %-11s %s%s\n", t["name"].get<std::string>().c_str(),
                t["running"].get<bool>() ? "running" : "unavailable",
                t["same_host_only"].get<bool>() ? "same host only, " : "",
                t["detail"].get<std::string>().c_str());
  }
  if (!show_config) {
    std::printf("(ferry-info --config lists every option)\n");
    return 0;
  }
  size_t wn = 4, wt = 4, wv = 5, ws = 6;
  for (const auto& o : j["options"]) {
    wn = std::max(wn, o["name"].get<std::string>().size());
    wt = std::max(wt, o["type"].get<std::string>().size());
    wv = std::max(wv, o["value"].get<std::string>().size());
    ws = std::max(ws, o["source"].get<std::string>().size());
  }
  std::printf("options (engine listening on %s):\n",
              j["listen_address"].get<std::string>().c_str());
  std::printf("  %-*s  %-*s  %-*s  %-*s  %s\n", static_cast<int>(wn), "name", static_cast<int>(wt),
              "type", static_cast<int>(wv), "value", static_cast<int>(ws), "source", "doc");
  for (const auto& o : j["options"]) {
    std::printf("  %-*s  %-*s  %-*s  %-*s  %s\n", static_cast<int>(wn),
                o["name"].get<std::string>().c_str(), static_cast<int>(wt),
                o["type"].get<std::string>().c_str(), static_cast<int>(wv),
                o["value"].get<std::string>().c_str(), static_cast<int>(ws),
                o["source"].get<std::string>().c_str(), o["doc"].get<std::string>().c_str());
  }
  return 0;
}
