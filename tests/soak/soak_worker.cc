// The worker's life: engine and regions, the coordinator's commands, the
// target's side of notifications, readable regions registered and
// deregistered under traffic, the judging of errors against faults, reports.
#include "soak_worker.h"

#include <signal.h>
#include <sys/prctl.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "soak_worker_impl.h"

namespace ferry::soak {

using namespace std::chrono_literals;
using itest::FillPattern;
using itest::FromHex;
using itest::MatchesPattern;
using itest::Split;
using itest::ToHex;

uint64_t StaticSeed(const SoakConfig& c, int index, uint32_t incarnation) {
  return Mix64(c.seed ^ 0x5354415449430000ull, (uint64_t(index) << 32) | incarnation);
}

namespace {

uint64_t RegionSeed(const SoakConfig& c, int index, uint32_t incarnation, uint64_t gen) {
  return Mix64(Mix64(c.seed ^ 0x524547494f4e0000ull, (uint64_t(index) << 32) | incarnation), gen);
}

std::optional<RemoteDescriptor> DescriptorFromHex(const std::string& hex) {
  auto bytes = FromHex(hex);
  if (!bytes) return std::nullopt;
  auto d = RemoteDescriptor::from_bytes(ByteView(*bytes));
  if (!d.ok()) return std::nullopt;
  return *d;
}

std::string DescriptorHex(const RemoteDescriptor& d) {
  return ToHex(d.to_bytes());
}

// Grace after a fault ends: reconnection, shm's cancel timeout, lines in flight.
constexpr int64_t kGraceNs = 5'000'000'000;
constexpr int64_t kLostAfterNs = 30'000'000'000;
constexpr int64_t kQuarantineNs = 15'000'000'000;

}  // namespace

Worker::Worker(const SoakConfig& config, int index, uint32_t incarnation)
    : config_(config),
      index_(index),
      incarnation_(incarnation),
      rng_(Mix64(config.seed, (uint64_t(index) << 32) | incarnation)) {
  peers_.resize(config_.processes);
}

bool Worker::Setup() {
  std::string error;
  if (config_.memory == "gpu") {
    // Before the engine starts CUDA in this process (--gpu-isolate sets
    // CUDA_VISIBLE_DEVICES).
    device_ = SelectGpu(config_, index_, &error);
    if (device_ < 0) {
      std::fprintf(stderr, "soak worker %d: %s\n", index_, error.c_str());
      return false;
    }
  }
  EngineConfig ec;
  ec.options = config_.EngineOptions();
  auto e = Engine::create(ec);
  if (!e.ok()) {
    std::fprintf(stderr, "soak worker %d: Engine::create: %s\n", index_,
                 e.status().to_string().c_str());
    return false;
  }
  engine_ = std::move(e.value());
  const uint64_t area_bytes = ScratchOffset() + config_.max_bytes;
  area_ = SoakMemory::Create(config_, device_, area_bytes, &error);
  if (area_) fixed_ = SoakMemory::Create(config_, device_, config_.max_bytes, &error);
  if (!area_ || !fixed_) {
    std::fprintf(stderr, "soak worker %d: %s\n", index_, error.c_str());
    return false;
  }
  FillPattern(StaticSeed(config_, index_, incarnation_), 0, fixed_->host(), config_.max_bytes);
  if (!fixed_->ToMemory(0, config_.max_bytes, &error)) {
    std::fprintf(stderr, "soak worker %d: %s\n", index_, error.c_str());
    return false;
  }
  auto a = engine_->register_memory(area_->data(), area_bytes);
  auto f = engine_->register_memory(fixed_->data(), config_.max_bytes);
  if (!a.ok() || !f.ok()) {
    std::fprintf(stderr, "soak worker %d: register_memory: %s %s\n", index_,
                 a.status().to_string().c_str(), f.status().to_string().c_str());
    return false;
  }
  area_id_ = a->id;
  fixed_id_ = f->id;
  auto ad = engine_->advertise(area_id_);
  auto fd = engine_->advertise(fixed_id_, 0, UINT64_MAX, kAccessRead);
  if (!ad.ok() || !fd.ok()) return false;
  out_.Write("READY " + std::to_string(index_) + " " + std::to_string(incarnation_) + " " +
             std::to_string(engine_->id()) + " " + ToHex(engine_->metadata()) + " " +
             DescriptorHex(*ad) + " " + DescriptorHex(*fd));
  return true;
}

void Worker::HandleCommand(const std::string& line) {
  const auto f = Split(line);
  if (f.empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (f[0] == "PEER" && f.size() == 7) {
    // PEER index incarnation engine_id metadata target_desc static_desc
    const int j = std::stoi(f[1]);
    if (j < 0 || j >= config_.processes || j == index_) return;
    PeerState& p = peers_[j];
    const uint32_t inc = static_cast<uint32_t>(std::stoul(f[2]));
    auto meta = FromHex(f[4]);
    auto target = DescriptorFromHex(f[5]);
    auto fixed = DescriptorFromHex(f[6]);
    if (!meta || !target || !fixed) {
      DataError("coordinator sent a malformed PEER line for process " + f[1]);
      return;
    }
    if (p.known && p.incarnation != inc) {
      // A restarted peer: its memory is new; nothing of ours is there.
      for (FaultWindow& w : p.windows) {
        if (w.kill && w.end == INT64_MAX) w.end = NowNs() + kGraceNs;
      }
    }
    p.known = true;
    p.incarnation = inc;
    p.engine_id = std::stoull(f[3]);
    p.metadata = std::move(*meta);
    p.target = *target;
    p.fixed = *fixed;
    p.region = {};
    p.connected = false;
    p.connecting = false;
    p.id = 0;
    p.slots.assign(config_.slots, Slot{});
  } else if (f[0] == "PREGION" && f.size() == 7) {
    // PREGION index incarnation gen seed length desc
    const int j = std::stoi(f[1]);
    if (j < 0 || j >= config_.processes || j == index_) return;
    PeerState& p = peers_[j];
    if (!p.known || p.incarnation != std::stoul(f[2])) return;
    auto d = DescriptorFromHex(f[6]);
    if (!d) return;
    p.region = {true, std::stoull(f[3]), std::stoull(f[4]), std::stoull(f[5]), *d};
  } else if (f[0] == "FAULT" && f.size() == 5) {
    // FAULT kill|stop|cont index incarnation monotonic_ns
    const int j = std::stoi(f[2]);
    const uint32_t inc = static_cast<uint32_t>(std::stoul(f[3]));
    const int64_t at = std::stoll(f[4]);
    if (j < 0 || j >= config_.processes) return;
    auto& windows = j == index_ ? self_windows_ : peers_[j].windows;
    if (f[1] == "kill") {
      windows.push_back({at, INT64_MAX, true, inc});
    } else if (f[1] == "stop") {
      windows.push_back({at, INT64_MAX, false, inc});
    } else if (f[1] == "cont") {
      for (FaultWindow& w : windows) {
        if (!w.kill && w.end == INT64_MAX) w.end = at + kGraceNs;
      }
    }
  } else if (f[0] == "GO") {
    go_ = true;
  } else if (f[0] == "STOP") {
    stopping_ = true;
  } else if (f[0] == "EXIT") {
    exiting_ = true;
  }
}

// --- the target's side of notifications -------------------------------------

void Worker::NotificationLoop() {
  while (!exiting_) {
    for (const Notification& n : engine_->wait_notifications(100ms)) {
      const std::string text(n.payload.begin(), n.payload.end());
      const auto f = Split(text);
      if (!f.empty() && f[0] == "W" && f.size() == 7) {
        OnWriteNotification(n, f);
      } else if (!f.empty() && f[0] == "A" && f.size() == 5) {
        OnAcknowledgement(f);
      } else {
        DataError("a notification from engine " + std::to_string(n.peer) +
                  " that no soak process sent: '" + text.substr(0, 80) + "'");
      }
    }
  }
}

// "W source incarnation slot gen cseed bytes": check the slot, acknowledge.
void Worker::OnWriteNotification(const Notification& n, const std::vector<std::string>& f) {
  const int s = std::stoi(f[1]);
  const uint32_t inc = static_cast<uint32_t>(std::stoul(f[2]));
  const int k = std::stoi(f[3]);
  const uint64_t gen = std::stoull(f[4]), cseed = std::stoull(f[5]), bytes = std::stoull(f[6]);
  if (s < 0 || s >= config_.processes || s == index_ || k < 0 || k >= config_.slots ||
      bytes > config_.max_bytes) {
    DataError("a write notification naming source " + f[1] + " slot " + f[3] + " (out of range)");
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    PeerState& p = peers_[s];
    if (p.known && inc < p.incarnation) {
      counters_["notifications_stale"]++;  // from a source that was killed since
      return;
    }
    if (p.seen_incarnation != inc || p.seen_gen.empty()) {
      p.seen_incarnation = inc;
      p.seen_gen.assign(config_.slots, 0);
    }
    if (gen <= p.seen_gen[k]) {
      counters_["notifications_duplicated"]++;
      DataError("notification of process " + f[1] + " (incarnation " + f[2] + ") slot " + f[3] +
                " generation " + f[4] + " seen again (last seen generation " +
                std::to_string(p.seen_gen[k]) + ")");
      return;
    }
    p.seen_gen[k] = gen;
  }
  Count("notifications_received");
  if (!Move(*area_, false, SlotOffset(s, k), bytes)) return;
  const uint8_t* at = area_->host() + SlotOffset(s, k);
  size_t bad = 0;
  if (!MatchesPattern(cseed, 0, at, bytes, &bad)) {
    uint8_t want = 0;
    FillPattern(cseed, bad, &want, 1);
    DataError("target check: write of process " + f[1] + " (incarnation " + f[2] + ") slot " +
              f[3] + " generation " + f[4] + ", " + std::to_string(bytes) +
              " bytes, notified as complete: byte " + std::to_string(bad) + " is " +
              std::to_string(at[bad]) + ", expected " + std::to_string(want));
  } else {
    Count("notifications_verified_bytes", bytes);
  }
  const std::string ack =
      "A " + std::to_string(index_) + " " + std::to_string(incarnation_) + " " + f[3] + " " + f[4];
  const Status st =
      engine_->notify(n.peer, ByteView(reinterpret_cast<const uint8_t*>(ack.data()), ack.size()));
  if (!st.ok()) Count("acks_not_sent");
}

// "A target incarnation slot gen": our write's notification was seen and checked.
void Worker::OnAcknowledgement(const std::vector<std::string>& f) {
  const int t = std::stoi(f[1]);
  const uint32_t inc = static_cast<uint32_t>(std::stoul(f[2]));
  const int k = std::stoi(f[3]);
  const uint64_t gen = std::stoull(f[4]);
  std::lock_guard<std::mutex> lock(mu_);
  if (t < 0 || t >= config_.processes || k < 0 || k >= config_.slots) return;
  PeerState& p = peers_[t];
  if (!p.known || p.incarnation != inc || p.slots.empty()) return;  // an older target
  Slot& slot = p.slots[k];
  if (gen <= slot.last_acked) {
    counters_["notifications_duplicated"]++;
    DataError("acknowledgement from process " + f[1] + " for slot " + f[3] + " generation " + f[4] +
              " came twice: the target saw the notification twice");
    return;
  }
  slot.last_acked = gen;
  counters_["notifications_acknowledged"]++;
  if (slot.await_gen == gen) slot.await_gen = 0;
}

// --- regions registered and deregistered under traffic ---------------------

void Worker::RotateRegion() {
  OwnRegion r;
  r.gen = ++region_gen_;
  const uint64_t len = LogUniform(rng_, 4096, std::max<uint64_t>(4096, config_.max_bytes / 4));
  std::string error;
  r.memory = SoakMemory::Create(config_, device_, len, &error);
  if (!r.memory) {
    CountError("region memory", Status(StatusCode::kInternal, error), false);
    return;
  }
  const uint64_t seed = RegionSeed(config_, index_, incarnation_, r.gen);
  FillPattern(seed, 0, r.memory->host(), len);
  if (!Move(*r.memory, true, 0, len)) return;
  auto reg = engine_->register_memory(r.memory->data(), len);
  if (!reg.ok()) {
    CountError("register_memory", reg.status(), false);
    return;
  }
  r.id = reg->id;
  auto d = engine_->advertise(r.id, 0, UINT64_MAX, kAccessRead);
  if (!d.ok()) {
    CountError("advertise", d.status(), false);
    return;
  }
  Count("registrations");
  out_.Write("REGION " + std::to_string(r.gen) + " " + std::to_string(seed) + " " +
             std::to_string(len) + " " + DescriptorHex(*d));
  regions_.push_back(std::move(r));
  while (regions_.size() > 3) {
    // Deregistered while peers read it, and unmapped at once: an engine
    // touching it after deregister_memory() returned would crash us.
    const int64_t t0 = NowNs();
    const Status s = engine_->deregister_memory(regions_.front().id);
    const int64_t took = NowNs() - t0;
    if (!s.ok()) CountError("deregister_memory", s, false);
    regions_.pop_front();
    std::lock_guard<std::mutex> lock(mu_);
    counters_["deregistrations"]++;
    counters_["deregister_max_us"] =
        std::max<uint64_t>(counters_["deregister_max_us"], static_cast<uint64_t>(took / 1000));
  }
}

// --- errors judged against faults --------------------------------------------

void Worker::JudgeSuspects(bool all) {
  const int64_t now = NowNs();
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Suspect> keep;
  for (Suspect& s : suspects_) {
    // Judged once the coordinator's FAULT line must have arrived.
    if (!all && s.done > now - 3'000'000'000) {
      keep.push_back(std::move(s));
      continue;
    }
    bool explained = false;
    auto covers = [&](const FaultWindow& w) { return w.start <= s.done && w.end >= s.posted; };
    for (const FaultWindow& w : self_windows_) explained |= covers(w);
    if (s.peer >= 0) {
      for (const FaultWindow& w : peers_[s.peer].windows) {
        if (!covers(w)) continue;
        explained = true;
        // A killed peer's transfers in flight fail within the bound.
        if (w.kill && w.incarnation == s.incarnation && s.posted < w.start &&
            s.code == StatusCode::kPeerDisconnected) {
          const int64_t took = s.done - w.start;
          max_fail_ns_ = std::max(max_fail_ns_, took);
          if (took > int64_t{config_.fail_bound_ms} * 1'000'000) {
            counters_["late_failures"]++;
            DataError("a transfer to killed process " + std::to_string(s.peer) + " failed " +
                      std::to_string(took / 1'000'000) + " ms after the kill (bound " +
                      std::to_string(config_.fail_bound_ms) + " ms): " + s.what);
          }
        }
      }
    }
    const std::string code(status_code_name(s.code));
    counters_["err." + code + (explained ? ".fault" : ".unexpected")]++;
    if (!explained) {
      counters_["unexpected_errors"]++;
      if (error_lines_++ < 20) {
        out_.Write("ERROR unexpected: " + s.what + " (no fault on process " +
                   std::to_string(s.peer) + " then)");
      }
    }
  }
  suspects_ = std::move(keep);
}

void Worker::Housekeeping(bool final) {
  const int64_t now = NowNs();
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t j = 0; j < peers_.size(); ++j) {
    PeerState& p = peers_[j];
    for (size_t k = 0; k < p.slots.size(); ++k) {
      Slot& slot = p.slots[k];
      if (slot.await_gen == 0) continue;
      bool faulted = false;
      for (const FaultWindow& w : p.windows) faulted |= w.end >= slot.await_since;
      for (const FaultWindow& w : self_windows_) faulted |= w.end >= slot.await_since;
      const int64_t age = now - slot.await_since;
      if (!slot.await_ok || faulted) {
        // The write failed, or a fault may have eaten the notification:
        // the slot is free again once a late acknowledgement can no longer come.
        if (age > kQuarantineNs || final) slot.await_gen = 0;
      } else if (age > kLostAfterNs || final) {
        counters_["notifications_lost"]++;
        if (error_lines_++ < 20) {
          out_.Write("ERROR lost notification: write to process " + std::to_string(j) + " slot " +
                     std::to_string(k) + " generation " + std::to_string(slot.await_gen) +
                     " completed " + std::to_string(age / 1'000'000) +
                     " ms ago; no acknowledgement");
        }
        slot.await_gen = 0;
      }
    }
  }
}

void Worker::Drain() {
  // Acknowledgements of the last writes with notifications, up to 20 s.
  const int64_t until = NowNs() + 20'000'000'000;
  while (NowNs() < until) {
    bool waiting = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const PeerState& p : peers_) {
        for (const Slot& s : p.slots) waiting |= s.await_gen != 0 && s.await_ok;
      }
    }
    if (!waiting) break;
    std::this_thread::sleep_for(20ms);
  }
  Housekeeping(true);
  std::this_thread::sleep_for(3s);  // FAULT lines for the last errors
  JudgeSuspects(true);
}

