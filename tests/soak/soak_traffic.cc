// A worker's traffic threads: writes into its slots at every peer (some with
// notifications), reads of those slots, of peers' static regions and of the
// regions they register and deregister under traffic; each transfer of random
// size and batch, some cancelled after a random moment, some given a timeout
// too short to finish. Every byte read is compared with what must be there.
#include <algorithm>
#include <cstring>
#include <optional>

#include "soak_worker.h"
#include "soak_worker_impl.h"

namespace ferry::soak {

using namespace std::chrono_literals;
using itest::FillPattern;
using itest::MatchesPattern;

namespace {

constexpr uint8_t kSentinel = 0xA5;
constexpr auto kStuckAfter = 60s;

enum class Mode { kPlain, kCancel, kTimeout };

struct Outcome {
  Status status;
  int64_t posted = 0, done = 0;
  bool chosen = false;  // the error is the one the mode asked for
};

// The thread's local buffer, registered; replaced now and then (registration
// and deregistration under traffic on the initiator's side).
class LocalMemory {
 public:
  LocalMemory(Worker& w, uint64_t size) : w_(w), size_(size) { Renew(); }
  ~LocalMemory() { Release(); }
  void Renew() {
    Release();
    std::string error;
    memory_ = SoakMemory::Create(w_.config(), w_.device(), size_, &error);
    if (!memory_) {
      w_.CountError("local memory", Status(StatusCode::kInternal, error), false);
      return;
    }
    auto r = w_.engine().register_memory(memory_->data(), size_);
    if (!r.ok()) {
      w_.CountError("register_memory (local)", r.status(), false);
      return;
    }
    region_ = r->id;
    w_.Count("registrations");
  }
  bool ok() const { return memory_ != nullptr && region_ != 0; }
  uint8_t* data() const { return memory_->data(); }
  uint8_t* host() const { return memory_->host(); }
  SoakMemory& memory() { return *memory_; }

