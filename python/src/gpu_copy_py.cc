// Python bindings of the batched local copy: the one-shot copy_blocks and the
// ordered CopyStream (include/ferry/gpu.h). Addresses are plain ints, as
// frameworks hand them out (tensor.data_ptr() + offset); ferry/_gpu.py turns
// what the caller passes into the three uint64 columns taken here. Submitting
// and waiting run without the GIL; a wait takes it back every 50 ms to let
// Ctrl-C through.
#include "gpu_copy_py.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ferry/gpu.h"
#include "status_error.h"
#include "wait_slices.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace ferry_py {
namespace {

using ferry::StatusCode;
using Column = nb::ndarray<const uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

std::vector<ferry::CopyBlock> blocks_of(const Column& dst, const Column& src, const Column& sizes) {
  const size_t n = dst.shape(0);
  if (src.shape(0) != n || sizes.shape(0) != n) {
    raise(StatusCode::kInvalidArgument,
          "dst, src and sizes must have one entry per block: got " + std::to_string(n) + ", " +
              std::to_string(src.shape(0)) + " and " + std::to_string(sizes.shape(0)));
  }
  std::vector<ferry::CopyBlock> blocks(n);
  for (size_t i = 0; i < n; ++i) {
    blocks[i].dst = reinterpret_cast<void*>(static_cast<uintptr_t>(dst.data()[i]));
    blocks[i].src = reinterpret_cast<const void*>(static_cast<uintptr_t>(src.data()[i]));
    blocks[i].size = sizes.data()[i];
  }
  return blocks;
}

ferry::CopyOptions options_of(uint32_t sm_budget, uint64_t kernel_max_block, bool use_batch_api) {
  ferry::CopyOptions o;
  o.sm_budget = sm_budget;
  o.kernel_max_block = kernel_max_block;
  o.use_batch_api = use_batch_api;
  return o;
}

nb::dict options_dict(const ferry::CopyOptions& o) {
  nb::dict d;
  d["sm_budget"] = o.sm_budget;
  d["kernel_max_block"] = o.kernel_max_block;
  d["use_batch_api"] = o.use_batch_api;
  return d;
}

class PyCopyStream {
 public:
  PyCopyStream(int device, const ferry::CopyOptions& options)
      : stream_(unwrap(ferry::CopyStream::create(device, options))) {}

  uint64_t submit(const Column& dst, const Column& src, const Column& sizes) {
    const std::vector<ferry::CopyBlock> blocks = blocks_of(dst, src, sizes);
    auto ticket = [&] {
      nb::gil_scoped_release release;
      return stream_->submit(blocks);
    }();
    return unwrap(std::move(ticket));
  }

  bool poll(uint64_t ticket) {
    const ferry::Status s = stream_->poll(ticket);
    if (s.code() == StatusCode::kInProgress) return false;
    check(s);
    return true;
  }

  void wait(uint64_t ticket, std::optional<double> timeout_s) {
    const WaitDeadline deadline(timeout_s);
    for (;;) {
      const std::chrono::milliseconds slice = deadline.next_slice();
      ferry::Status s;
      {
        nb::gil_scoped_release release;
        s = stream_->wait(ticket, slice);
      }
      if (s.code() != StatusCode::kTimeout) {
        check(s);
        return;
      }
      if (PyErr_CheckSignals() != 0) throw nb::python_error();
      if (deadline.passed()) {
        raise(StatusCode::kTimeout, "copy batch " + std::to_string(ticket) + " not done after " +
                                        std::to_string(*timeout_s) + " s (done through batch " +
                                        std::to_string(stream_->completed_through()) +
                                        "); the copy goes on");
      }
    }
  }

  nb::dict stats() {
    ferry::CopyStreamStats st;
    {
      nb::gil_scoped_release release;  // reading sms_used waits for the enqueued work
      st = stream_->stats();
    }
    nb::dict d;
    d["batches"] = st.batches;
    d["kernel_blocks"] = st.kernel_blocks;
    d["engine_blocks"] = st.engine_blocks;
    d["kernel_launches"] = st.kernel_launches;
    d["max_ctas"] = st.max_ctas;
    d["sms_used"] = st.sms_used;
    return d;
  }

