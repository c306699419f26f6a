// Shared by the integration tests and ferry_test_peer: deterministic data
// patterns, a fast position-sensitive hash, hex, and a child process driven
// line by line over its stdin/stdout.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/engine.h"

namespace ferry::itest {

// --- data ------------------------------------------------------------------

// Byte `pos` of the infinite pattern for `seed` (any position, any order).
// Fills dst[0, len) with pattern bytes pos, pos+1, ...
void FillPattern(uint64_t seed, uint64_t pos, uint8_t* dst, size_t len);
// True if src[0, len) equals the pattern from `pos`; on mismatch *first_bad
// (if given) is the index of the first differing byte.
bool MatchesPattern(uint64_t seed, uint64_t pos, const uint8_t* src, size_t len,
                    size_t* first_bad = nullptr);
// 64-bit hash of a byte range; any change of any byte (or of the length)
// changes it with overwhelming probability.
uint64_t HashBytes(const uint8_t* p, size_t len);
uint64_t PatternHash(uint64_t seed, uint64_t pos, size_t len);

std::string ToHex(const uint8_t* p, size_t n);
inline std::string ToHex(const Bytes& b) { return ToHex(b.data(), b.size()); }
std::optional<Bytes> FromHex(std::string_view hex);
std::string Hex64(uint64_t v);  // 16 lower-case digits

std::vector<std::string> Split(std::string_view line);

// Page-aligned, zero-filled anonymous memory (freed on destruction).
class Buffer {
 public:
  explicit Buffer(size_t size);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  uint8_t* data() const { return p_; }
  size_t size() const { return size_; }

 private:
  uint8_t* p_ = nullptr;
  size_t size_ = 0;
};

// --- child processes -------------------------------------------------------

// A child with stdin/stdout connected to us through a socketpair (so writing
// to a dead child gives EPIPE, never SIGPIPE) and stderr inherited.
class ChildProcess {
 public:
  // argv[0] is looked up in PATH if it has no '/'.
  // With capture_stderr its stderr comes to us too (mixed with stdout).
  static std::unique_ptr<ChildProcess> Spawn(const std::vector<std::string>& argv,
                                             std::string* error, bool capture_stderr = false);
  ~ChildProcess();  // SIGKILL + reap if still running

  pid_t pid() const { return pid_; }
  bool SendLine(const std::string& line);
  // One line without the newline; nullopt on EOF or timeout.
  std::optional<std::string> ReadLine(std::chrono::milliseconds timeout);
  void Kill(int sig);
  // Exit status as from waitpid, or nullopt if it did not exit in time.
  std::optional<int> Wait(std::chrono::milliseconds timeout);
  void CloseStdin();

 private:
  pid_t pid_ = -1;
  int fd_ = -1;  // our end of the socketpair
  std::string buffered_;
  bool reaped_ = false;
};

// Path of the ferry_test_peer binary: $FERRY_TEST_PEER, else the one built
// next to the tests (compiled in by CMake).
std::string TestPeerPath();

struct PeerOptions {
  uint64_t size = 1 << 20;
  uint64_t seed = 1;
  std::string listen = "127.0.0.1:0";
  std::vector<std::string> engine_options;  // "tcp.streams=4"
  std::vector<std::string> wrapper;         // e.g. {"ip", "netns", "exec", "ns"}
};

// A running ferry_test_peer: its READY line decoded, and its command loop.
class TestPeer {
 public:
  static std::unique_ptr<TestPeer> Start(const PeerOptions& options, std::string* error);

  // Sends one command and returns its one-line reply ("" on EOF/timeout).
  std::string Command(const std::string& line,
                      std::chrono::milliseconds timeout = std::chrono::seconds(120));
  // "OK <hash>" → hash of the peer's memory [offset, offset+length).
  std::optional<uint64_t> Checksum(uint64_t offset, uint64_t length);
  // Several ranges in one round trip.
  std::optional<std::vector<uint64_t>> Checksums(
      const std::vector<std::pair<uint64_t, uint64_t>>& ranges);
  std::optional<Bytes> Dump(uint64_t offset, uint64_t length);
  bool Alive();  // answers "ping"

  ChildProcess& process() { return *child_; }
  const PeerOptions& options() const { return options_; }

  Bytes metadata;
  RemoteDescriptor rw;   // whole buffer, read-write
  RemoteDescriptor ro;   // whole buffer, read-only
  RemoteDescriptor wo;   // whole buffer, write-only
  RemoteDescriptor sub;  // [size/4, size/2), read-write
  std::string listen;    // "ip:port"
  uint64_t engine_id = 0;
  RegionId region = 0;

 private:
  std::unique_ptr<ChildProcess> child_;
  PeerOptions options_;
};

}  // namespace ferry::itest