std::string Worker::StatsLine() {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream s;
  s << "STATS rss=" << RssBytes() << " heap=" << HeapInUseBytes() << " fds=" << OpenDescriptors()
    << " data_errors=" << data_errors_.load() << " max_fail_ms=" << max_fail_ns_ / 1'000'000
    << " carrier=" << (carrier_.empty() ? "-" : carrier_);
  for (const auto& [k, v] : counters_) s << ' ' << k << '=' << v;
  s << " lat=" << latency_.Encode();
  return s.str();
}

// --- counting -----------------------------------------------------------------

void Worker::Count(const std::string& key, uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  counters_[key] += n;
}

void Worker::CountError(const std::string& kind, const Status& s, bool expected) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string code(status_code_name(s.code()));
  counters_["err." + code + (expected ? ".chosen" : ".unexpected")]++;
  if (!expected) {
    counters_["unexpected_errors"]++;
    if (error_lines_++ < 20) out_.Write("ERROR unexpected: " + kind + ": " + s.to_string());
  }
}

void Worker::DataError(const std::string& text) {
  // Called with or without mu_ held: counts through an atomic of its own.
  if (data_errors_++ < 50) out_.Write("ERROR data: " + text);
}

void Worker::Suspicious(int peer, uint32_t incarnation, int64_t posted, const Status& s,
                        const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  suspects_.push_back({peer, incarnation, posted, NowNs(), s.code(), what + ": " + s.to_string()});
  if (peer >= 0 && peers_[peer].incarnation == incarnation) peers_[peer].connected = false;
}

