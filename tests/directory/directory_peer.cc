// The target process of the directory tests: an engine with one buffer that
// publishes itself by name and the buffer's descriptor under key "buf", then
// answers commands on stdin, one reply line each:
//   verify <seed> <offset> <length>   OK | BAD <first bad index>  (its own memory)
//   health                            OK | ERR <message>
//   lookup <name>                     OK <metadata bytes> | ERR <code> <message>
//   exit                              BYE (the directory revokes its lease)
// Usage: ferry_directory_peer <url> <name> <size> <lease ttl s>
// First line: READY <pid>, or FAIL <message>.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <string>

#include "ferry/directory.h"
#include "test_util.h"

using namespace ferry;

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: ferry_directory_peer <url> <name> <size> <lease ttl s>\n";
    return 2;
  }
  const std::string url = argv[1], name = argv[2];
  const uint64_t size = std::stoull(argv[3]);
  DirectoryOptions options;
  options.lease_ttl = std::chrono::seconds(std::stoi(argv[4]));
  options.connect_timeout = std::chrono::milliseconds(300);
  options.request_timeout = std::chrono::milliseconds(1500);

  auto fail = [](const std::string& what, const Status& s) {
    std::cout << "FAIL " << what << ": " << s.to_string() << std::endl;
    return 1;
  };
  auto engine = Engine::create();
  if (!engine.ok()) return fail("engine", engine.status());
  itest::Buffer buf(size);
  auto region = engine.value()->register_memory(buf.data(), size);
  if (!region.ok()) return fail("register", region.status());
  auto desc = engine.value()->advertise(region->id);
  if (!desc.ok()) return fail("advertise", desc.status());

  auto dir = Directory::open(url, options);
  if (!dir.ok()) return fail("open", dir.status());
  if (Status s = dir.value()->publish_engine(name, engine.value()->metadata()); !s.ok()) {
    return fail("publish_engine", s);
  }
  if (Status s = publish_descriptor(*dir.value(), name, "buf", desc.value()); !s.ok()) {
    return fail("publish", s);
  }
  std::cout << "READY " << getpid() << std::endl;

  for (std::string line; std::getline(std::cin, line);) {
    const auto f = itest::Split(line);
    if (f.empty()) continue;
    if (f[0] == "verify" && f.size() == 4) {
      const uint64_t seed = std::stoull(f[1]), offset = std::stoull(f[2]),
                     length = std::stoull(f[3]);
      size_t bad = 0;
      if (offset + length > size) {
        std::cout << "BAD range" << std::endl;
      } else if (itest::MatchesPattern(seed, offset, buf.data() + offset, length, &bad)) {
        std::cout << "OK" << std::endl;
      } else {
        std::cout << "BAD " << bad << std::endl;
      }
    } else if (f[0] == "health") {
      Status s = dir.value()->health();
      std::cout << (s.ok() ? std::string("OK") : "ERR " + s.to_string()) << std::endl;
    } else if (f[0] == "lookup" && f.size() == 2) {
      auto meta = dir.value()->lookup_engine(f[1]);
      if (meta.ok()) {
        std::cout << "OK " << meta->size() << std::endl;
      } else {
        std::cout << "ERR " << meta.status().to_string() << std::endl;
      }
    } else if (f[0] == "exit") {
      dir.value().reset();
      std::cout << "BYE" << std::endl;
      return 0;
    } else {
      std::cout << "ERR unknown command: " << line << std::endl;
    }
  }
  return 0;
}
