// The column forms of Peer's transfers: write_batch / read_batch (numpy
// arrays, lists or one int per column, built into iov arrays in one C++ loop)
// and the batches prepared once and posted many times (ferry.PreparedTransfer).
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ferry_py_internal.h"

using namespace nb::literals;

namespace ferry_py {
namespace {

// ---------------------------------------------------------------------------
// columns: an ndarray, a list of ints or one int broadcast to every entry

struct Col {
  const uint8_t* data = nullptr;
  int64_t stride = 0;  // bytes
  int width = 8;       // 4 or 8
  size_t n = 0;
  bool scalar = false;
  bool present = false;
  uint64_t value = 0;
  std::vector<uint64_t> owned;
  nb::object keep;

  inline uint64_t at(size_t i) const {
    if (scalar) return value;
    const uint8_t* p = data + static_cast<int64_t>(i) * stride;
    if (width == 8) {
      uint64_t v;
      std::memcpy(&v, p, 8);
      return v;
    }
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
};

template <typename T>
bool try_array(nb::handle h, Col& c) {
  using Arr = nb::ndarray<const T, nb::ndim<1>, nb::device::cpu>;
  Arr a;
  if (!nb::try_cast<Arr>(h, a, false)) return false;
  c.data = reinterpret_cast<const uint8_t*>(a.data());
  c.stride = a.stride(0) * int64_t(sizeof(T));
  c.width = sizeof(T);
  c.n = a.shape(0);
  c.keep = nb::borrow(h);
  c.present = true;
  return true;
}

Col get_col(nb::handle h, const char* name) {
  Col c;
  if (h.is_none()) return c;
  if (PyLong_Check(h.ptr())) {
    c.scalar = true;
    c.present = true;
    c.value = as_u64(h, name);
    return c;
  }
  // Lists first: a failed ndarray cast of a list costs about 0.5 us (each of the
  // three below looks for the buffer protocol and __dlpack__), which was most of
  // what ferry.compat.uccl's one-block calls paid on top of Peer.write_async.
  if (PyList_Check(h.ptr()) || PyTuple_Check(h.ptr())) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(h.ptr());
    PyObject** items = PySequence_Fast_ITEMS(h.ptr());
    c.owned.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* it = items[i];
      unsigned long long v =
          PyLong_Check(it) ? PyLong_AsUnsignedLongLong(it) : as_u64(nb::handle(it), name);
      if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        PyErr_Clear();
        raise(StatusCode::kInvalidArgument,
              std::string(name) + "[" + std::to_string(i) + "] must be a non-negative int");
      }
      c.owned[size_t(i)] = v;
    }
    c.data = reinterpret_cast<const uint8_t*>(c.owned.data());
    c.stride = 8;
    c.width = 8;
    c.n = size_t(n);
    c.present = true;
    return c;
  }
  if (try_array<uint64_t>(h, c) || try_array<int64_t>(h, c) || try_array<uint32_t>(h, c)) return c;
  // Anything else numpy can turn into integers.
  nb::object np = nb::module_::import_("numpy");
  nb::object arr = np.attr("ascontiguousarray")(h, "dtype"_a = np.attr("uint64"));
  if (nb::cast<int>(arr.attr("ndim")) != 1)
    raise(StatusCode::kInvalidArgument, std::string(name) + " must be one-dimensional");
  if (!try_array<uint64_t>(arr, c))
    raise(StatusCode::kInvalidArgument, std::string(name) + ": cannot read as uint64 values");
  return c;
}

thread_local Scratch t_scratch;

}  // namespace

// The numpy fast path: one loop in C++ with the GIL released.
nb::object PyPeer::batch(Op op, PyRegion* region, nb::handle local_offsets, nb::handle descriptors,
                         nb::handle desc_index, nb::handle remote_offsets, nb::handle lengths,
                         nb::handle notify, std::optional<double> timeout, bool async_) {
  t_call_start = Clock::now();
  (void)box->get();
  Holder holder;
  Scratch& s = t_scratch;
  const uint64_t total = build_batch(op, region, local_offsets, descriptors, desc_index,
                                     remote_offsets, lengths, s, holder);
  return submit(op, std::span<const ferry::LocalIov>(s.local),
                std::span<const ferry::RemoteIov>(s.remote), notify, timeout, async_,
                std::move(holder), total);
}