  ferry::CopyStream& stream() { return *stream_; }

 private:
  std::unique_ptr<ferry::CopyStream> stream_;
};

}  // namespace

void bind_gpu_copy(nb::module_& m) {
  m.def(
      "cuda_available", [] { return ferry::cuda_available(); },
      "True when this build has CUDA support and a device answers.");
  m.def(
      "cuda_unavailable_reason",
      [] {
        std::string reason;
        ferry::cuda_available(&reason);
        return reason;
      },
      "Why GPU support is unavailable ('' when it is available).");
  m.def(
      "cuda_device_count", [] { return ferry::cuda_device_count(); },
      "Visible CUDA devices; 0 without CUDA support, driver or device.");
  m.def(
      "gpus",
      [] {
        nb::list out;
        auto gpus = ferry::gpu_identities();
        if (!gpus.ok()) return out;  // no CUDA, driver or device: none, as cuda_device_count()
        for (const ferry::GpuIdentity& g : *gpus) {
          nb::dict d;
          d["ordinal"] = g.ordinal;
          d["uuid"] = g.uuid;
          d["pci_bus_id"] = g.pci_bus_id;
          d["name"] = g.name;
          out.append(d);
        }
        return out;
      },
      "The GPUs this process sees, named by what they are: a list of dicts with ordinal, "
      "uuid ('GPU-...'), pci_bus_id ('0000:18:00.0') and name. [] without CUDA support, "
      "driver or device.");
  m.def(
      "gpu_ordinal", [](const std::string& name) { return unwrap(ferry::gpu_ordinal(name)); },
      "name"_a,
      "This process's CUDA ordinal of the GPU named by UUID or PCI bus id (processes with "
      "different CUDA_VISIBLE_DEVICES number GPUs differently). NotFound, naming the GPUs this "
      "process sees, when it does not see it.");
  m.def(
      "_copy_blocks",
      [](const Column& dst, const Column& src, const Column& sizes, int device, uint32_t sm_budget,
         uint64_t kernel_max_block, bool use_batch_api) {
        const std::vector<ferry::CopyBlock> blocks = blocks_of(dst, src, sizes);
        const ferry::CopyOptions options = options_of(sm_budget, kernel_max_block, use_batch_api);
        ferry::Status s;
        {
          nb::gil_scoped_release release;
          s = ferry::copy_blocks(blocks, options, device);
        }
        check(s);
      },
      "dst"_a, "src"_a, "sizes"_a, "device"_a, "sm_budget"_a, "kernel_max_block"_a,
      "use_batch_api"_a);

  nb::class_<PyCopyStream>(m, "_CopyStream", "An ordered batched-copy stream on one GPU.")
      .def(
          "__init__",
          [](PyCopyStream* self, int device, uint32_t sm_budget, uint64_t kernel_max_block,
             bool use_batch_api) {
            new (self) PyCopyStream(device, options_of(sm_budget, kernel_max_block, use_batch_api));
          },
          "device"_a, "sm_budget"_a, "kernel_max_block"_a, "use_batch_api"_a)
      .def("submit", &PyCopyStream::submit, "dst"_a, "src"_a, "sizes"_a)
      .def("poll", &PyCopyStream::poll, "ticket"_a)
      .def("wait", &PyCopyStream::wait, "ticket"_a, "timeout"_a = nb::none())
      .def("stats", &PyCopyStream::stats)
      .def_prop_ro("device", [](PyCopyStream& s) { return s.stream().device(); })
      .def_prop_ro("options", [](PyCopyStream& s) { return options_dict(s.stream().options()); })
      .def_prop_ro("completed_through",
                   [](PyCopyStream& s) { return s.stream().completed_through(); })
      .def_prop_ro("last_submitted", [](PyCopyStream& s) { return s.stream().last_submitted(); })
      .def_prop_ro("native_stream", [](PyCopyStream& s) {
        return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(s.stream().native_stream()));
      });
}

}  // namespace ferry_py