 private:
  void Release() {
    if (region_ != 0) {
      // Every transfer on it has ended (completed, failed or cancelled).
      const Status s = w_.engine().deregister_memory(region_);
      if (!s.ok()) w_.CountError("deregister_memory (local)", s, false);
      w_.Count("deregistrations");
    }
    region_ = 0;
    memory_.reset();
  }
  Worker& w_;
  uint64_t size_;
  std::unique_ptr<SoakMemory> memory_;
  RegionId region_ = 0;
};

Outcome Execute(Engine& e, bool write, PeerId peer, const std::vector<LocalIov>& local,
                const std::vector<RemoteIov>& remote, std::optional<ByteView> notification,
                Mode mode, std::mt19937_64& rng) {
  Outcome o;
  o.posted = NowNs();
  if (mode == Mode::kTimeout) {
    const auto t = std::chrono::milliseconds(std::uniform_int_distribution<int>(1, 5)(rng));
    o.status =
        write ? e.write(peer, local, remote, notification, t) : e.read(peer, local, remote, t);
    o.chosen = o.status.code() == StatusCode::kTimeout;
    o.done = NowNs();
    return o;
  }
  auto id =
      write ? e.write_async(peer, local, remote, notification) : e.read_async(peer, local, remote);
  if (!id.ok()) {
    o.status = id.status();
    o.done = NowNs();
    return o;
  }
  if (mode == Mode::kCancel) {
    const int us = std::uniform_int_distribution<int>(-500, 3000)(rng);
    if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
    const Status c = e.cancel(*id);
    if (!c.ok()) {
      o.status = c;
      o.done = NowNs();
      return o;
    }
  }
  o.status = e.wait(*id, kStuckAfter);
  if (o.status.code() == StatusCode::kTimeout) {
    // Not finished after a minute: stuck. Cancel it so the buffer is ours again.
    (void)e.cancel(*id);
    (void)e.wait(*id, kStuckAfter);
    o.status = Status(StatusCode::kTimeout, "transfer not finished after 60 s");
  }
  o.chosen = mode == Mode::kCancel && o.status.code() == StatusCode::kCancelled;
  o.done = NowNs();
  return o;
}

Mode PickMode(const SoakConfig& c, std::mt19937_64& rng) {
  const double x = std::uniform_real_distribution<double>(0, 1)(rng);
  if (x < c.cancel_share) return Mode::kCancel;
  if (x < c.cancel_share + c.timeout_share) return Mode::kTimeout;
  return Mode::kPlain;
}

// The iovs of a transfer of `pieces` between `local` and [base, ...) of `desc`.
void BuildIovs(const std::vector<Piece>& pieces, uint8_t* local, const RemoteDescriptor* desc,
               uint64_t base, std::vector<LocalIov>* l, std::vector<RemoteIov>* r) {
  l->clear();
  r->clear();
  for (const Piece& p : pieces) {
    l->push_back({local + p.local, p.length});
    r->push_back({desc, base + p.remote, p.length});
  }
}

// First piece whose bytes differ from the pattern of `seed` at `base`.
std::optional<std::string> Mismatch(uint64_t seed, uint64_t base, const uint8_t* local,
                                    const std::vector<Piece>& pieces) {
  for (size_t i = 0; i < pieces.size(); ++i) {
    const Piece& p = pieces[i];
    size_t bad = 0;
    if (!MatchesPattern(seed, base + p.remote, local + p.local, p.length, &bad)) {
      uint8_t want = 0;
      FillPattern(seed, base + p.remote + bad, &want, 1);
      return "iov " + std::to_string(i) + " of " + std::to_string(pieces.size()) + ", byte " +
             std::to_string(base + p.remote + bad) + " of the range: got " +
             std::to_string(local[p.local + bad]) + ", expected " + std::to_string(want);
    }
  }
  return std::nullopt;
}

}  // namespace

void Worker::TrafficLoop(int thread) {
  std::mt19937_64 rng(Mix64(config_.seed ^ 0x545241464649ull,
                            (uint64_t(index_) << 40) | (uint64_t(incarnation_) << 8) | thread));
  LocalMemory mem(*this, config_.max_bytes);
  uint64_t sentinel_len = 0, ops = 0;
  std::vector<LocalIov> l;
  std::vector<RemoteIov> r;
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  while (!stopping_) {
    if (sentinel_len > 0 && Move(mem.memory(), false, 0, sentinel_len)) {
      // Guarantee 1 of cancel(): nothing lands in a cancelled read's buffer.
      const uint8_t* p = mem.host();
      for (uint64_t i = 0; i < sentinel_len; ++i) {
        if (p[i] != kSentinel) {
          DataError("byte " + std::to_string(i) +
                    " of a cancelled read's buffer changed after "
                    "cancel() returned (" +
                    std::to_string(p[i]) + ")");
          break;
        }
      }
    }
    sentinel_len = 0;
    if (++ops % 64 == 0 || !mem.ok()) mem.Renew();
    if (!mem.ok()) {
      std::this_thread::sleep_for(100ms);  // counted as an unexpected error already
      continue;
    }
    // A peer, connected.
    const int j = std::uniform_int_distribution<int>(0, config_.processes - 1)(rng);
    if (j == index_) continue;
    uint32_t inc = 0;
    PeerId pid = 0;
    std::vector<uint8_t> metadata;
    {
      std::lock_guard<std::mutex> lock(mu_);
      PeerState& p = peers_[j];
      if (p.known) {
        inc = p.incarnation;
        if (p.connected) {
          pid = p.id;
        } else if (!p.connecting) {  // else another thread is connecting
          p.connecting = true;
          metadata = p.metadata;
        }
      }
    }
    if (!metadata.empty()) {
      const int64_t t0 = NowNs();
      auto c = engine_->connect(ByteView(metadata));
      std::lock_guard<std::mutex> lock(mu_);
      PeerState& p = peers_[j];
      if (p.incarnation == inc) {
        p.connecting = false;
        if (c.ok()) {
          p.connected = true;
          p.id = *c;
          counters_["connects"]++;
        }
      }
      if (!c.ok()) {
        suspects_.push_back(
            {j, inc, t0, NowNs(), c.status().code(),
             "connect to process " + std::to_string(j) + ": " + c.status().to_string()});
        pid = 0;
      } else {
        pid = *c;
      }
    }
    if (pid == 0) {
      std::this_thread::sleep_for(5ms);
      continue;
    }

    // What to do: a write, a read of one of our slots, of its static region
    // or of its latest registered region.
    const bool read = chance(config_.read_share);
    const double which = std::uniform_real_distribution<double>(0, 1)(rng);
    int slot = -1;
    Slot s{};
    std::string history;
    RemoteDescriptor desc;
    PeerRegion region;
    {
      std::lock_guard<std::mutex> lock(mu_);
      PeerState& p = peers_[j];
      if (!p.known || p.incarnation != inc || p.slots.empty()) continue;
      std::vector<int> free;
      for (int k = 0; k < config_.slots; ++k) {
        const Slot& x = p.slots[k];
        if (!x.busy && (read || x.await_gen == 0)) free.push_back(k);
      }
      if ((!read || which < 0.5) && !free.empty()) {
        slot = free[std::uniform_int_distribution<size_t>(0, free.size() - 1)(rng)];
        Slot& x = p.slots[slot];
        x.busy = true;
        if (!read) ++x.gen;
        s = x;
        history = x.history;
        desc = p.target;
      } else if (read && which < 0.8) {
        desc = p.fixed;
      } else {
        region = p.region;
        if (!region.valid) desc = p.fixed;
        desc = region.valid ? region.desc : p.fixed;
      }
    }
    if (!read && slot < 0) continue;  // every slot busy or waiting for an acknowledgement

    // The shape and the content.
    uint64_t base = 0, bytes = 0, seed = 0;
    bool verify = true;
    if (slot >= 0 && !read) {
      bytes = LogUniform(rng, 1, config_.max_bytes);
      seed = Mix64(Mix64(config_.seed, (uint64_t(index_) << 32) | incarnation_),
                   Mix64((uint64_t(j) << 32) | inc, (uint64_t(slot) << 48) ^ s.gen));
    } else if (slot >= 0) {
      verify = s.known;
      const uint64_t extent = s.known ? s.bytes : config_.max_bytes;
      base = std::uniform_int_distribution<uint64_t>(0, extent - 1)(rng);
      bytes = LogUniform(rng, 1, extent - base);
      seed = s.cseed;
    } else {
      const uint64_t extent = region.valid ? region.length : config_.max_bytes;
      base = std::uniform_int_distribution<uint64_t>(0, extent - 1)(rng);
      bytes = LogUniform(rng, 1, extent - base);
      seed = region.valid ? region.seed : StaticSeed(config_, j, inc);
    }
    const auto pieces = RandomLayout(rng, bytes, LogUniform(rng, 1, config_.max_iovs));
    const uint64_t remote_base = slot >= 0 ? SlotOffset(index_, slot) + base : base;
    BuildIovs(pieces, mem.data(), &desc, remote_base, &l, &r);

    const bool notify = !read && chance(config_.notify_share);
    const Mode mode = notify ? Mode::kPlain : PickMode(config_, rng);
    std::string payload;
    if (!read) {
      for (const Piece& p : pieces) FillPattern(seed, p.remote, mem.host() + p.local, p.length);
      if (!Move(mem.memory(), true, 0, bytes)) {
        // Nothing posted: the slot keeps what it had, unknown from here.
        std::lock_guard<std::mutex> lock(mu_);
        PeerState& p = peers_[j];
        if (p.incarnation == inc && !p.slots.empty()) {
          p.slots[slot].busy = false;
          p.slots[slot].known = false;
        }
        continue;
      }
      if (notify) {
        payload = "W " + std::to_string(index_) + " " + std::to_string(incarnation_) + " " +
                  std::to_string(slot) + " " + std::to_string(s.gen) + " " + std::to_string(seed) +
                  " " + std::to_string(bytes);
      }
    }
    std::optional<ByteView> note;
    if (notify) note = ByteView(reinterpret_cast<const uint8_t*>(payload.data()), payload.size());
    const Outcome o = Execute(*engine_, !read, pid, l, r, note, mode, rng);

    const std::string what =
        std::string(read ? "read" : (notify ? "write+notification" : "write")) + " of " +
        std::to_string(bytes) + " bytes in " + std::to_string(pieces.size()) + " iovs, process " +
        std::to_string(j) +
        (slot >= 0 ? " slot " + std::to_string(slot) + " generation " + std::to_string(s.gen)
                   : (region.valid ? " region " + std::to_string(region.gen)
                                   : std::string(" static region"))) +
        " at " + std::to_string(base) +
        (mode == Mode::kCancel    ? " (cancel() after posting)"
         : mode == Mode::kTimeout ? " (blocking call with a timeout)"
                                  : "");
    if (slot >= 0) {
      std::lock_guard<std::mutex> lock(mu_);
      PeerState& p = peers_[j];
      if (p.incarnation == inc && !p.slots.empty()) {
        Slot& x = p.slots[slot];
        x.busy = false;
        if (!read) {
          x.known = o.status.ok();
          // The slot's last writes, for the message of a data error.
          x.history =
              (x.history.size() > 400 ? x.history.substr(x.history.size() - 400) : x.history) +
              " | generation " + std::to_string(s.gen) + " of " + std::to_string(bytes) + " bytes" +
              (mode == Mode::kCancel    ? " cancelled: "
               : mode == Mode::kTimeout ? " with a timeout: "
                                        : ": ") +
              std::string(status_code_name(o.status.code())) + " after " +
              std::to_string((o.done - o.posted) / 1000) + " us";
          x.cseed = seed;
          x.bytes = bytes;
          // The acknowledgement may have come before we got here.
          if (notify && x.last_acked < s.gen) {
            x.await_gen = s.gen;
            x.await_ok = o.status.ok();
            x.await_since = NowNs();
          }
        }
      }
    }
    if (o.status.ok()) {
      if (read && verify && Move(mem.memory(), false, 0, bytes)) {
        if (auto bad = Mismatch(seed, base, mem.host(), pieces)) {
          DataError(what + ": " + *bad +
                    (slot >= 0 ? " (the slot's last completed write is not what is there; its "
                                 "last writes, oldest first:" +
                                     history + ")"
                               : ""));
        }
      }
      Count(read ? (slot >= 0 ? "reads_slot" : (region.valid ? "reads_region" : "reads_static"))
                 : (notify ? "writes_notified" : "writes"));
      Count("bytes", bytes);
      if (mode == Mode::kPlain) Latency(o.done - o.posted);
      std::lock_guard<std::mutex> lock(mu_);
      PeerState& p = peers_[j];
      if (carrier_.empty() && p.incarnation == inc && p.connected) {
        auto routes = engine_->peer_transports(pid);
        if (routes.ok()) {
          for (const PeerTransportInfo& t : *routes) {
            // carries: a comma list of routes ("host memory, peer GPU memory").
            const std::string routes_text = ", " + t.carries + ",";
            if (t.connected &&
                routes_text.find(", " + config_.Route() + ",") != std::string::npos) {
              carrier_ = t.transport;
            }
          }
        }
        const std::string want = config_.ExpectedCarrier();
        if (!want.empty() && !carrier_.empty() && carrier_ != want) {
          counters_["carrier_mismatch"]++;
          out_.Write("ERROR " + config_.Route() + " goes over " + carrier_ + ", not " + want);
        }
      }
    } else if (o.chosen) {
      Count(mode == Mode::kCancel ? "cancelled" : "timed_out");
      if (read) {
        std::memset(mem.host(), kSentinel, bytes);
        if (Move(mem.memory(), true, 0, bytes)) sentinel_len = bytes;
      }
    } else if (o.status.code() == StatusCode::kNotFound && region.valid && slot < 0) {
      Count("reads_of_deregistered_region");  // deregistered while we read it: expected
    } else {
      Suspicious(j, inc, o.posted, o.status, what);
      std::this_thread::sleep_for(2ms);  // the peer may be gone: do not spin on it
    }
  }
}

}  // namespace ferry::soak
