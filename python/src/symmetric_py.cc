// Python bindings of symmetric memory and the MoE exchange
// (include/ferry/symmetric.h, include/ferry/moe.h). Device addresses and
// streams are plain ints, as torch hands them out (tensor.data_ptr(),
// stream.cuda_stream); ferry/symmetric.py checks tensors and turns what the
// caller passes into them. Buffers go out as DLPack capsules that keep their
// owner (the Python object) alive until the consumer lets go.
#include "symmetric_py.h"

#include <Python.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dlpack_min.h"
#include "ferry/moe.h"
#include "ferry/symmetric.h"
#include "status_error.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace ferry_py {
namespace {

using ferry::StatusCode;
namespace dl = dlpack;

// A DLPack tensor over `data` (device memory of GPU `device`) that holds a
// reference to `owner` until the consumer calls the deleter.
struct Exported {
  dl::DLManagedTensor managed{};
  std::vector<int64_t> shape;
  PyObject* owner = nullptr;
};

void delete_exported(dl::DLManagedTensor* self) {
  auto* e = static_cast<Exported*>(self->manager_ctx);
  // Consumers may call this from any thread (torch frees storage where the
  // last reference goes): take the GIL for the decref.
  PyGILState_STATE g = PyGILState_Ensure();
  Py_XDECREF(e->owner);
  PyGILState_Release(g);
  delete e;
}

void capsule_destructor(PyObject* capsule) {
  // Still named "dltensor": never consumed, so it is ours to free.
  if (PyCapsule_IsValid(capsule, "dltensor") == 0) return;
  auto* m = static_cast<dl::DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (m != nullptr && m->deleter != nullptr) m->deleter(m);
}

nb::object dlpack_capsule(nb::handle owner, void* data, int device, uint8_t code, uint8_t bits,
                          std::vector<int64_t> shape) {
  auto* e = new Exported();
  e->shape = std::move(shape);
  e->owner = owner.ptr();
  Py_XINCREF(e->owner);
  dl::DLTensor& t = e->managed.dl_tensor;
  t.data = data;
  t.device = {dl::kDLCUDA, device};
  t.ndim = static_cast<int32_t>(e->shape.size());
  t.dtype = {code, bits, 1};
  t.shape = e->shape.data();
  t.strides = nullptr;  // compact, row-major
  t.byte_offset = 0;
  e->managed.manager_ctx = e;
  e->managed.deleter = delete_exported;
  PyObject* cap = PyCapsule_New(&e->managed, "dltensor", capsule_destructor);
  if (cap == nullptr) {
    delete_exported(&e->managed);
    throw nb::python_error();
  }
  return nb::steal(cap);
}

constexpr uint8_t kDLInt = 0, kDLUInt = 1;

void* as_ptr(uint64_t address) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(address));
}

std::vector<std::vector<uint8_t>> cards_of(const std::vector<nb::bytes>& cards) {
  std::vector<std::vector<uint8_t>> out;
  for (const nb::bytes& b : cards) {
    const auto* p = static_cast<const uint8_t*>(b.data());
    out.emplace_back(p, p + b.size());
  }
  return out;
}

class PySymmetricMemory {
 public:
  PySymmetricMemory(uint64_t data_bytes, int rank, int size, int device, uint32_t signal_slots,
                    uint64_t wait_timeout_ns) {
    ferry::SymmetricOptions o;
    o.data_bytes = data_bytes;
    o.rank = rank;
    o.size = size;
    o.device = device;
    o.signal_slots = signal_slots;
    o.wait_timeout_ns = wait_timeout_ns;
    mem = unwrap(ferry::SymmetricMemory::create(o));
  }

  nb::bytes card() const {
    const auto c = mem->card();
    return nb::bytes(reinterpret_cast<const char*>(c.data()), c.size());
  }
  void join(const std::vector<nb::bytes>& cards) {
    auto decoded = cards_of(cards);
    nb::gil_scoped_release release;
    check(mem->join(decoded));
  }
  std::vector<uint64_t> peer_data() const { return addresses(false); }
  std::vector<uint64_t> peer_signals() const { return addresses(true); }
  void require_joined() const {
    if (!mem->joined()) raise(StatusCode::kInvalidArgument, "symmetric: join() the group first");
  }
  std::vector<uint64_t> addresses(bool signals) const {
    require_joined();
    std::vector<uint64_t> out;
    for (int r = 0; r < mem->size(); ++r) {
      out.push_back(signals ? reinterpret_cast<uint64_t>(mem->peer_signals(r))
                            : reinterpret_cast<uint64_t>(mem->peer_data(r)));
    }
    return out;
  }

