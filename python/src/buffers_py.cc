// Python objects as memory: buffers, DLPack producers and tensor-like objects
// (acquire), ints and access flags, and the 64-byte remote descriptor
// (ferry.Descriptor).
#include <nanobind/stl/string.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "dlpack_min.h"
#include "ferry_py_internal.h"

using namespace nb::literals;

namespace ferry_py {

std::string tname(nb::handle h) {
  return nb::type_name(h.type()).c_str();
}

uint64_t as_u64(nb::handle h, const char* what) {
  if (PyLong_CheckExact(h.ptr())) {
    const unsigned long long v = PyLong_AsUnsignedLongLong(h.ptr());
    if (!(v == static_cast<unsigned long long>(-1) && PyErr_Occurred())) return v;
    PyErr_Clear();
  }
  if (!PyLong_Check(h.ptr())) {
    nb::object i = nb::steal(PyNumber_Index(h.ptr()));
    if (!i.is_valid()) {
      PyErr_Clear();
      raise(StatusCode::kInvalidArgument, std::string(what) + " must be an int, got " + tname(h));
    }
    return as_u64(i, what);
  }
  const unsigned long long v = PyLong_AsUnsignedLongLong(h.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    raise(
        StatusCode::kInvalidArgument,
        std::string(what) + " must be a non-negative int below 2**64, got " + nb::repr(h).c_str());
  }
  return v;
}

namespace {

BufferRef from_dlpack(nb::handle obj) {
  using namespace dlpack;
  if (nb::hasattr(obj, "__dlpack_device__")) {
    nb::object dev = obj.attr("__dlpack_device__")();
    const int dt = nb::cast<int>(dev[0]);
    if (dt != kDLCPU && dt != kDLCUDA && dt != kDLCUDAHost && dt != kDLCUDAManaged)
      raise(StatusCode::kNotSupported,
            "DLPack device type " + std::to_string(dt) +
                " is not supported (host, CUDA, CUDA host and CUDA managed memory are)");
  }
  nb::object cap = obj.attr("__dlpack__")();
  PyObject* c = cap.ptr();
  if (!PyCapsule_CheckExact(c))
    raise(StatusCode::kInvalidArgument, "__dlpack__() did not return a capsule");
  const char* name = PyCapsule_GetName(c);
  DLTensor* t = nullptr;
  bool ro = false;
  if (name && std::strcmp(name, "dltensor") == 0) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, name));
    if (!m) throw nb::python_error();
    t = &m->dl_tensor;
  } else if (name && std::strcmp(name, "dltensor_versioned") == 0) {
    auto* m = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(c, name));
    if (!m) throw nb::python_error();
    if (m->version.major != 1)
      raise(StatusCode::kNotSupported,
            "DLPack major version " + std::to_string(m->version.major) + " is not supported");
    t = &m->dl_tensor;
    ro = (m->flags & kFlagReadOnly) != 0;
  } else {
    raise(StatusCode::kInvalidArgument, std::string("__dlpack__() returned a capsule named '") +
                                            (name ? name : "") + "' (already consumed?)");
  }
  const uint64_t elem_bits = uint64_t(t->dtype.bits) * std::max<uint16_t>(t->dtype.lanes, 1);
  if (elem_bits % 8 != 0)
    raise(StatusCode::kNotSupported, "DLPack tensors of sub-byte elements are not supported");
  uint64_t elems = 1;
  for (int d = 0; d < t->ndim; ++d) {
    if (t->shape[d] < 0)
      raise(StatusCode::kInvalidArgument, "DLPack tensor with a negative dimension");
    elems *= uint64_t(t->shape[d]);
  }
  if (t->strides && elems > 1) {
    bool c_ok = true, f_ok = true;
    int64_t expect = 1;
    for (int d = t->ndim - 1; d >= 0; --d) {
      if (t->shape[d] != 1 && t->strides[d] != expect) c_ok = false;
      expect *= t->shape[d];
    }
    expect = 1;
    for (int d = 0; d < t->ndim; ++d) {
      if (t->shape[d] != 1 && t->strides[d] != expect) f_ok = false;
      expect *= t->shape[d];
    }
    if (!c_ok && !f_ok)
      raise(StatusCode::kInvalidArgument,
            "DLPack tensor is not contiguous; register a contiguous tensor (or its base)");
  }
  BufferRef b;
  b.ptr = static_cast<char*>(t->data) + t->byte_offset;
  b.size = elems * (elem_bits / 8);
  b.readonly = ro;
  b.source = "dlpack";
  b.keep = std::move(cap);  // the capsule owns the tensor until it is collected
  return b;
}

}  // namespace

