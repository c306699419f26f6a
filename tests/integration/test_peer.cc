// ferry_test_peer: a Ferry engine in its own process, driven over stdin/stdout
// by the integration tests. It uses only the public API.
//
// Start-up: creates an engine, registers a buffer of --size bytes filled with
// the pattern of --seed (test_util.h), advertises it and prints one line
//   READY <engine_id hex> <region id> <listen ip:port> <metadata hex>
//         <rw desc hex> <ro desc hex> <wo desc hex> <sub desc hex>
// where rw/ro/wo cover the whole buffer (read-write, read-only, write-only)
// and sub is [size/4, size/2) read-write.
//
// Then one command per line on stdin, one reply line each ("OK ..." or
// "ERR <StatusCode> <message>"):
//   ping                           OK
//   checksum OFF LEN               OK <hash hex> of its memory
//   checksums OFF LEN [OFF LEN]... OK <hash> <hash> ...
//   dump OFF LEN                   OK <hex>
//   fill SEED OFF LEN              OK (memory = pattern SEED at those positions)
//   dereg                          OK (deregisters the buffer; memory stays)
//   notifications COUNT MS         OK <n> <peer hex>:<payload hex> ... (waits up
//                                  to MS for COUNT, takes all received so far)
//   watch COUNT MS                 prints WATCHING, then handles COUNT
//                                  notifications "OFF LEN HASH" (hex hash) as
//                                  they arrive, checking at once that its memory
//                                  [OFF, OFF+LEN) hashes to HASH; finally
//                                  OK received=N good=G bad=B [first bad: ...]
//   connect METAHEX                OK <peer hex>  (this peer as initiator)
//   carriers PEER                  OK <transport carrying host memory to PEER>
//                                  then per transport NAME=up|down:<reason>
//   connect_hp HOST:PORT           OK <peer hex>
//   write PEER DESC OFF LEN SEED   fills its own buffer [OFF, +LEN) with pattern
//                                  SEED and writes it to DESC at offset OFF; OK
//   read PEER DESC OFF LEN         reads DESC [OFF, +LEN) into its own buffer at
//                                  OFF; OK <hash of what arrived>
//   notify PEER HEX                OK
//   post PEER DESC OFF LEN N SEED  fills [OFF, +LEN*N) with pattern SEED and
//                                  posts N asynchronous writes of LEN bytes
//                                  back to back; OK <N> at once
//   pending                        OK <how many posted writes still run>
//   wait_posted MS                 waits for the posted writes; OK <ended ok>
//                                  <failed> <ms waited> <first error or ->
//   exit                           BYE, exit 0
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

#include "ferry/engine.h"
#include "test_util.h"

using namespace ferry;
using namespace ferry::itest;

namespace {

// The command channel. Set up in main() on a private copy of stdout, and
// stdout itself is pointed at stderr: whatever the library prints (log lines
// on stdout) cannot interleave with replies.
FILE* g_out = nullptr;

void Reply(const std::string& line) {
  std::fputs(line.c_str(), g_out);
  std::fputc('\n', g_out);
  std::fflush(g_out);
}

std::string ErrLine(const Status& s) {
  std::string m = s.message();
  for (auto& c : m) {
    if (c == '\n') c = ' ';
  }
  return "ERR " + std::string(status_code_name(s.code())) + " " + m;
}

[[noreturn]] void Die(const std::string& why) {
  std::fprintf(stderr, "ferry_test_peer: %s\n", why.c_str());
  Reply("FATAL " + why);
  std::exit(2);
}

uint64_t U64(const std::string& s, int base = 10) {
  return std::stoull(s, nullptr, base);
}

struct Peer {
  std::unique_ptr<Engine> engine;
  Buffer* buf = nullptr;
  RegionId region = 0;
  bool registered = false;
  std::vector<std::pair<TransferId, Status>> posted;  // "post": ids and how they ended

  bool InRange(uint64_t off, uint64_t len) const {
    return off <= buf->size() && len <= buf->size() - off;
  }

