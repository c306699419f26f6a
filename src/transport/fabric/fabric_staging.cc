#include <dlfcn.h>
#include <poll.h>
#include <pthread.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>

#include "core/block_cache.h"
#include "core/byte_codec.h"
#include "core/cpu_relax.h"
#include "core/thread_name.h"
#include "core/version.h"
#include "ferry/gpu.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"
#include "transport/fabric/fabric_internal.h"
#include "transport/fabric/fabric_transport.h"

namespace ferry::fabric {

using namespace internal;  // NOLINT(google-build-using-namespace): this transport's own helpers

// --- GPU staging ------------------------------------------------------------------

Result<staging::GpuPath*> FabricTransport::gpu() {
  std::lock_guard lock(gpu_mu_);
  if (gpu_) return gpu_.get();
  if (!gpu_error_.ok()) return gpu_error_;
  staging::GpuPathOptions o;
  o.staging_bytes = opt_.gpu_staging_bytes;
  o.slot_bytes = std::min(kStagingSlotBytes, max_op_bytes_);
  o.user = "fabric";
  auto created = staging::GpuPath::create(o, "ferry-fab");
  if (!created.ok()) {
    gpu_error_ = created.status();
    return gpu_error_;
  }
  // The pool is registered once, as a whole: every slot lies in it.
  if (mr_mode_ & FI_MR_LOCAL) {
    auto [base, bytes] = (*created)->staging_memory();
    const int r = register_mr(base, bytes, FI_READ | FI_WRITE, -1, &staging_mr_);
    if (r != 0) {
      gpu_error_ = err::Internal(fmt::format(
          "fabric: registering the {} bytes of GPU staging memory: {}", bytes, fi_error(r)));
      return gpu_error_;
    }
    staging_desc_ = fi_mr_desc(staging_mr_);
  }
  spdlog::info(
      "ferry: fabric: local GPU memory staged through {} MiB of pinned memory ({} KiB "
      "slots; no FI_HMEM)",
      opt_.gpu_staging_bytes >> 20, o.slot_bytes >> 10);
  gpu_ = std::move(created.value());
  return gpu_.get();
}

Status FabricTransport::plan_staging(Job& job, staging::GpuPath* path) {
  const uint64_t slot = path->slot_bytes();
  std::vector<Segment> out;
  out.reserve(job.segs.size());
  for (const Segment& s : job.segs) {
    if (s.local_device < 0 || s.length <= slot) {
      out.push_back(s);
      continue;
    }
    for (uint64_t off = 0; off < s.length; off += slot) {
      Segment piece = s;
      piece.local = s.local + off;
      piece.length = std::min(slot, s.length - off);
      piece.remote.offset = s.remote.offset + off;
      piece.remote.length = piece.length;
      out.push_back(piece);
    }
  }
  job.segs = std::move(out);
  job.group_of.assign(job.segs.size(), -1);
  job.slot_off.assign(job.segs.size(), 0);
  for (size_t i = 0; i < job.segs.size(); ++i) {
    const Segment& s = job.segs[i];
    if (s.local_device < 0) continue;
    if (job.groups.empty() || job.groups.back().bytes + s.length > slot) {
      job.groups.emplace_back();
      job.groups.back().first = i;
    }
    StageGroup& g = job.groups.back();
    job.group_of[i] = static_cast<int32_t>(job.groups.size() - 1);
    job.slot_off[i] = g.bytes;
    g.bytes += s.length;
    g.left = g.bytes;
    g.last = i;
  }
  return Status::Ok();
}

void FabricTransport::start_staging(const std::shared_ptr<Job>& job) {
  staging::GpuPath* path;
  {
    std::lock_guard lock(gpu_mu_);
    path = gpu_.get();
  }
  if (!path) return;  // shut down: the job has failed
  // One request per group, in order: the pool serves waiters in request
  // order, so a transfer larger than the pool flows through it as its
  // earlier groups give their slots back.
  for (size_t g = 0; g < job->groups.size(); ++g) {
    auto slot = path->slot_or_later(
        [this, job, g](std::unique_ptr<StagingSlot> later) { on_slot(job, g, std::move(later)); });
    if (slot) on_slot(job, g, std::move(slot));
  }
}

void FabricTransport::on_slot(const std::shared_ptr<Job>& job, size_t g,
                              std::unique_ptr<StagingSlot> slot) {
  std::vector<staging::DeviceCopy> copies;
  {
    std::lock_guard lock(post_mu_);
    if (job->stopped || job->finished) return;  // the slot goes back
    StageGroup& group = job->groups[g];
    group.slot = std::move(slot);
    if (!job->write) {
      group.ready = true;  // a read lands in the slot
      pump_locked();
    } else {
      for (size_t i = group.first; i <= group.last; ++i) {
        if (job->group_of[i] != static_cast<int32_t>(g)) continue;
        const Segment& s = job->segs[i];
        copies.push_back(
            {s.local_device, {group.slot->data() + job->slot_off[i], s.local, s.length}});
      }
      ++job->copies;
    }
  }
  if (copies.empty()) {
    wake();
    return;
  }
  staging::GpuPath* path;
  {
    std::lock_guard lock(gpu_mu_);
    path = gpu_.get();
  }
  auto done = [this, job, g](Status st) {
    {
      std::lock_guard lock(post_mu_);
      --job->copies;
      if (!st.ok()) {
        stop_staged_job_locked(*job, st,
                               fmt::format("staging {} bytes of GPU memory for the write to {}",
                                           job->groups[g].bytes, describe(*job->peer)));
      } else {
        job->groups[g].ready = true;
        pump_locked();
      }
      maybe_finish_locked(job);
      notify_job_waiters_locked();
    }
    wake();
  };
  if (!path) {
    done(err::Cancelled("fabric: transport shut down"));
    return;
  }
  // The write's source: after what the caller queued on the default stream.
  path->copy_then(std::move(copies), std::move(done), /*after_default_stream=*/true);
}

void FabricTransport::group_done_locked(const std::shared_ptr<Job>& job, size_t g,
                                        const Status& error) {
  StageGroup& group = job->groups[g];
  if (job->write || !error.ok() || job->stopped || !job->error.ok()) {
    group.slot.reset();  // back to the pool (a waiter gets it on the job thread)
    return;
  }
  // A read: every byte of the group is in the slot; slot → device, then the
  // slot goes back. The copy is submitted from the staging job thread (this
  // one holds post_mu_, which the copy's completion takes).
  std::vector<staging::DeviceCopy> copies;
  for (size_t i = group.first; i <= group.last; ++i) {
    if (job->group_of[i] != static_cast<int32_t>(g)) continue;
    const Segment& s = job->segs[i];
    copies.push_back({s.local_device, {s.local, group.slot->data() + job->slot_off[i], s.length}});
  }
  staging::GpuPath* path;
  {
    std::lock_guard gpu_lock(gpu_mu_);  // after post_mu_, never before it
    path = gpu_.get();
  }
  if (!path) {
    group.slot.reset();
    return;
  }
  ++job->copies;
  path->run([this, job, g, path, copies = std::move(copies)]() mutable {
    path->copy_then(
        std::move(copies),
        [this, job, g](Status st) {
          {
            std::lock_guard lock(post_mu_);
            --job->copies;
            job->groups[g].slot.reset();
            if (!st.ok()) {
              stop_staged_job_locked(*job, st,
                                     fmt::format("copying {} bytes read from {} into GPU memory",
                                                 job->groups[g].bytes, describe(*job->peer)));
            }
            maybe_finish_locked(job);
            notify_job_waiters_locked();
          }
          wake();
        },
        /*after_default_stream=*/false, job->after);
  });
}

bool FabricTransport::staged_waiting_locked(const Job& job) const {
  if (job.group_of.empty() || job.next >= job.segs.size()) return false;
  const int32_t g = job.group_of[job.next];
  return g >= 0 && !job.groups[static_cast<size_t>(g)].ready;
}

}  // namespace ferry::fabric