  std::unique_ptr<ferry::SymmetricMemory> mem;
};

class PyMoeExchange {
 public:
  PyMoeExchange(nb::object memory, int max_tokens, int hidden, int top_k, int experts_per_rank,
                int sm_count)
      : memory_(std::move(memory)) {
    auto& m = nb::cast<PySymmetricMemory&>(memory_);
    ferry::MoeConfig c;
    c.max_tokens = max_tokens;
    c.hidden = hidden;
    c.top_k = top_k;
    c.experts_per_rank = experts_per_rank;
    c.sm_count = sm_count;
    moe = unwrap(ferry::MoeExchange::create(*m.mem, c));
    device = m.mem->device();
    members = m.mem->size();
  }
  std::unique_ptr<ferry::MoeExchange> moe;
  int device = 0;
  int members = 0;

 private:
  nb::object memory_;  // keeps the symmetric memory alive as long as this
};

nb::dict layout_dict(const ferry::MoeLayout& l) {
  nb::dict d;
  d["recv_x_offset"] = l.recv_x_offset;
  d["recv_src_offset"] = l.recv_src_offset;
  d["stage_offset"] = l.stage_offset;
  d["meta_offset"] = l.meta_offset;
  d["flags_offset"] = l.flags_offset;
  d["partial_offset"] = l.partial_offset;
  d["partial_flags_offset"] = l.partial_flags_offset;
  d["ll_offset"] = l.ll_offset;
  d["ll_partial_offset"] = l.ll_partial_offset;
  d["ll_tokens"] = l.ll_tokens;
  d["data_bytes"] = l.data_bytes;
  d["signal_slots"] = l.signal_slots;
  return d;
}

}  // namespace

