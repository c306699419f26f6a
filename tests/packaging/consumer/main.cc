// A consumer of an installed Ferry: creates an engine, prints the library
// version and where libferry was loaded from.
#include <dlfcn.h>

#include <cstdio>
#include <string>

#include <ferry/engine.h>

int main() {
  auto engine = ferry::Engine::create({.listen = "127.0.0.1:0"});
  if (!engine.ok()) {
    std::fprintf(stderr, "Engine::create failed: %s\n", engine.status().to_string().c_str());
    return 1;
  }
  Dl_info info{};
  const char* lib = "?";
  if (dladdr(reinterpret_cast<void*>(&ferry::version), &info) != 0 && info.dli_fname != nullptr) {
    lib = info.dli_fname;
  }
  const std::string version(ferry::version());
  std::printf("ferry version %s protocol %u\n", version.c_str(),
              static_cast<unsigned>(ferry::protocol_version()));
  std::printf("libferry %s\n", lib);
  std::printf("engine listening on %s\n", (*engine)->listen_address().c_str());
  return 0;
}