// Checks the columns and builds the iov arrays of a batch into `s` (the
// remote iovs point into s.descs); what must stay alive goes to `holder`.
// Returns the bytes in all.
uint64_t PyPeer::build_batch(Op op, PyRegion* region, nb::handle local_offsets,
                             nb::handle descriptors, nb::handle desc_index,
                             nb::handle remote_offsets, nb::handle lengths, Scratch& s,
                             Holder& holder) {
  char* base = nullptr;
  uint64_t rlen = 0;
  if (region) {
    region->require_registered();
    if (region->box != box)
      raise(StatusCode::kInvalidArgument,
            "region " + std::to_string(region->mr.id) + " belongs to another engine");
    if (op == Op::kRead && region->buf.readonly)
      raise(StatusCode::kPermissionDenied,
            "region " + std::to_string(region->mr.id) + " is read-only and cannot receive a read");
    base = static_cast<char*>(region->mr.address);
    rlen = region->mr.length;
    holder.objs.push_back(nb::borrow(nb::find(region)));
  }
  Col lo = get_col(local_offsets, region ? "local_offsets" : "local_addresses");
  Col di = get_col(desc_index, "desc_index");
  Col ro = get_col(remote_offsets, "remote_offsets");
  Col ln = get_col(lengths, "lengths");
  if (!lo.present) raise(StatusCode::kInvalidArgument, "local offsets are required");
  if (!ln.present) raise(StatusCode::kInvalidArgument, "lengths are required");
  size_t n = 0;
  bool have_n = false;
  for (const Col* c : {&lo, &di, &ro, &ln}) {
    if (!c->present || c->scalar) continue;
    if (have_n && c->n != n)
      raise(StatusCode::kInvalidArgument, "batch columns differ in length (" + std::to_string(n) +
                                              " vs " + std::to_string(c->n) + ")");
    n = c->n;
    have_n = true;
  }
  if (!have_n) n = 1;
  if (n == 0) raise(StatusCode::kInvalidArgument, "a transfer needs at least one iov");

  s.descs.clear();
  if (PyBytes_Check(descriptors.ptr()) || PyByteArray_Check(descriptors.ptr()) ||
      PyMemoryView_Check(descriptors.ptr()) ||
      nb::isinstance<ferry::RemoteDescriptor>(descriptors)) {
    s.descs.push_back(parse_descriptor(descriptors));
  } else {
    nb::object seq = nb::steal(
        PySequence_Fast(descriptors.ptr(), "descriptors must be bytes or a list of bytes"));
    if (!seq.is_valid()) throw nb::python_error();
    const Py_ssize_t nd = PySequence_Fast_GET_SIZE(seq.ptr());
    PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
    s.descs.reserve(size_t(nd));
    for (Py_ssize_t i = 0; i < nd; ++i) s.descs.push_back(parse_descriptor(items[i]));
  }
  const size_t nd = s.descs.size();
  if (nd == 0) raise(StatusCode::kInvalidArgument, "no descriptors given");
  if (!di.present && nd != 1 && nd != n)
    raise(StatusCode::kInvalidArgument,
          std::to_string(nd) + " descriptors for " + std::to_string(n) +
              " iovs: pass desc_index, one descriptor, or one per iov");
  const bool per_iov_desc = !di.present && nd == n && nd != 1;

  // Build the iov arrays (columns are kept alive above); with the GIL
  // released where that pays for its release and retake.
  enum Err { kNone, kLocalRange, kDescIndex };
  Err err = kNone;
  size_t bad = 0;
  uint64_t total = 0;
  auto build = [&] {
    s.local.resize(n);
    s.remote.resize(n);
    ferry::LocalIov* L = s.local.data();
    ferry::RemoteIov* R = s.remote.data();
    const ferry::RemoteDescriptor* D = s.descs.data();
    for (size_t i = 0; i < n; ++i) {
      const uint64_t len = ln.at(i);
      const uint64_t off = lo.at(i);
      if (base) {
        if (off > rlen || len > rlen - off) {
          err = kLocalRange;
          bad = i;
          break;
        }
        L[i] = {base + off, len};
      } else {
        L[i] = {reinterpret_cast<void*>(static_cast<uintptr_t>(off)), len};
      }
      size_t d = per_iov_desc ? i : (di.present ? size_t(di.at(i)) : 0);
      if (d >= nd) {
        err = kDescIndex;
        bad = i;
        break;
      }
      R[i] = {D + d, ro.present ? ro.at(i) : 0, len};
      total += len;
    }
    return 0;
  };
  if (n > 256) {
    without_gil(build);
  } else {
    build();
  }
  if (err == kLocalRange)
    raise(StatusCode::kOutOfRange,
          "iov " + std::to_string(bad) + ": local [" + std::to_string(lo.at(bad)) + ", +" +
              std::to_string(ln.at(bad)) + ") exceeds region " + std::to_string(region->mr.id) +
              " (" + std::to_string(rlen) + " bytes)");
  if (err == kDescIndex)
    raise(StatusCode::kInvalidArgument, "iov " + std::to_string(bad) + ": desc_index " +
                                            std::to_string(di.at(bad)) + " but only " +
                                            std::to_string(nd) + " descriptors");
  if (!region) {
    // Raw addresses (compat path): keep the columns' owners alive for async.
    if (lo.keep.is_valid()) holder.objs.push_back(lo.keep);
  }
  return total;
}