  std::string Handle(const std::vector<std::string>& f) {
    const std::string& cmd = f[0];
    if (cmd == "ping") return "OK";
    if (cmd == "checksum" && f.size() == 3) {
      const uint64_t off = U64(f[1]), len = U64(f[2]);
      if (!InRange(off, len)) return "ERR InvalidArgument range outside the buffer";
      return "OK " + Hex64(HashBytes(buf->data() + off, len));
    }
    if (cmd == "checksums" && f.size() % 2 == 1) {
      std::string out = "OK";
      for (size_t i = 1; i + 1 < f.size(); i += 2) {
        const uint64_t off = U64(f[i]), len = U64(f[i + 1]);
        if (!InRange(off, len)) return "ERR InvalidArgument range outside the buffer";
        out += " " + Hex64(HashBytes(buf->data() + off, len));
      }
      return out;
    }
    if (cmd == "dump" && f.size() == 3) {
      const uint64_t off = U64(f[1]), len = U64(f[2]);
      if (!InRange(off, len)) return "ERR InvalidArgument range outside the buffer";
      return "OK " + ToHex(buf->data() + off, len);
    }
    if (cmd == "fill" && f.size() == 4) {
      const uint64_t seed = U64(f[1]), off = U64(f[2]), len = U64(f[3]);
      if (!InRange(off, len)) return "ERR InvalidArgument range outside the buffer";
      FillPattern(seed, off, buf->data() + off, len);
      return "OK";
    }
    if (cmd == "dereg") {
      Status s = engine->deregister_memory(region);
      if (s.ok()) registered = false;
      return s.ok() ? "OK" : ErrLine(s);
    }
    if (cmd == "notifications" && f.size() == 3) {
      const uint64_t want = U64(f[1]);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(U64(f[2]));
      std::vector<Notification> got;
      for (;;) {
        for (auto& n : engine->take_notifications()) got.push_back(std::move(n));
        const auto now = std::chrono::steady_clock::now();
        if (got.size() >= want || now >= deadline) break;
        for (auto& n : engine->wait_notifications(
                 std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now))) {
          got.push_back(std::move(n));
        }
      }
      std::string out = "OK " + std::to_string(got.size());
      for (const auto& n : got) out += " " + Hex64(n.peer) + ":" + ToHex(n.payload);
      return out;
    }
    if (cmd == "dropped_notifications") {
      return "OK " + std::to_string(engine->dropped_notifications());
    }
    if (cmd == "watch" && f.size() == 3) return Watch(U64(f[1]), U64(f[2]));
    if (cmd == "connect" && f.size() == 2) {
      auto meta = FromHex(f[1]);
      if (!meta) return "ERR InvalidArgument bad hex";
      auto p = engine->connect(ByteView(*meta));
      return p.ok() ? "OK " + Hex64(*p) : ErrLine(p.status());
    }
    if (cmd == "connect_hp" && f.size() == 2) {
      auto p = engine->connect(std::string_view(f[1]));
      return p.ok() ? "OK " + Hex64(*p) : ErrLine(p.status());
    }
    if ((cmd == "write" && f.size() == 6) || (cmd == "read" && f.size() == 5)) {
      const PeerId peer = U64(f[1], 16);
      auto raw = FromHex(f[2]);
      if (!raw) return "ERR InvalidArgument bad hex";
      auto desc = RemoteDescriptor::from_bytes(*raw);
      if (!desc.ok()) return ErrLine(desc.status());
      const uint64_t off = U64(f[3]), len = U64(f[4]);
      if (!InRange(off, len)) return "ERR InvalidArgument range outside the local buffer";
      LocalIov l{buf->data() + off, len};
      RemoteIov r{&*desc, off, len};
      if (cmd == "write") {
        FillPattern(U64(f[5]), off, buf->data() + off, len);
        Status s = engine->write(peer, {&l, 1}, {&r, 1});
        return s.ok() ? "OK" : ErrLine(s);
      }
      Status s = engine->read(peer, {&l, 1}, {&r, 1});
      return s.ok() ? "OK " + Hex64(HashBytes(buf->data() + off, len)) : ErrLine(s);
    }
    // Asynchronous writes, for tests that act while they are in flight:
    // "post PEER DESC OFF LEN COUNT SEED" fills [OFF, OFF + LEN * COUNT) with
    // the pattern of SEED and posts COUNT writes of LEN bytes one after the
    // other, returning at once; "pending" says how many of them are still
    // running; "wait_posted MS" waits for all of them and says how they ended
    // ("OK <ok> <failed> <ms waited> <first error>").
    if (cmd == "post" && f.size() == 7) {
      const PeerId peer = U64(f[1], 16);
      auto raw = FromHex(f[2]);
      if (!raw) return "ERR InvalidArgument bad hex";
      auto desc = RemoteDescriptor::from_bytes(*raw);
      if (!desc.ok()) return ErrLine(desc.status());
      const uint64_t off = U64(f[3]), len = U64(f[4]), count = U64(f[5]);
      if (count == 0 || len > UINT64_MAX / count || !InRange(off, len * count)) {
        return "ERR InvalidArgument range outside the local buffer";
      }
      FillPattern(U64(f[6]), off, buf->data() + off, len * count);
      for (uint64_t i = 0; i < count; ++i) {
        LocalIov l{buf->data() + off + i * len, len};
        RemoteIov r{&*desc, off + i * len, len};
        auto id = engine->write_async(peer, {&l, 1}, {&r, 1});
        if (!id.ok()) return ErrLine(id.status());
        posted.push_back({*id, Status(StatusCode::kInProgress, "")});
      }
      return "OK " + std::to_string(count);
    }
    if (cmd == "pending") {
      uint64_t running = 0;
      for (auto& p : posted) {
        if (p.second.code() == StatusCode::kInProgress) p.second = engine->test(p.first);
        if (p.second.code() == StatusCode::kInProgress) ++running;
      }
      return "OK " + std::to_string(running);
    }
    if (cmd == "wait_posted" && f.size() == 2) {
      const auto start = std::chrono::steady_clock::now();
      const auto deadline = start + std::chrono::milliseconds(U64(f[1]));
      uint64_t ok = 0, failed = 0;
      std::string first_error = "-";
      for (auto& p : posted) {
        if (p.second.code() == StatusCode::kInProgress) {
          const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
              deadline - std::chrono::steady_clock::now());
          p.second = engine->wait(p.first, std::max(left, std::chrono::milliseconds(0)));
        }
        if (p.second.ok()) {
          ++ok;
        } else {
          ++failed;
          if (first_error == "-") first_error = ErrLine(p.second).substr(4);
        }
      }
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::steady_clock::now() - start)
                          .count();
      posted.clear();
      return "OK " + std::to_string(ok) + " " + std::to_string(failed) + " " + std::to_string(ms) +
             " " + first_error;
    }
    if (cmd == "carriers" && f.size() == 2) {
      // Which transport carries host memory to the peer, and why the others
      // do not: "OK shm tcp=<reason>" style, reasons with spaces turned to '_'.
      auto routes = engine->peer_transports(U64(f[1], 16));
      if (!routes.ok()) return ErrLine(routes.status());
      std::string host = "none", rest;
      for (const auto& t : *routes) {
        if (t.carries.find("host") != std::string::npos) host = t.transport;
        std::string why = t.reason;
        std::replace(why.begin(), why.end(), ' ', '_');
        rest += " " + t.transport + "=" + (t.connected ? "up" : "down") + ":" + why;
      }
      return "OK " + host + rest;
    }
    if (cmd == "notify" && f.size() == 3) {
      auto payload = FromHex(f[2]);
      if (!payload) return "ERR InvalidArgument bad hex";
      Status s = engine->notify(U64(f[1], 16), *payload);
      return s.ok() ? "OK" : ErrLine(s);
    }
    return "ERR InvalidArgument unknown command: " + cmd;
  }

  // Checks each write-with-notification the moment its notification is
  // visible: the data it names must already be complete.
  std::string Watch(uint64_t count, uint64_t ms) {
    Reply("WATCHING");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    uint64_t received = 0, good = 0, bad = 0;
    std::string first_bad;
    while (received < count) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) break;
      auto batch = engine->wait_notifications(
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now));
      for (const auto& n : batch) {
        ++received;
        const std::string text(n.payload.begin(), n.payload.end());
        auto parts = Split(text);
        bool ok = false;
        std::string why;
        if (parts.size() == 3) {
          const uint64_t off = U64(parts[0]), len = U64(parts[1]), want = U64(parts[2], 16);
          if (InRange(off, len)) {
            const uint64_t got = HashBytes(buf->data() + off, len);
            ok = got == want;
            if (!ok)
              why = "range [" + parts[0] + ", +" + parts[1] + ") hashes to " + Hex64(got) +
                    ", the notification says " + parts[2];
          } else {
            why = "range outside the buffer: " + text;
          }
        } else {
          why = "unparsable notification '" + text + "'";
        }
        if (ok) {
          ++good;
        } else {
          ++bad;
          if (first_bad.empty()) first_bad = why;
        }
      }
    }
    std::string out = "OK received=" + std::to_string(received) + " good=" + std::to_string(good) +
                      " bad=" + std::to_string(bad);
    if (!first_bad.empty()) out += " first bad: " + first_bad;
    return out;
  }
};

}  // namespace