void bind_symmetric(nb::module_& m) {
  nb::class_<PySymmetricMemory>(m, "_SymmetricMemory")
      .def(nb::init<uint64_t, int, int, int, uint32_t, uint64_t>(), "data_bytes"_a, "rank"_a,
           "size"_a, "device"_a, "signal_slots"_a, "wait_timeout_ns"_a)
      .def("card", &PySymmetricMemory::card)
      .def("join", &PySymmetricMemory::join, "cards"_a)
      .def_prop_ro("joined", [](const PySymmetricMemory& s) { return s.mem->joined(); })
      .def_prop_ro("rank", [](const PySymmetricMemory& s) { return s.mem->rank(); })
      .def_prop_ro("size", [](const PySymmetricMemory& s) { return s.mem->size(); })
      .def_prop_ro("device", [](const PySymmetricMemory& s) { return s.mem->device(); })
      .def_prop_ro("data_bytes", [](const PySymmetricMemory& s) { return s.mem->data_bytes(); })
      .def_prop_ro("signal_slots", [](const PySymmetricMemory& s) { return s.mem->signal_slots(); })
      .def_prop_ro("data_ptr",
                   [](const PySymmetricMemory& s) {
                     return reinterpret_cast<uint64_t>(s.mem->local_data());
                   })
      .def_prop_ro("signals_ptr",
                   [](const PySymmetricMemory& s) {
                     return reinterpret_cast<uint64_t>(s.mem->local_signals());
                   })
      .def("peer_data", &PySymmetricMemory::peer_data)
      .def("peer_signals", &PySymmetricMemory::peer_signals)
      .def_prop_ro("team_ptr",
                   [](const PySymmetricMemory& s) {
                     s.require_joined();
                     return reinterpret_cast<uint64_t>(s.mem->device_team_ptr());
                   })
      .def("_data_dlpack",
           [](nb::handle self) {
             auto& s = nb::cast<PySymmetricMemory&>(self);
             return dlpack_capsule(self, s.mem->local_data(), s.mem->device(), kDLUInt, 8,
                                   {static_cast<int64_t>(s.mem->data_bytes())});
           })
      .def("_signals_dlpack",
           [](nb::handle self) {
             auto& s = nb::cast<PySymmetricMemory&>(self);
             return dlpack_capsule(self, s.mem->local_signals(), s.mem->device(), kDLInt, 64,
                                   {static_cast<int64_t>(s.mem->signal_slots())});
           })
      .def(
          "_peer_pointers_dlpack",
          [](nb::handle self, bool signals) {
            auto& s = nb::cast<PySymmetricMemory&>(self);
            s.require_joined();
            const uint64_t* p = signals ? s.mem->device_peer_signals() : s.mem->device_peer_data();
            return dlpack_capsule(self, const_cast<uint64_t*>(p), s.mem->device(), kDLInt, 64,
                                  {static_cast<int64_t>(s.mem->size())});
          },
          "signals"_a)
      .def(
          "put",
          [](PySymmetricMemory& s, int peer, uint64_t dst_offset, uint64_t src, uint64_t nbytes,
             uint64_t stream) {
            check(s.mem->put(peer, dst_offset, as_ptr(src), nbytes, as_ptr(stream)));
          },
          "peer"_a, "dst_offset"_a, "src"_a, "nbytes"_a, "stream"_a)
      .def(
          "signal",
          [](PySymmetricMemory& s, int peer, uint32_t slot, uint64_t value, bool add,
             uint64_t stream) { check(s.mem->signal(peer, slot, value, add, as_ptr(stream))); },
          "peer"_a, "slot"_a, "value"_a, "add"_a, "stream"_a)
      .def(
          "wait",
          [](PySymmetricMemory& s, uint32_t slot, uint64_t at_least, uint64_t stream,
             uint64_t timeout_ns) {
            check(s.mem->wait(slot, at_least, as_ptr(stream), timeout_ns));
          },
          "slot"_a, "at_least"_a, "stream"_a, "timeout_ns"_a)
      .def(
          "barrier",
          [](PySymmetricMemory& s, uint64_t stream) { check(s.mem->barrier(as_ptr(stream))); },
          "stream"_a)
      .def(
          "read_signal",
          [](PySymmetricMemory& s, uint32_t slot) {
            nb::gil_scoped_release release;
            return s.mem->read_signal(slot);
          },
          "slot"_a)
      .def("check_device_error", [](PySymmetricMemory& s) { check(s.mem->device_error()); })
      .def("clear_device_error", [](PySymmetricMemory& s) { s.mem->clear_device_error(); });

  m.def(
      "_moe_layout",
      [](int max_tokens, int hidden, int top_k, int experts_per_rank, int members) {
        ferry::MoeConfig c;
        c.max_tokens = max_tokens;
        c.hidden = hidden;
        c.top_k = top_k;
        c.experts_per_rank = experts_per_rank;
        return layout_dict(unwrap(ferry::moe_layout(c, members)));
      },
      "max_tokens"_a, "hidden"_a, "top_k"_a, "experts_per_rank"_a, "members"_a);

  nb::class_<PyMoeExchange>(m, "_MoeExchange")
      .def(nb::init<nb::object, int, int, int, int, int>(), "memory"_a, "max_tokens"_a, "hidden"_a,
           "top_k"_a, "experts_per_rank"_a, "sm_count"_a)
      .def(
          "dispatch",
          [](PyMoeExchange& e, uint64_t x, uint64_t topk_idx, uint64_t weights, int num_tokens,
             uint64_t stream) {
            check(e.moe->dispatch(as_ptr(x), static_cast<const int64_t*>(as_ptr(topk_idx)),
                                  static_cast<const float*>(as_ptr(weights)), num_tokens,
                                  as_ptr(stream)));
          },
          "x"_a, "topk_idx"_a, "topk_weights"_a, "num_tokens"_a, "stream"_a)
      .def(
          "combine",
          [](PyMoeExchange& e, uint64_t y, uint64_t out, uint64_t stream) {
            check(e.moe->combine(as_ptr(y), as_ptr(out), as_ptr(stream)));
          },
          "y"_a, "out"_a, "stream"_a)
      .def_prop_ro("dispatched_tokens",
                   [](const PyMoeExchange& e) { return e.moe->dispatched_tokens(); })
      .def_prop_ro("layout", [](const PyMoeExchange& e) { return layout_dict(e.moe->layout()); })
      .def("_recv_count_dlpack", [](nb::handle self) {
        auto& e = nb::cast<PyMoeExchange&>(self);
        const auto& c = e.moe->config();
        return dlpack_capsule(self, e.moe->recv_count(), e.device, kDLInt, 32,
                              {c.experts_per_rank, e.members});
      });
}

}  // namespace ferry_py
