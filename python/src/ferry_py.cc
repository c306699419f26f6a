// ferry._ferry: nanobind bindings of the public C++ API (include/ferry).
//
// Objects: Engine, Region, Peer, Transfer, Descriptor. Everything that can block
// (engine creation, connect, posting, waits, deregistration) runs with the GIL
// released. Blocking waits are loops of short engine waits (kWaitSlice) that take
// the GIL back between slices to run PyErr_CheckSignals, so Ctrl-C raises
// KeyboardInterrupt and leaves the engine usable.
//
// Errors: a non-Ok ferry::Status becomes StatusError in C++, translated into the
// Python class registered for its code by ferry/_errors.py (_set_error_classes).
//
// This file holds the module, its enums and constants and the error
// translation; each class is bound by its own file (ferry_py_internal.h lists
// them): buffers_py.cc (Descriptor, memory of Python objects), region_py.cc,
// transfer_py.cc, peer_py.cc, batch_py.cc (column batches, PreparedTransfer),
// engine_py.cc, and beside them gpu_copy_py.cc, directory_py.cc,
// symmetric_py.cc.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "directory_py.h"
#include "ferry/engine.h"
#include "ferry/status.h"
#include "ferry/types.h"
#include "ferry_py_internal.h"
#include "gpu_copy_py.h"
#include "status_error.h"
#include "symmetric_py.h"

using namespace nb::literals;

namespace ferry_py {
namespace {

constexpr int kNumCodes = static_cast<int>(StatusCode::kInternal) + 1;

// ---------------------------------------------------------------------------
// errors

PyObject* g_error_classes[kNumCodes] = {};

void translate_status_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const StatusError& e) {
    const int c = static_cast<int>(e.code);
    PyObject* cls =
        (c >= 0 && c < kNumCodes && g_error_classes[c]) ? g_error_classes[c] : PyExc_RuntimeError;
    PyErr_SetString(cls, e.message.c_str());
  }
}

}  // namespace
}  // namespace ferry_py

// ---------------------------------------------------------------------------

NB_MODULE(_ferry, m) {
  using namespace ferry_py;
  m.doc() = "Ferry point-to-point transfer engine: native bindings (use the `ferry` package)";
  nb::set_leak_warnings(false);
  nb::register_exception_translator(&translate_status_error);

  nb::enum_<ferry::StatusCode>(m, "StatusCode", nb::is_arithmetic(),
                               "Status codes of the engine (ferry::StatusCode)")
      .value("Ok", StatusCode::kOk)
      .value("InProgress", StatusCode::kInProgress)
      .value("InvalidArgument", StatusCode::kInvalidArgument)
      .value("NotFound", StatusCode::kNotFound)
      .value("PermissionDenied", StatusCode::kPermissionDenied)
      .value("OutOfRange", StatusCode::kOutOfRange)
      .value("PeerDisconnected", StatusCode::kPeerDisconnected)
      .value("Timeout", StatusCode::kTimeout)
      .value("Cancelled", StatusCode::kCancelled)
      .value("NotSupported", StatusCode::kNotSupported)
      .value("Busy", StatusCode::kBusy)
      .value("ProtocolError", StatusCode::kProtocolError)
      .value("Internal", StatusCode::kInternal);

  nb::enum_<ferry::MemoryKind>(m, "MemoryKind", nb::is_arithmetic())
      .value("Host", ferry::MemoryKind::kHost)
      .value("Cuda", ferry::MemoryKind::kCuda);

  m.attr("ACCESS_READ") = int(ferry::kAccessRead);
  m.attr("ACCESS_WRITE") = int(ferry::kAccessWrite);
  m.attr("ACCESS_READ_WRITE") = int(ferry::kAccessReadWrite);
  m.attr("DESCRIPTOR_SIZE") = ferry::RemoteDescriptor::kEncodedSize;
  bind_gpu_copy(m);
  bind_directory(m);
  bind_symmetric(m);

  m.def("_set_error_classes", [](nb::dict classes) {
    for (auto [k, v] : classes) {
      const int c = nb::cast<int>(k);
      if (c < 0 || c >= kNumCodes) continue;
      Py_XDECREF(g_error_classes[c]);
      g_error_classes[c] = v.ptr();
      Py_INCREF(v.ptr());
    }
  });
  m.def(
      "_raise_status",
      [](int code, const std::string& msg) { raise(static_cast<StatusCode>(code), msg); },
      "Raise the exception of a status code (testing aid).");
  m.def("version", [] { return std::string(ferry::version()); });
  m.def("protocol_version", [] { return ferry::protocol_version(); });
  bind_buffers(m);
  bind_region(m);
  bind_transfer(m);
  bind_prepared(m);
  bind_peer(m);
  bind_engine(m);
}