int main(int argc, char** argv) {
  // Die with the test that started us, whatever happens to it.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  g_out = fdopen(dup(STDOUT_FILENO), "w");
  dup2(STDERR_FILENO, STDOUT_FILENO);
  uint64_t size = 1 << 20, seed = 1;
  EngineConfig config;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--size") {
      size = U64(v);
    } else if (k == "--seed") {
      seed = U64(v);
    } else if (k == "--listen") {
      config.listen = v;
    } else if (k == "--opt") {
      const auto eq = v.find('=');
      if (eq == std::string::npos) Die("--opt wants name=value, got " + v);
      config.options[v.substr(0, eq)] = v.substr(eq + 1);
    } else {
      Die("unknown argument " + k);
    }
  }
  if (size < 4) Die("--size must be at least 4");

  auto engine = Engine::create(config);
  if (!engine.ok()) Die("Engine::create: " + engine.status().to_string());
  Buffer buf(size);
  FillPattern(seed, 0, buf.data(), size);
  Peer peer;
  peer.engine = std::move(engine.value());
  peer.buf = &buf;
  auto region = peer.engine->register_memory(buf.data(), size);
  if (!region.ok()) Die("register_memory: " + region.status().to_string());
  peer.region = region->id;
  peer.registered = true;
  auto adv = [&](uint64_t off, uint64_t len, uint8_t access) {
    auto d = peer.engine->advertise(region->id, off, len, access);
    if (!d.ok()) Die("advertise: " + d.status().to_string());
    return ToHex(d->to_bytes());
  };
  const std::string rw = adv(0, UINT64_MAX, kAccessReadWrite);
  const std::string ro = adv(0, UINT64_MAX, kAccessRead);
  const std::string wo = adv(0, UINT64_MAX, kAccessWrite);
  const std::string sub = adv(size / 4, size / 4, kAccessReadWrite);
  Reply("READY " + Hex64(peer.engine->id()) + " " + std::to_string(region->id) + " " +
        peer.engine->listen_address() + " " + ToHex(peer.engine->metadata()) + " " + rw + " " + ro +
        " " + wo + " " + sub);

  std::string line;
  while (std::getline(std::cin, line)) {
    auto f = Split(line);
    if (f.empty()) continue;
    if (f[0] == "exit") {
      Reply("BYE");
      break;
    }
    std::string reply;
    try {
      reply = peer.Handle(f);
    } catch (const std::exception& e) {
      reply = std::string("ERR InvalidArgument ") + e.what();
    }
    Reply(reply);
  }
  if (peer.registered) (void)peer.engine->deregister_memory(peer.region);
  peer.engine.reset();
  return 0;
}