BufferRef acquire(nb::handle obj, bool need_writable) {
  PyObject* o = obj.ptr();
  if (PyObject_CheckBuffer(o)) {
    BufferRef b;
    b.source = "buffer";
    if (PyObject_GetBuffer(o, &b.view, PyBUF_WRITABLE | PyBUF_ANY_CONTIGUOUS) == 0) {
      b.has_view = true;
    } else {
      PyErr_Clear();
      if (PyObject_GetBuffer(o, &b.view, PyBUF_ANY_CONTIGUOUS) != 0) {
        nb::python_error e;
        raise(StatusCode::kInvalidArgument, "cannot use the memory of " + tname(obj) + ": " +
                                                e.what() + " (a contiguous buffer is required)");
      }
      b.has_view = true;
      b.readonly = true;
      if (need_writable)
        raise(StatusCode::kPermissionDenied,
              "the " + tname(obj) + " buffer is read-only, but it must receive data");
    }
    b.ptr = b.view.buf;
    b.size = static_cast<uint64_t>(b.view.len);
    return b;
  }
  if (nb::hasattr(obj, "data_ptr") && nb::hasattr(obj, "nbytes")) {
    if (nb::hasattr(obj, "is_contiguous")) {
      if (!nb::cast<bool>(obj.attr("is_contiguous")()))
        raise(StatusCode::kInvalidArgument,
              "the " + tname(obj) + " is not contiguous; call .contiguous() first");
    }
    BufferRef b;
    b.source = "data_ptr";
    b.ptr = reinterpret_cast<void*>(
        static_cast<uintptr_t>(as_u64(obj.attr("data_ptr")(), "data_ptr()")));
    nb::object nbytes = obj.attr("nbytes");
    if (PyCallable_Check(nbytes.ptr())) nbytes = nbytes();
    b.size = as_u64(nbytes, "nbytes");
    b.keep = nb::borrow(obj);
    return b;
  }
  if (nb::hasattr(obj, "__dlpack__")) {
    BufferRef b = from_dlpack(obj);
    if (need_writable && b.readonly)
      raise(StatusCode::kPermissionDenied,
            "the DLPack tensor is read-only, but it must receive data");
    return b;
  }
  throw nb::type_error(
      ("cannot use an object of type " + tname(obj) +
       " as memory: expected a buffer-protocol object (numpy array, bytearray, memoryview), "
       "a DLPack producer (__dlpack__) or a tensor-like object with data_ptr() and nbytes")
          .c_str());
}

uint8_t parse_access(nb::handle h, bool readonly_default) {
  if (h.is_none()) return readonly_default ? ferry::kAccessRead : ferry::kAccessReadWrite;
  if (PyUnicode_Check(h.ptr())) {
    std::string s = nb::cast<std::string>(h);
    if (s == "r" || s == "read") return ferry::kAccessRead;
    if (s == "w" || s == "write") return ferry::kAccessWrite;
    if (s == "rw" || s == "wr" || s == "readwrite" || s == "read-write")
      return ferry::kAccessReadWrite;
    raise(StatusCode::kInvalidArgument,
          "access must be 'r', 'w' or 'rw' (or ferry.ACCESS_* flags), got '" + s + "'");
  }
  const uint64_t v = as_u64(h, "access");
  if (v < 1 || v > 3)
    raise(StatusCode::kInvalidArgument, "access flags must be 1 (read), 2 (write) or 3");
  return static_cast<uint8_t>(v);
}

nb::bytes to_py_bytes(const ferry::Bytes& b) {
  return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
}

ferry::RemoteDescriptor parse_descriptor(nb::handle h) {
  ferry::RemoteDescriptor d;
  if (nb::try_cast<ferry::RemoteDescriptor>(h, d, false)) return d;
  ByteSpan s(h, "a remote descriptor");
  auto r = ferry::RemoteDescriptor::from_bytes(s.span);
  if (!r.ok()) raise(r.status().code(), "invalid remote descriptor: " + r.status().message());
  return std::move(r).value();
}

void bind_buffers(nb::module_& m) {
  m.def(
      "_address_of",
      [](nb::handle obj) {
        BufferRef b = acquire(obj, false);
        return nb::make_tuple(reinterpret_cast<uintptr_t>(b.ptr), b.size, b.readonly, b.source);
      },
      "obj"_a, "(address, nbytes, readonly, source) of an object's memory, as register() sees it.");

  nb::class_<ferry::RemoteDescriptor>(
      m, "Descriptor",
      "A decoded 64-byte remote descriptor (what Region.advertise() returns as bytes).")
      .def(nb::init<>())
      .def_rw("engine_id", &ferry::RemoteDescriptor::engine_id)
      .def_rw("region_id", &ferry::RemoteDescriptor::region_id)
      .def_rw("address", &ferry::RemoteDescriptor::address)
      .def_rw("region_offset", &ferry::RemoteDescriptor::region_offset)
      .def_rw("length", &ferry::RemoteDescriptor::length)
      .def_rw("key", &ferry::RemoteDescriptor::key)
      .def_rw("access", &ferry::RemoteDescriptor::access)
      .def_rw("kind", &ferry::RemoteDescriptor::kind)
      .def_rw("device", &ferry::RemoteDescriptor::device)
      .def_static(
          "from_bytes", [](nb::handle b) { return parse_descriptor(b); }, "data"_a)
      .def("to_bytes", [](const ferry::RemoteDescriptor& d) { return to_py_bytes(d.to_bytes()); })
      .def("__bytes__", [](const ferry::RemoteDescriptor& d) { return to_py_bytes(d.to_bytes()); })
      .def("__eq__", [](const ferry::RemoteDescriptor& a,
                        const ferry::RemoteDescriptor& b) { return a.to_bytes() == b.to_bytes(); })
      .def("__repr__", [](const ferry::RemoteDescriptor& d) {
        char buf[256];
        std::snprintf(buf, sizeof buf,
                      "<ferry.Descriptor engine=0x%016llx region=%llu offset=%llu length=%llu "
                      "access=%s kind=%s>",
                      (unsigned long long)d.engine_id, (unsigned long long)d.region_id,
                      (unsigned long long)d.region_offset, (unsigned long long)d.length,
                      ferry::access_name(d.access).c_str(),
                      std::string(ferry::memory_kind_name(d.kind)).c_str());
        return std::string(buf);
      });
}

}  // namespace ferry_py