bool Worker::Move(SoakMemory& m, bool to_memory, uint64_t offset, uint64_t length) {
  std::string error;
  if (to_memory ? m.ToMemory(offset, length, &error) : m.FromMemory(offset, length, &error)) {
    return true;
  }
  std::lock_guard<std::mutex> lock(mu_);
  counters_["gpu_copy_failed"]++;
  counters_["unexpected_errors"]++;
  if (error_lines_++ < 20) out_.Write("ERROR unexpected: " + error);
  return false;
}

void Worker::Latency(int64_t ns) {
  std::lock_guard<std::mutex> lock(mu_);
  latency_.Add(ns);
}

// --- the process --------------------------------------------------------------

int Worker::Run() {
  prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the coordinator
  signal(SIGPIPE, SIG_IGN);
  if (!Setup()) return 2;
  std::thread notifications([this] { NotificationLoop(); });
  std::vector<std::thread> traffic;
  LineReader in;
  int64_t next_report = NowNs(), next_region = NowNs(), next_judge = NowNs();
  bool started = false, drained = false;
  while (!exiting_) {
    bool eof = false;
    if (auto line = in.Read(20, &eof)) HandleCommand(*line);
    if (eof) break;
    const int64_t now = NowNs();
    if (go_ && !started) {
      started = true;
      for (int t = 0; t < config_.threads; ++t) traffic.emplace_back([this, t] { TrafficLoop(t); });
    }
    if (config_.region_every_ms > 0 && now >= next_region) {
      next_region = now + static_cast<int64_t>(config_.region_every_ms * 1e6);
      RotateRegion();
    }
    if (now >= next_judge) {
      next_judge = now + 1'000'000'000;
      JudgeSuspects(false);
      Housekeeping(false);
    }
    if (now >= next_report) {
      next_report = now + 1'000'000'000;
      out_.Write(StatsLine());
    }
    if (stopping_ && !drained) {
      for (std::thread& t : traffic) t.join();
      traffic.clear();
      Drain();
      drained = true;
      out_.Write(StatsLine());
      out_.Write("DONE");
    }
  }
  stopping_ = true;
  for (std::thread& t : traffic) t.join();
  exiting_ = true;
  notifications.join();
  // Destroyed with whatever is still in flight (nothing, after a drain).
  for (OwnRegion& r : regions_) (void)engine_->deregister_memory(r.id);
  regions_.clear();
  engine_.reset();
  return 0;
}

int RunWorker(const SoakConfig& config, int index, uint32_t incarnation) {
  Worker w(config, index, incarnation);
  return w.Run();
}

}  // namespace ferry::soak
