#include "test_util.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

extern char** environ;

namespace ferry::itest {

// --------------------------------------------------------------------- data

namespace {

inline uint64_t Mix(uint64_t seed, uint64_t word) {
  uint64_t z = seed ^ (word * 0x9E3779B97F4A7C15ull) ^ 0xD1B54A32D192ED03ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline uint8_t PatternByte(uint64_t seed, uint64_t pos) {
  return static_cast<uint8_t>(Mix(seed, pos >> 3) >> (8 * (pos & 7)));
}

inline uint64_t Rotl(uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}

}  // namespace

void FillPattern(uint64_t seed, uint64_t pos, uint8_t* dst, size_t len) {
  size_t i = 0;
  while (i < len && ((pos + i) & 7) != 0) {
    dst[i] = PatternByte(seed, pos + i);
    ++i;
  }
  for (; i + 8 <= len; i += 8) {
    const uint64_t w = Mix(seed, (pos + i) >> 3);
    std::memcpy(dst + i, &w, 8);  // little endian: byte k of w is position +k
  }
  for (; i < len; ++i) dst[i] = PatternByte(seed, pos + i);
}

// The two checks of a region's bytes below read memory that a peer's writes
// reached through the engine's threads; what orders those writes before the
// check is the peer process (it saw them complete, then asked for the
// check), which ThreadSanitizer cannot see. They are left uninstrumented:
// with thousands of suppressed reports per check, a check under TSan took
// minutes. Every byte is still compared.
#if defined(__SANITIZE_THREAD__)
#define FERRY_REGION_CHECK [[gnu::no_sanitize("thread"), gnu::noinline]]
#else
#define FERRY_REGION_CHECK
#endif

namespace {
// memcmp, but a loop: the sanitizer intercepts memcmp whatever the caller.
FERRY_REGION_CHECK bool SameBytes(const uint8_t* a, const uint8_t* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}
}  // namespace

FERRY_REGION_CHECK bool MatchesPattern(uint64_t seed, uint64_t pos, const uint8_t* src, size_t len,
                                       size_t* first_bad) {
  uint8_t chunk[4096];
  for (size_t done = 0; done < len;) {
    const size_t n = std::min(sizeof chunk, len - done);
    FillPattern(seed, pos + done, chunk, n);
    if (!SameBytes(chunk, src + done, n)) {
      if (first_bad) {
        for (size_t k = 0; k < n; ++k) {
          if (chunk[k] != src[done + k]) {
            *first_bad = done + k;
            break;
          }
        }
      }
      return false;
    }
    done += n;
  }
  return true;
}

FERRY_REGION_CHECK uint64_t HashBytes(const uint8_t* p, size_t len) {
  constexpr uint64_t k1 = 0x87C37B91114253D5ull, k2 = 0x4CF5AD432745937Full;
  uint64_t h[4] = {0x243F6A8885A308D3ull ^ len, 0x13198A2E03707344ull, 0xA4093822299F31D0ull,
                   0x082EFA98EC4E6C89ull};
  size_t i = 0;
  for (; i + 32 <= len; i += 32) {
    for (int l = 0; l < 4; ++l) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * l, 8);
      h[l] = Rotl(h[l] ^ (w * k1), 31) * k2;
    }
  }
  uint64_t tail = 0x9E3779B97F4A7C15ull;
  for (; i < len; ++i) tail = (tail ^ p[i]) * 0x100000001B3ull;
  uint64_t out = h[0];
  for (int l = 1; l < 4; ++l) out = Rotl(out, 17) ^ (h[l] * k1);
  out ^= tail * k2;
  out ^= out >> 33;
  out *= 0xFF51AFD7ED558CCDull;
  out ^= out >> 33;
  return out;
}

uint64_t PatternHash(uint64_t seed, uint64_t pos, size_t len) {
  Buffer tmp(len == 0 ? 1 : len);
  FillPattern(seed, pos, tmp.data(), len);
  return HashBytes(tmp.data(), len);
}

std::string ToHex(const uint8_t* p, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = digits[p[i] >> 4];
    s[2 * i + 1] = digits[p[i] & 15];
  }
  return s;
}

std::optional<Bytes> FromHex(std::string_view hex) {
  if (hex.size() % 2) return std::nullopt;
  auto val = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  Bytes out(hex.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = val(hex[2 * i]), lo = val(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return out;
}

std::string Hex64(uint64_t v) {
  char b[17];
  snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

std::vector<std::string> Split(std::string_view line) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && line[i] == ' ') ++i;
    size_t j = i;
    while (j < line.size() && line[j] != ' ') ++j;
    if (j > i) out.emplace_back(line.substr(i, j - i));
    i = j;
  }
  return out;
}

Buffer::Buffer(size_t size) : size_(size) {
  void* m = mmap(nullptr, size == 0 ? 1 : size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                 -1, 0);
  if (m == MAP_FAILED) {
    fprintf(stderr, "mmap of %zu bytes failed: %s\n", size, strerror(errno));
    abort();
  }
  p_ = static_cast<uint8_t*>(m);
}

Buffer::~Buffer() {
  munmap(p_, size_ == 0 ? 1 : size_);
}

// ------------------------------------------------------------ ChildProcess

