// ferry.Region: registered memory, kept alive until deregistered; advertise()
// hands out descriptors of it.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdio>
#include <string>

#include "ferry_py_internal.h"

using namespace nb::literals;

namespace ferry_py {

PyRegion::~PyRegion() {
  if (registered) {
    if (auto eng = box->try_get()) {
      const uint64_t id = mr.id;
      (void)without_gil([&] { return eng->deregister_memory(id); });
    }
    registered = false;
  }
  box->regions.erase(this);
  // buf releases the Python buffer (the GIL is held in dealloc).
}

void PyRegion::require_registered() const {
  if (!registered)
    raise(StatusCode::kNotFound, "region " + std::to_string(mr.id) + " was deregistered");
}

void PyRegion::deregister() {
  if (!registered) return;
  registered = false;
  box->regions.erase(this);
  if (auto eng = box->try_get()) {
    const uint64_t id = mr.id;
    ferry::Status st = without_gil([&] { return eng->deregister_memory(id); });
    buf.release();
    check(st);
  } else {
    buf.release();
  }
}

nb::bytes PyRegion::advertise(uint64_t offset, std::optional<uint64_t> length, nb::handle access) {
  require_registered();
  const uint8_t acc = parse_access(access, buf.readonly);
  if (buf.readonly && (acc & ferry::kAccessWrite))
    raise(StatusCode::kPermissionDenied, "region " + std::to_string(mr.id) +
                                             " was registered from a read-only " + buf.source +
                                             " object; it can only be advertised with access='r'");
  if (offset > mr.length)
    raise(StatusCode::kOutOfRange, "advertise offset " + std::to_string(offset) +
                                       " is past the end of region " + std::to_string(mr.id) +
                                       " (" + std::to_string(mr.length) + " bytes)");
  auto eng = box->get();
  auto d = unwrap(eng->advertise(mr.id, offset, length.value_or(UINT64_MAX), acc));
  return to_py_bytes(d.to_bytes());
}

std::string PyRegion::repr() const {
  char addr[32];
  std::snprintf(addr, sizeof addr, "0x%llx",
                static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(mr.address)));
  return "<ferry.Region id=" + std::to_string(mr.id) + " address=" + addr +
         " length=" + std::to_string(mr.length) +
         " kind=" + std::string(ferry::memory_kind_name(mr.kind)) +
         (buf.readonly ? " read-only" : "") + (registered ? "" : " deregistered") + ">";
}

void bind_region(nb::module_& m) {
  nb::class_<PyRegion>(m, "Region", "Registered memory. Keeps the buffer alive until deregistered.")
      .def_prop_ro("id", [](const PyRegion& r) { return r.mr.id; })
      .def_prop_ro("address",
                   [](const PyRegion& r) { return reinterpret_cast<uintptr_t>(r.mr.address); })
      .def_prop_ro("length", [](const PyRegion& r) { return r.mr.length; })
      .def_prop_ro("nbytes", [](const PyRegion& r) { return r.mr.length; })
      .def_prop_ro(
          "kind", [](const PyRegion& r) { return std::string(ferry::memory_kind_name(r.mr.kind)); })
      .def_prop_ro("device", [](const PyRegion& r) { return r.mr.device; })
      .def_prop_ro("readonly", [](const PyRegion& r) { return r.buf.readonly; })
      .def_prop_ro("registered", [](const PyRegion& r) { return r.registered; })
      .def_prop_ro("source", [](const PyRegion& r) { return std::string(r.buf.source); })
      .def_prop_ro(
          "obj",
          [](const PyRegion& r) -> nb::object {
            return r.buf.keep.is_valid()              ? r.buf.keep
                   : r.buf.has_view && r.buf.view.obj ? nb::borrow(r.buf.view.obj)
                                                      : nb::none();
          },
          "The object whose memory is registered (None for register_ptr).")
      .def("advertise", &PyRegion::advertise, "offset"_a = 0, "length"_a = nb::none(),
           "access"_a = nb::none(),
           "64-byte descriptor granting a peer `access` ('r', 'w', 'rw'; default 'rw', or 'r' "
           "for read-only memory) to [offset, offset+length) of this region.")
      .def("deregister", &PyRegion::deregister,
           "Revoke the region at once and release the buffer. Idempotent.")
      .def("__len__", [](const PyRegion& r) { return r.mr.length; })
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
      .def("__exit__", [](PyRegion& r, nb::args) { r.deregister(); })
      .def("__repr__", &PyRegion::repr);
}

}  // namespace ferry_py