namespace {

// A batch checked and built once, posted many times (Peer.prepare_write /
// prepare_read): a repeated pattern -- a KV-cache layer's pages, a latency
// probe -- pays the column checks and descriptor parsing once, as NIXL's
// prepared transfer handles do. Each post is checked again where it can
// have changed: the local region still registered here, and by the target
// (regions, keys, bounds) as always.
struct PyPrepared {
  PyPeer peer;
  Op op = Op::kWrite;
  PyRegion* region = nullptr;  // kept alive by holder.objs
  Holder holder;
  Scratch iovs;
  uint64_t total = 0;

  PyPrepared() = default;
  PyPrepared(const PyPrepared&) = delete;
  PyPrepared& operator=(const PyPrepared&) = delete;

  nb::object post(nb::handle notify, std::optional<double> timeout, bool async_) {
    t_call_start = Clock::now();
    if (region) region->require_registered();
    Holder h;
    h.objs = holder.objs;
    return peer.submit(op, std::span<const ferry::LocalIov>(iovs.local),
                       std::span<const ferry::RemoteIov>(iovs.remote), notify, timeout, async_,
                       std::move(h), total);
  }

  std::string repr() const {
    return "<ferry.PreparedTransfer " + std::string(op_name(op)) +
           " iovs=" + std::to_string(iovs.local.size()) + " bytes=" + std::to_string(total) + ">";
  }
};

}  // namespace

// region == nullptr: the local column holds addresses, each inside memory registered
// with this engine (the engine finds the region per iov at every post), so one
// prepared transfer may span several local registrations -- NIXL's requests do,
// e.g. a KV cache's layers registered one by one (ferry.compat.nixl).
nb::object prepare(PyPeer& p, Op op, PyRegion* region, nb::handle lo, nb::handle descs,
                   nb::handle di, nb::handle ro, nb::handle ln) {
  (void)p.box->get();
  auto x = std::make_unique<PyPrepared>();
  x->peer = p;
  x->op = op;
  x->region = region;
  x->total = p.build_batch(op, region, lo, descs, di, ro, ln, x->iovs, x->holder);
  return nb::cast(x.release(), nb::rv_policy::take_ownership);
}

void bind_prepared(nb::module_& m) {
  nb::class_<PyPrepared>(m, "PreparedTransfer",
                         "A batch built once by Peer.prepare_write / prepare_read.")
      .def_prop_ro("op", [](const PyPrepared& x) { return op_name(x.op); })
      .def_prop_ro("iovs", [](const PyPrepared& x) { return x.iovs.local.size(); })
      .def_prop_ro("nbytes", [](const PyPrepared& x) { return x.total; })
      .def(
          "post",
          [](PyPrepared& x, nb::handle notify) { return x.post(notify, std::nullopt, true); },
          "notify"_a = nb::none(),
          "Post it once more; returns a Transfer. notify: as for Peer.write (writes only).")
      .def(
          "run",
          [](PyPrepared& x, std::optional<double> timeout, nb::handle notify) {
            x.post(notify, timeout, false);
          },
          "timeout"_a = nb::none(), "notify"_a = nb::none(),
          "Post it once more and block until it finished (timeout in seconds; on expiry it is "
          "cancelled and ferry.Timeout raised).")
      .def("__repr__", &PyPrepared::repr);
}

}  // namespace ferry_py