std::unique_ptr<ChildProcess> ChildProcess::Spawn(const std::vector<std::string>& argv,
                                                  std::string* error, bool capture_stderr) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    *error = std::string("socketpair: ") + strerror(errno);
    return nullptr;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, sv[1], 0);
  posix_spawn_file_actions_adddup2(&fa, sv[1], 1);
  if (capture_stderr) posix_spawn_file_actions_adddup2(&fa, sv[1], 2);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(sv[1]);
  if (rc != 0) {
    ::close(sv[0]);
    *error = "posix_spawnp " + argv[0] + ": " + strerror(rc);
    return nullptr;
  }
  auto c = std::unique_ptr<ChildProcess>(new ChildProcess());
  c->pid_ = pid;
  c->fd_ = sv[0];
  return c;
}

ChildProcess::~ChildProcess() {
  if (!reaped_ && pid_ > 0) {
    ::kill(pid_, SIGKILL);
    int st;
    waitpid(pid_, &st, 0);
  }
  if (fd_ >= 0) ::close(fd_);
}

bool ChildProcess::SendLine(const std::string& line) {
  std::string s = line + "\n";
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::send(fd_, s.data() + off, s.size() - off, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    off += static_cast<size_t>(n);
  }
  return true;
}

std::optional<std::string> ChildProcess::ReadLine(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const size_t nl = buffered_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffered_.substr(0, nl);
      buffered_.erase(0, nl + 1);
      return line;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return std::nullopt;
    pollfd p{fd_, POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return std::nullopt;
    char buf[65536];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return std::nullopt;
    buffered_.append(buf, static_cast<size_t>(n));
  }
}

void ChildProcess::Kill(int sig) {
  if (!reaped_ && pid_ > 0) ::kill(pid_, sig);
}

std::optional<int> ChildProcess::Wait(std::chrono::milliseconds timeout) {
  if (reaped_) return 0;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int st = 0;
    const pid_t r = waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      reaped_ = true;
      return st;
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

void ChildProcess::CloseStdin() {
  ::shutdown(fd_, SHUT_WR);
}

// ---------------------------------------------------------------- TestPeer

std::string TestPeerPath() {
  if (const char* p = std::getenv("FERRY_TEST_PEER")) return p;
  return FERRY_TEST_PEER_PATH;
}

namespace {
bool ParseDescriptor(const std::string& hex, RemoteDescriptor* out) {
  auto b = FromHex(hex);
  if (!b) return false;
  auto d = RemoteDescriptor::from_bytes(*b);
  if (!d.ok()) return false;
  *out = *d;
  return true;
}
}  // namespace

std::unique_ptr<TestPeer> TestPeer::Start(const PeerOptions& options, std::string* error) {
  std::vector<std::string> argv = options.wrapper;
  argv.push_back(TestPeerPath());
  argv.insert(argv.end(), {"--size", std::to_string(options.size), "--seed",
                           std::to_string(options.seed), "--listen", options.listen});
  for (const auto& o : options.engine_options) argv.insert(argv.end(), {"--opt", o});
  auto child = ChildProcess::Spawn(argv, error);
  if (!child) return nullptr;
  auto line = child->ReadLine(std::chrono::seconds(60));
  if (!line) {
    *error = "ferry_test_peer printed no READY line (see its stderr above)";
    return nullptr;
  }
  auto f = Split(*line);
  // READY engine_id region listen meta rw ro wo sub
  if (f.size() != 9 || f[0] != "READY") {
    *error = "unexpected first line from ferry_test_peer: " + *line;
    return nullptr;
  }
  auto p = std::unique_ptr<TestPeer>(new TestPeer());
  p->options_ = options;
  p->engine_id = std::stoull(f[1], nullptr, 16);
  p->region = std::stoull(f[2]);
  p->listen = f[3];
  auto meta = FromHex(f[4]);
  if (!meta || !ParseDescriptor(f[5], &p->rw) || !ParseDescriptor(f[6], &p->ro) ||
      !ParseDescriptor(f[7], &p->wo) || !ParseDescriptor(f[8], &p->sub)) {
    *error = "malformed READY line: " + *line;
    return nullptr;
  }
  p->metadata = *meta;
  p->child_ = std::move(child);
  return p;
}

std::string TestPeer::Command(const std::string& line, std::chrono::milliseconds timeout) {
  if (!child_->SendLine(line)) return "";
  return child_->ReadLine(timeout).value_or("");
}

std::optional<uint64_t> TestPeer::Checksum(uint64_t offset, uint64_t length) {
  const std::string reply =
      Command("checksum " + std::to_string(offset) + " " + std::to_string(length));
  auto f = Split(reply);
  if (f.size() != 2 || f[0] != "OK") {
    fprintf(stderr, "ferry_test_peer answered checksum with '%s'\n", reply.c_str());
    return std::nullopt;
  }
  return std::stoull(f[1], nullptr, 16);
}

std::optional<std::vector<uint64_t>> TestPeer::Checksums(
    const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
  std::string cmd = "checksums";
  for (const auto& [o, l] : ranges) cmd += " " + std::to_string(o) + " " + std::to_string(l);
  auto f = Split(Command(cmd));
  if (f.size() != ranges.size() + 1 || f[0] != "OK") return std::nullopt;
  std::vector<uint64_t> out;
  for (size_t i = 1; i < f.size(); ++i) out.push_back(std::stoull(f[i], nullptr, 16));
  return out;
}

std::optional<Bytes> TestPeer::Dump(uint64_t offset, uint64_t length) {
  auto f = Split(Command("dump " + std::to_string(offset) + " " + std::to_string(length)));
  if (f.size() != 2 || f[0] != "OK") return std::nullopt;
  return FromHex(f[1]);
}

bool TestPeer::Alive() {
  return Command("ping", std::chrono::seconds(30)) == "OK";
}

}  // namespace ferry::itest
