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
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "dlpack_min.h"
#include "ferry/engine.h"
#include "ferry/status.h"
#include "ferry/types.h"
#include "directory_py.h"
#include "gpu_copy_py.h"
#include "symmetric_py.h"
#include "status_error.h"
#include "wait_slices.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace ferry_py {
namespace {

using ferry::StatusCode;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

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

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Runs f with the GIL released unless the interpreter is shutting down (then
// threads must not drop and retake it).
template <typename F>
auto without_gil(F&& f) {
  if (interpreter_finalizing()) return f();
  nb::gil_scoped_release release;
  return f();
}

std::string tname(nb::handle h) {
  return nb::type_name(h.type()).c_str();
}

// ---------------------------------------------------------------------------
// buffers: anything whose memory we can name by (pointer, size)

struct BufferRef {
  void* ptr = nullptr;
  uint64_t size = 0;
  bool readonly = false;
  const char* source = "pointer";  // "buffer", "dlpack", "data_ptr", "pointer"
  Py_buffer view{};
  bool has_view = false;
  nb::object keep;

  BufferRef() = default;
  BufferRef(const BufferRef&) = delete;
  BufferRef& operator=(const BufferRef&) = delete;
  BufferRef(BufferRef&& o) noexcept { *this = std::move(o); }
  BufferRef& operator=(BufferRef&& o) noexcept {
    if (this != &o) {
      release();
      ptr = o.ptr;
      size = o.size;
      readonly = o.readonly;
      source = o.source;
      view = o.view;
      has_view = o.has_view;
      keep = std::move(o.keep);
      o.has_view = false;
      o.ptr = nullptr;
      o.size = 0;
    }
    return *this;
  }
  ~BufferRef() { release(); }
  // Requires the GIL.
  void release() {
    if (has_view) {
      PyBuffer_Release(&view);
      has_view = false;
    }
    keep.reset();
  }
  // Drops ownership without touching Python (memory that may still be in use).
  void leak() {
    has_view = false;
    keep.release();
  }
};

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

// Exposes obj's memory. writable: fail on read-only memory (else mark it).
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

// Bytes of a bytes-like object; the view is valid while `h` is alive and the
// caller holds the GIL (or a reference that keeps it unchanged).
struct ByteSpan {
  Py_buffer view{};
  bool has_view = false;
  ferry::ByteView span;
  explicit ByteSpan(nb::handle h, const char* what) {
    if (PyBytes_CheckExact(h.ptr())) {
      span = {reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(h.ptr())),
              static_cast<size_t>(PyBytes_GET_SIZE(h.ptr()))};
      return;
    }
    if (PyObject_GetBuffer(h.ptr(), &view, PyBUF_SIMPLE) != 0) {
      PyErr_Clear();
      raise(StatusCode::kInvalidArgument,
            std::string(what) + " must be bytes-like, got " + tname(h));
    }
    has_view = true;
    span = {static_cast<const uint8_t*>(view.buf), static_cast<size_t>(view.len)};
  }
  ByteSpan(const ByteSpan&) = delete;
  ~ByteSpan() {
    if (has_view) PyBuffer_Release(&view);
  }
};

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

// Whatever must stay alive until a transfer finishes.
struct Holder {
  std::vector<BufferRef> bufs;
  std::vector<nb::object> objs;
  ferry::Bytes notification;
  void clear() {
    bufs.clear();
    objs.clear();
  }
  void leak() {
    for (auto& b : bufs) b.leak();
    for (auto& o : objs) o.release();
    bufs.clear();
    objs.clear();
  }
};

// ---------------------------------------------------------------------------
// engine box: shared by every object that talks to one engine

struct PyRegion;

struct EngineBox {
  // Declared first so that it is destroyed last, after the engine.
  std::vector<std::pair<ferry::TransferId, Holder>> orphans;
  std::mutex mu;
  std::shared_ptr<ferry::Engine> engine;  // null once closed
  std::weak_ptr<ferry::Engine> weak;      // expired once really destroyed
  std::unordered_set<PyRegion*> regions;  // live registered regions (GIL-protected)
  uint64_t id = 0;

  std::shared_ptr<ferry::Engine> get() {
    std::lock_guard<std::mutex> lock(mu);
    if (!engine) raise(StatusCode::kInvalidArgument, "the engine is closed");
    return engine;
  }
  std::shared_ptr<ferry::Engine> try_get() {
    std::lock_guard<std::mutex> lock(mu);
    return engine;
  }

  // `orphans`: transfers nobody waits for any more (interrupted or dropped while
  // running); their memory stays referenced until the engine reports them
  // finished. GIL-protected.
  void adopt(ferry::TransferId tid, Holder&& h) { orphans.emplace_back(tid, std::move(h)); }

  // Drops orphans that have finished (GIL held on entry; one non-blocking test
  // each with the GIL released, while other threads may adopt more).
  void reap(ferry::Engine& eng) {
    if (orphans.empty()) return;
    std::vector<std::pair<ferry::TransferId, Holder>> mine;
    mine.swap(orphans);
    std::vector<char> done(mine.size(), 0);
    without_gil([&] {
      for (size_t i = 0; i < mine.size(); ++i)
        done[i] = eng.test(mine[i].first).code() != StatusCode::kInProgress;
      return 0;
    });
    for (size_t i = 0; i < mine.size(); ++i)
      if (!done[i]) orphans.push_back(std::move(mine[i]));
    // `mine` releases the finished ones' memory here, with the GIL held.
  }
};
using BoxPtr = std::shared_ptr<EngineBox>;

// ---------------------------------------------------------------------------
// Region

struct PyRegion {
  BoxPtr box;
  ferry::MemoryRegion mr;
  BufferRef buf;
  bool registered = false;

  ~PyRegion() {
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

  void require_registered() const {
    if (!registered)
      raise(StatusCode::kNotFound, "region " + std::to_string(mr.id) + " was deregistered");
  }

  void deregister() {
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

  nb::bytes advertise(uint64_t offset, std::optional<uint64_t> length, nb::handle access) {
    require_registered();
    const uint8_t acc = parse_access(access, buf.readonly);
    if (buf.readonly && (acc & ferry::kAccessWrite))
      raise(StatusCode::kPermissionDenied,
            "region " + std::to_string(mr.id) + " was registered from a read-only " + buf.source +
                " object; it can only be advertised with access='r'");
    if (offset > mr.length)
      raise(StatusCode::kOutOfRange, "advertise offset " + std::to_string(offset) +
                                         " is past the end of region " + std::to_string(mr.id) +
                                         " (" + std::to_string(mr.length) + " bytes)");
    auto eng = box->get();
    auto d = unwrap(eng->advertise(mr.id, offset, length.value_or(UINT64_MAX), acc));
    return to_py_bytes(d.to_bytes());
  }

  std::string repr() const {
    char addr[32];
    std::snprintf(addr, sizeof addr, "0x%llx",
                  static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(mr.address)));
    return "<ferry.Region id=" + std::to_string(mr.id) + " address=" + addr +
           " length=" + std::to_string(mr.length) +
           " kind=" + std::string(ferry::memory_kind_name(mr.kind)) +
           (buf.readonly ? " read-only" : "") + (registered ? "" : " deregistered") + ">";
  }
};

// ---------------------------------------------------------------------------
// Transfer

// Waits once for up to `slice`: the final status, or InProgress. Resolves the
// ambiguity of Engine::wait answering Timeout (still running, or a final Timeout).
ferry::Status wait_slice(ferry::Engine& eng, ferry::TransferId tid, milliseconds slice) {
  ferry::Status st = eng.wait(tid, slice);
  if (st.code() != StatusCode::kTimeout) return st;
  ferry::Status t = eng.test(tid);
  if (t.code() == StatusCode::kNotFound) return st;  // the Timeout was final
  return t;                                          // InProgress or final
}

// Cancels, then takes the final status if the engine has it already
// (InProgress otherwise: the caller hands the transfer to EngineBox::orphans).
ferry::Status cancel_and_poll(ferry::Engine& eng, ferry::TransferId tid) {
  ferry::Status c = eng.cancel(tid);
  if (c.code() == StatusCode::kNotFound) return c;
  return wait_slice(eng, tid, milliseconds(0));
}

// Engine::cancel may block while the transfer's frames wait for a stalled
// peer; a Ctrl-C must not wait for it, so it runs on a thread of its own.
void cancel_in_background(const std::shared_ptr<ferry::Engine>& eng, ferry::TransferId tid) {
  try {
    std::thread([eng, tid] { (void)eng->cancel(tid); }).detach();
  } catch (const std::system_error&) {
    (void)eng->cancel(tid);  // no thread to be had: cancel here
  }
}

struct PyTransfer {
  BoxPtr box;
  ferry::TransferId tid = 0;
  std::string op;
  size_t iovs = 0;
  uint64_t bytes = 0;
  std::mutex mu;  // taken only with the GIL released
  bool finished = false;
  ferry::Status final_status;
  Holder holder;

  // Dropped while running: cancel it; memory stays referenced until it ends.
  ~PyTransfer() {
    if (finished) return;
    if (auto eng = box->try_get()) {
      ferry::Status st = without_gil([&] { return wait_slice(*eng, tid, milliseconds(0)); });
      if (st.code() == StatusCode::kInProgress) {
        cancel_in_background(eng, tid);
        box->adopt(tid, std::move(holder));
      }
    } else if (!box->weak.expired()) {
      holder.leak();  // closed but not yet destroyed: the memory may still be in use
    }
  }

  // GIL held on entry. Records a final status.
  void finish(const ferry::Status& st) {
    if (st.code() == StatusCode::kInProgress) return;
    finished = true;
    final_status = st;
    holder.clear();
  }

  // Polls once without blocking; GIL held on entry.
  bool poll() {
    if (finished) return true;
    auto eng = box->get();
    ferry::Status st = without_gil([&] {
      std::lock_guard<std::mutex> lock(mu);
      if (finished) return final_status;
      ferry::Status s = eng->test(tid);
      if (s.code() != StatusCode::kInProgress) {
        finished = true;
        final_status = s;
      }
      return s;
    });
    if (finished) holder.clear();
    (void)st;
    return finished;
  }

  bool done() { return poll(); }

  nb::object status() {
    poll();
    const StatusCode c = finished ? final_status.code() : StatusCode::kInProgress;
    return nb::cast(c);
  }

  std::string message() {
    poll();
    return finished ? final_status.message() : std::string();
  }

  // Blocks until finished; raises the failure. timeout: seconds, None = forever.
  void wait(std::optional<double> timeout) {
    auto eng = box->get();
    const WaitDeadline deadline(timeout);
    while (!finished) {
      const milliseconds slice = deadline.next_slice();
      without_gil([&] {
        std::lock_guard<std::mutex> lock(mu);
        if (finished) return 0;
        ferry::Status s = wait_slice(*eng, tid, slice);
        if (s.code() != StatusCode::kInProgress) {
          finished = true;
          final_status = s;
        }
        return 0;
      });
      if (finished) break;
      if (PyErr_CheckSignals() != 0) throw nb::python_error();
      if (!box->try_get()) raise(StatusCode::kCancelled, "the engine was closed during the wait");
      if (deadline.passed())
        raise(StatusCode::kTimeout, "transfer " + std::to_string(tid) + " (" + op + ", " +
                                        std::to_string(iovs) + " iovs) did not finish within " +
                                        std::to_string(*timeout) + " s; it is still running");
    }
    holder.clear();
    check(final_status);
  }

  void cancel() {
    if (finished) return;
    auto eng = box->get();
    without_gil([&] {
      std::lock_guard<std::mutex> lock(mu);
      if (finished) return 0;
      ferry::Status s = cancel_and_poll(*eng, tid);
      if (s.code() != StatusCode::kInProgress) {
        finished = true;
        final_status = s;
      }
      return 0;
    });
    if (finished) holder.clear();
  }

  std::string repr() {
    std::string st = finished ? std::string(ferry::status_code_name(final_status.code()))
                              : std::string("InProgress?");
    return "<ferry.Transfer id=" + std::to_string(tid) + " " + op +
           " iovs=" + std::to_string(iovs) + " bytes=" + std::to_string(bytes) + " status=" + st +
           ">";
  }
};

// Blocking completion of a transfer posted by a synchronous call. Ctrl-C or the
// timeout cancel it and return at once; the memory it used stays referenced
// (EngineBox::orphans) until the engine reports its end.
// `first`: the status after the first slice of the wait, already waited
// (with the post, without the GIL).
void wait_sync(EngineBox& box, const std::shared_ptr<ferry::Engine>& engp, ferry::TransferId tid,
               std::optional<double> timeout, const WaitDeadline& deadline, ferry::Status first,
               const char* op, size_t iovs, Holder& holder) {
  ferry::Engine& eng = *engp;
  for (bool waited = true;; waited = false) {
    ferry::Status st;
    if (waited) {
      st = std::move(first);
    } else {
      const milliseconds slice = deadline.next_slice();
      st = without_gil([&] { return wait_slice(eng, tid, slice); });
    }
    if (st.code() != StatusCode::kInProgress) {
      check(st);
      return;
    }
    const bool interrupted = PyErr_CheckSignals() != 0;
    const bool expired = !interrupted && deadline.passed();
    if (!interrupted && !expired) continue;
    std::optional<nb::python_error> err;
    if (interrupted) err.emplace();  // fetched: safe to call the engine now
    ferry::Status fin = without_gil([&] { return wait_slice(eng, tid, milliseconds(0)); });
    if (fin.code() == StatusCode::kInProgress) {
      cancel_in_background(engp, tid);
      box.adopt(tid, std::move(holder));
    }
    if (err) throw std::move(*err);
    if (fin.ok()) return;  // finished in the meantime
    if (fin.code() != StatusCode::kInProgress) check(fin);
    raise(StatusCode::kTimeout, std::string(op) + " of " + std::to_string(iovs) +
                                    " iovs did not finish within " + std::to_string(*timeout) +
                                    " s; it was cancelled");
  }
}

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

// ---------------------------------------------------------------------------
// Peer

enum class Op { kWrite, kRead };
const char* op_name(Op op) {
  return op == Op::kWrite ? "write" : "read";
}

struct Scratch {
  std::vector<ferry::LocalIov> local;
  std::vector<ferry::RemoteIov> remote;
  std::vector<ferry::RemoteDescriptor> descs;
};
thread_local Scratch t_scratch;

// Nanoseconds the binding spent on the last transfer call of this thread before
// handing it to the engine (argument conversion, iov arrays): what a Python call
// costs on top of the same C++ call. Read by bench/python_bench.py.
thread_local uint64_t t_binding_ns = 0;
thread_local Clock::time_point t_call_start;

// [{"transport", "connected", "carries", "reason"}, ...] for Engine.peer_transports
// and Peer.transports().
nb::list peer_transport_list(ferry::Engine& engine, uint64_t peer_id) {
  nb::list out;
  for (const auto& t : unwrap(engine.peer_transports(peer_id))) {
    nb::dict d;
    d["transport"] = t.transport;
    d["connected"] = t.connected;
    d["carries"] = t.carries;
    d["via"] = t.via;
    d["reason"] = t.reason;
    out.append(d);
  }
  return out;
}

struct PyPeer {
  BoxPtr box;
  uint64_t id = 0;

  // Posts local/remote (already built) and completes per `async_`.
  nb::object submit(Op op, std::span<const ferry::LocalIov> local,
                    std::span<const ferry::RemoteIov> remote, nb::handle notify,
                    std::optional<double> timeout, bool async_, Holder&& holder,
                    uint64_t total_bytes) {
    auto eng = box->get();
    box->reap(*eng);
    std::optional<ferry::ByteView> note;
    if (!notify.is_none()) {
      if (op != Op::kWrite)
        raise(StatusCode::kInvalidArgument, "only a write can carry a notification");
      ByteSpan s(notify, "notify");
      holder.notification.assign(s.span.begin(), s.span.end());
      note = ferry::ByteView(holder.notification);
    }
    const uint64_t peer = id;
    t_binding_ns = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t_call_start).count());
    // A blocking call posts and waits its first slice in one release of the
    // GIL: each release and retake is a few hundred ns of a ~10 us write.
    const WaitDeadline deadline(timeout);
    const milliseconds first_slice = async_ ? milliseconds(0) : deadline.next_slice();
    ferry::Status first(StatusCode::kInProgress, "");
    ferry::Result<ferry::TransferId> r = without_gil([&]() -> ferry::Result<ferry::TransferId> {
      auto posted = op == Op::kWrite ? eng->write_async(peer, local, remote, note)
                                     : eng->read_async(peer, local, remote);
      if (!async_ && posted.ok()) first = wait_slice(*eng, *posted, first_slice);
      return posted;
    });
    const ferry::TransferId tid = unwrap(std::move(r));
    if (!async_) {
      wait_sync(*box, eng, tid, timeout, deadline, std::move(first), op_name(op), local.size(),
                holder);
      return nb::none();
    }
    auto* t = new PyTransfer();
    t->box = box;
    t->tid = tid;
    t->op = op_name(op);
    t->iovs = local.size();
    t->bytes = total_bytes;
    t->holder = std::move(holder);
    return nb::cast(t, nb::rv_policy::take_ownership);
  }

  // local: list of (buffer-or-region[, offset[, length]]) or one such entry;
  // remote: list of (descriptor[, offset[, length]]) or one such entry.
  nb::object transfer(Op op, nb::handle local, nb::handle remote, nb::handle notify,
                      std::optional<double> timeout, bool async_) {
    t_call_start = Clock::now();
    (void)box->get();  // a closed engine is the first thing to report
    nb::object local_list = as_entry_list(local, /*remote=*/false);
    nb::object remote_list = as_entry_list(remote, /*remote=*/true);
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(local_list.ptr());
    if (n != PySequence_Fast_GET_SIZE(remote_list.ptr()))
      raise(StatusCode::kInvalidArgument,
            "local has " + std::to_string(n) + " entries but remote has " +
                std::to_string(PySequence_Fast_GET_SIZE(remote_list.ptr())) +
                "; they pair up one to one");
    if (n == 0) raise(StatusCode::kInvalidArgument, "a transfer needs at least one iov");
    PyObject** litems = PySequence_Fast_ITEMS(local_list.ptr());
    PyObject** ritems = PySequence_Fast_ITEMS(remote_list.ptr());

    Holder holder;
    const size_t count = static_cast<size_t>(n);
    std::vector<ferry::LocalIov> liov(count);
    std::vector<ferry::RemoteIov> riov(count);
    std::vector<ferry::RemoteDescriptor> descs;
    std::vector<uint32_t> didx(count);
    std::unordered_map<PyObject*, uint32_t> desc_cache;
    struct Local {
      char* base;
      uint64_t size;
    };
    std::unordered_map<PyObject*, Local> buf_cache;
    uint64_t total = 0;
    // Consecutive entries usually name the same buffer and descriptor.
    PyObject* last_lobj = nullptr;
    PyObject* last_robj = nullptr;
    auto last_l = buf_cache.end();
    auto last_d = desc_cache.end();

    for (Py_ssize_t i = 0; i < n; ++i) {
      // ---- local entry
      nb::handle lobj, loff, llen;
      split_entry(nb::handle(litems[i]), lobj, loff, llen, false, i);
      Local L{};
      auto it = lobj.ptr() == last_lobj ? last_l : buf_cache.find(lobj.ptr());
      if (it != buf_cache.end()) {
        L = it->second;
        last_lobj = lobj.ptr();
        last_l = it;
      } else {
        PyRegion* reg = nullptr;
        if (nb::try_cast<PyRegion*>(lobj, reg, false) && reg) {
          reg->require_registered();
          if (reg->box != box)
            raise(StatusCode::kInvalidArgument, "local[" + std::to_string(i) + "]: region " +
                                                    std::to_string(reg->mr.id) +
                                                    " belongs to another engine");
          if (op == Op::kRead && reg->buf.readonly)
            raise(StatusCode::kPermissionDenied, "local[" + std::to_string(i) + "]: region " +
                                                     std::to_string(reg->mr.id) +
                                                     " is read-only and cannot receive a read");
          L = {static_cast<char*>(reg->mr.address), reg->mr.length};
          holder.objs.push_back(nb::borrow(lobj));
        } else {
          BufferRef b = acquire(lobj, op == Op::kRead);
          L = {static_cast<char*>(b.ptr), b.size};
          holder.bufs.push_back(std::move(b));
        }
        buf_cache.emplace(lobj.ptr(), L);
      }
      const uint64_t off = loff.is_valid() && !loff.is_none() ? as_u64(loff, "local offset") : 0;
      std::optional<uint64_t> len;
      if (llen.is_valid() && !llen.is_none()) len = as_u64(llen, "local length");

      // ---- remote entry
      nb::handle robj, roff, rlen;
      split_entry(nb::handle(ritems[i]), robj, roff, rlen, true, i);
      uint32_t di;
      auto dit = robj.ptr() == last_robj ? last_d : desc_cache.find(robj.ptr());
      if (dit != desc_cache.end()) {
        di = dit->second;
        last_robj = robj.ptr();
        last_d = dit;
      } else {
        di = static_cast<uint32_t>(descs.size());
        descs.push_back(parse_descriptor(robj));
        desc_cache.emplace(robj.ptr(), di);
      }
      const uint64_t roffv = roff.is_valid() && !roff.is_none() ? as_u64(roff, "remote offset") : 0;
      std::optional<uint64_t> rl;
      if (rlen.is_valid() && !rlen.is_none()) rl = as_u64(rlen, "remote length");

      // ---- lengths
      if (off > L.size)
        raise(StatusCode::kOutOfRange, "local[" + std::to_string(i) + "]: offset " +
                                           std::to_string(off) + " is past the end of the " +
                                           std::to_string(L.size) + "-byte buffer");
      uint64_t length = len ? *len : (rl ? *rl : L.size - off);
      if (rl && *rl != length)
        raise(StatusCode::kInvalidArgument, "entry " + std::to_string(i) + ": local length " +
                                                std::to_string(length) + " != remote length " +
                                                std::to_string(*rl));
      if (length > L.size - off)
        raise(StatusCode::kOutOfRange, "local[" + std::to_string(i) + "]: [" + std::to_string(off) +
                                           ", " + std::to_string(off + length) + ") exceeds the " +
                                           std::to_string(L.size) + "-byte buffer");
      liov[size_t(i)] = {L.base + off, length};
      riov[size_t(i)] = {nullptr, roffv, length};
      didx[size_t(i)] = di;
      total += length;
    }
    for (size_t i = 0; i < size_t(n); ++i) riov[i].descriptor = &descs[didx[i]];
    return submit(op, liov, riov, notify, timeout, async_, std::move(holder), total);
  }

  // Normalizes one entry or a list of entries to a fast sequence of entries.
  static nb::object as_entry_list(nb::handle h, bool remote) {
    bool single = false;
    if (PyTuple_Check(h.ptr())) {
      // (obj, offset[, length]) with an int offset is one entry.
      const Py_ssize_t n = PyTuple_GET_SIZE(h.ptr());
      if ((n == 2 || n == 3) && PyLong_Check(PyTuple_GET_ITEM(h.ptr(), 1))) single = true;
    } else if (!PyList_Check(h.ptr())) {
      single = true;  // a region, a buffer, a descriptor
    }
    (void)remote;
    if (single) return nb::steal(PyTuple_Pack(1, h.ptr()));
    return nb::steal(PySequence_Fast(h.ptr(), "expected a list of entries"));
  }

  static void split_entry(nb::handle e, nb::handle& obj, nb::handle& off, nb::handle& len,
                          bool remote, Py_ssize_t i) {
    if (PyTuple_Check(e.ptr()) || PyList_Check(e.ptr())) {
      const Py_ssize_t n = PySequence_Size(e.ptr());
      if (n < 1 || n > 3)
        raise(StatusCode::kInvalidArgument,
              std::string(remote ? "remote" : "local") + "[" + std::to_string(i) + "] must be (" +
                  (remote ? "descriptor" : "buffer") + ", offset, length)");
      PyObject** items = PySequence_Fast_ITEMS(e.ptr());
      obj = items[0];
      off = n > 1 ? nb::handle(items[1]) : nb::handle();
      len = n > 2 ? nb::handle(items[2]) : nb::handle();
    } else {
      obj = e;
      off = nb::handle();
      len = nb::handle();
    }
  }

  // The numpy fast path: one loop in C++ with the GIL released.
  nb::object batch(Op op, PyRegion* region, nb::handle local_offsets, nb::handle descriptors,
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
  uint64_t build_batch(Op op, PyRegion* region, nb::handle local_offsets, nb::handle descriptors,
                       nb::handle desc_index, nb::handle remote_offsets, nb::handle lengths,
                       Scratch& s, Holder& holder) {
    char* base = nullptr;
    uint64_t rlen = 0;
    if (region) {
      region->require_registered();
      if (region->box != box)
        raise(StatusCode::kInvalidArgument,
              "region " + std::to_string(region->mr.id) + " belongs to another engine");
      if (op == Op::kRead && region->buf.readonly)
        raise(StatusCode::kPermissionDenied, "region " + std::to_string(region->mr.id) +
                                                 " is read-only and cannot receive a read");
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

  void notify(nb::handle payload) {
    auto eng = box->get();
    ByteSpan s(payload, "payload");
    ferry::Bytes copy(s.span.begin(), s.span.end());
    const uint64_t peer = id;
    check(without_gil([&] { return eng->notify(peer, copy); }));
  }

  std::string repr() const {
    char buf[64];
    std::snprintf(buf, sizeof buf, "<ferry.Peer id=0x%016llx>",
                  static_cast<unsigned long long>(id));
    return buf;
  }
};

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

// ---------------------------------------------------------------------------
// Engine

std::string option_key(std::string k) {
  if (k.find('.') == std::string::npos) {
    auto u = k.find('_');
    if (u != std::string::npos) k[u] = '.';
  }
  return k;
}

std::string option_value(nb::handle v) {
  if (PyBool_Check(v.ptr())) return v.ptr() == Py_True ? "true" : "false";
  if (PyUnicode_Check(v.ptr())) return nb::cast<std::string>(v);
  return nb::str(v).c_str();
}

struct PyEngine {
  BoxPtr box;

  PyEngine(const std::string& listen, nb::handle options, nb::kwargs kwargs) {
    ferry::EngineConfig cfg;
    cfg.listen = listen;
    if (!options.is_none()) {
      nb::dict d = nb::cast<nb::dict>(options);
      for (auto [k, v] : d) cfg.options[option_key(nb::cast<std::string>(k))] = option_value(v);
    }
    for (auto [k, v] : kwargs) {
      const std::string word = nb::cast<std::string>(k);
      // directory="etcd://host:port/prefix", name="decode-3": EngineConfig's
      // own fields (a torch store goes through ferry.Engine in Python).
      if (word == "directory" || word == "name") {
        if (!PyUnicode_Check(v.ptr()))
          raise(StatusCode::kInvalidArgument, word + "= must be a string here");
        (word == "directory" ? cfg.directory : cfg.name) = nb::cast<std::string>(v);
        continue;
      }
      const std::string key = option_key(word);
      if (cfg.options.count(key))
        raise(StatusCode::kInvalidArgument, "option '" + key + "' given twice");
      cfg.options[key] = option_value(v);
    }
    auto r = without_gil([&] { return ferry::Engine::create(cfg); });
    std::unique_ptr<ferry::Engine> eng = unwrap(std::move(r));
    box = std::make_shared<EngineBox>();
    box->id = eng->id();
    box->engine = std::shared_ptr<ferry::Engine>(std::move(eng));
    box->weak = box->engine;
  }

  uint64_t id() const { return box->id; }
  nb::bytes metadata() { return to_py_bytes(box->get()->metadata()); }
  std::string listen_address() { return box->get()->listen_address(); }
  bool closed() { return !box->try_get(); }

  nb::list options() {
    nb::list out;
    for (const auto& o : box->get()->options()) {
      nb::dict d;
      d["name"] = o.name;
      d["type"] = o.type;
      d["value"] = o.value;
      d["source"] = o.source;
      d["doc"] = o.doc;
      out.append(d);
    }
    return out;
  }

  std::string name() { return box->get()->name(); }

  void publish(const std::string& key, nb::handle descriptor) {
    auto eng = box->get();
    ByteSpan s(descriptor, "publish() descriptor (bytes or Descriptor)");
    auto d = unwrap(ferry::RemoteDescriptor::from_bytes(s.span));
    check(without_gil([&] { return eng->publish(key, d); }));
  }

  nb::bytes lookup(const std::string& name, const std::string& key, double timeout) {
    auto eng = box->get();
    const auto wait = to_ms(timeout);
    auto d = unwrap(without_gil([&] { return eng->lookup(name, key, wait); }));
    return to_py_bytes(d.to_bytes());
  }

  nb::list transports() {
    nb::list out;
    for (const auto& t : box->get()->transports()) {
      nb::dict d;
      d["name"] = t.name;
      d["running"] = t.running;
      d["same_host_only"] = t.same_host_only;
      d["detail"] = t.detail;
      nb::dict counters;
      for (const auto& [name, value] : t.counters) counters[name.c_str()] = value;
      d["counters"] = counters;
      out.append(d);
    }
    return out;
  }

  nb::list peer_transports(uint64_t peer_id) { return peer_transport_list(*box->get(), peer_id); }

  std::vector<uint64_t> peers() { return box->get()->peers(); }

  std::string peer_address(uint64_t peer_id) { return unwrap(box->get()->peer_address(peer_id)); }

  PyPeer* peer(uint64_t peer_id) { return new PyPeer{box, peer_id}; }

  PyPeer* connect(nb::handle target, double timeout) {
    auto eng = box->get();
    ferry::PeerId pid;
    if (PyUnicode_Check(target.ptr())) {
      std::string hp = nb::cast<std::string>(target);
      const auto wait = to_ms(timeout);
      pid = unwrap(without_gil([&] { return eng->connect(std::string_view(hp), wait); }));
    } else {
      ByteSpan s(target, "connect() target (metadata bytes or 'host:port')");
      ferry::Bytes md(s.span.begin(), s.span.end());
      pid = unwrap(without_gil([&] { return eng->connect(ferry::ByteView(md)); }));
    }
    return new PyPeer{box, pid};
  }

  PyRegion* finish_register(BufferRef&& b) {
    auto eng = box->get();
    void* p = b.ptr;
    const uint64_t n = b.size;
    ferry::MemoryRegion mr = unwrap(without_gil([&] { return eng->register_memory(p, n); }));
    auto* r = new PyRegion();
    r->box = box;
    r->mr = mr;
    r->buf = std::move(b);
    r->registered = true;
    box->regions.insert(r);
    return r;
  }

  PyRegion* register_buffer(nb::handle obj) { return finish_register(acquire(obj, false)); }

  PyRegion* register_ptr(uint64_t ptr, uint64_t size) {
    BufferRef b;
    b.ptr = reinterpret_cast<void*>(static_cast<uintptr_t>(ptr));
    b.size = size;
    b.source = "pointer";
    return finish_register(std::move(b));
  }

  uint64_t peer_id_of(nb::handle peer) {
    PyPeer* p = nullptr;
    if (nb::try_cast<PyPeer*>(peer, p, false) && p) return p->id;
    return as_u64(peer, "peer");
  }

  void notify(nb::handle peer, nb::handle payload) {
    PyPeer p{box, peer_id_of(peer)};
    p.notify(payload);
  }

  static nb::list to_list(std::vector<ferry::Notification>&& v) {
    nb::list out;
    for (auto& n : v) out.append(nb::make_tuple(n.peer, to_py_bytes(n.payload)));
    return out;
  }

  nb::list notifications() {
    auto eng = box->get();
    return to_list(without_gil([&] { return eng->take_notifications(); }));
  }

  nb::list wait_notifications(std::optional<double> timeout) {
    auto eng = box->get();
    const WaitDeadline deadline(timeout);
    for (;;) {
      auto v = without_gil([&] { return eng->wait_notifications(deadline.next_slice()); });
      if (!v.empty()) return to_list(std::move(v));
      if (PyErr_CheckSignals() != 0) throw nb::python_error();
      if (!box->try_get()) raise(StatusCode::kCancelled, "the engine was closed during the wait");
      if (deadline.passed()) return nb::list();
    }
  }

  void close() {
    std::shared_ptr<ferry::Engine> eng;
    {
      std::lock_guard<std::mutex> lock(box->mu);
      eng = std::move(box->engine);
    }
    if (!eng) return;
    // Revoke every region before the buffers can be released.
    std::vector<PyRegion*> regs(box->regions.begin(), box->regions.end());
    for (PyRegion* r : regs) {
      const uint64_t rid = r->mr.id;
      (void)without_gil([&] { return eng->deregister_memory(rid); });
      r->registered = false;
      r->buf.release();
    }
    box->regions.clear();
    without_gil([&] {
      eng.reset();
      return 0;
    });
    if (box->weak.expired()) box->orphans.clear();  // nothing can touch their memory now
  }

  std::string repr() {
    char buf[64];
    std::snprintf(buf, sizeof buf, "id=0x%016llx", static_cast<unsigned long long>(box->id));
    auto eng = box->try_get();
    return std::string("<ferry.Engine ") + buf +
           (eng ? " listen=" + eng->listen_address() : std::string(" closed")) + ">";
  }
};

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
  m.def(
      "_last_binding_ns", [] { return t_binding_ns; },
      "ns the binding spent before the engine call, for the last transfer call of this thread");
  m.def(
      "_cpp_loop",
      [](PyPeer& peer, const std::string& op, PyRegion& region, uint64_t block, uint64_t n,
         nb::handle desc, uint64_t iters) {
        // The C++ baseline for bench/python_bench.py: the same calls a C++ program
        // makes (iovs built once, blocking Engine::write/read), on the same
        // engine and connection as the Python calls it is compared with.
        region.require_registered();
        if (block == 0 || n == 0 || block * n > region.mr.length)
          raise(StatusCode::kOutOfRange, "_cpp_loop: n * block exceeds the region");
        ferry::RemoteDescriptor d = parse_descriptor(desc);
        std::vector<ferry::LocalIov> local(n);
        std::vector<ferry::RemoteIov> remote(n);
        for (uint64_t i = 0; i < n; ++i) {
          local[i] = {static_cast<char*>(region.mr.address) + i * block, block};
          remote[i] = {&d, i * block, block};
        }
        auto eng = peer.box->get();
        const bool is_write = op == "write";
        std::vector<double> lat_us;
        lat_us.reserve(iters);
        ferry::Status st = without_gil([&] {
          for (uint64_t k = 0; k < iters; ++k) {
            auto t0 = Clock::now();
            ferry::Status s =
                is_write ? eng->write(peer.id, local, remote) : eng->read(peer.id, local, remote);
            if (!s.ok()) return s;
            lat_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
          }
          return ferry::Status::Ok();
        });
        check(st);
        return lat_us;
      },
      "peer"_a, "op"_a, "region"_a, "block"_a, "n"_a, "descriptor"_a, "iters"_a,
      "Benchmark baseline: `iters` blocking C++ calls of n x block bytes; latencies in us.");
  m.def("version", [] { return std::string(ferry::version()); });
  m.def("protocol_version", [] { return ferry::protocol_version(); });
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

  nb::class_<PyTransfer>(m, "Transfer", "An asynchronous write or read.")
      .def_prop_ro("id", [](const PyTransfer& t) { return t.tid; })
      .def_prop_ro("op", [](const PyTransfer& t) { return t.op; })
      .def_prop_ro("iovs", [](const PyTransfer& t) { return t.iovs; })
      .def_prop_ro("nbytes", [](const PyTransfer& t) { return t.bytes; })
      .def_prop_ro("status", &PyTransfer::status,
                   "StatusCode: InProgress while running, then the final code.")
      .def_prop_ro("message", &PyTransfer::message, "The engine's message for a failure.")
      .def("done", &PyTransfer::done, "True once finished (successfully or not); never blocks.")
      .def("wait", &PyTransfer::wait, "timeout"_a = nb::none(),
           "Block until finished (timeout in seconds; None = forever). Raises the failure; "
           "raises ferry.Timeout if the time runs out (the transfer keeps running).")
      .def("cancel", &PyTransfer::cancel,
           "Stop the transfer; afterwards no more bytes move into local memory for it.")
      .def("__repr__", &PyTransfer::repr);

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

  nb::class_<PyPeer>(m, "Peer", "A connected remote engine.")
      .def_prop_ro("id", [](const PyPeer& p) { return p.id; })
      .def(
          "transports", [](PyPeer& p) { return peer_transport_list(*p.box->get(), p.id); },
          "How this engine reaches the peer: Engine.peer_transports(peer.id).")
      .def(
          "write",
          [](PyPeer& p, nb::handle local, nb::handle remote, nb::handle notify,
             std::optional<double> timeout, bool async_) {
            return p.transfer(Op::kWrite, local, remote, notify, timeout, async_);
          },
          "local"_a, "remote"_a, "notify"_a = nb::none(), "timeout"_a = nb::none(),
          "async_"_a = false,
          "One-sided write. local: [(buffer_or_region, offset, length), ...]; remote: "
          "[(descriptor, offset, length), ...]. Blocks unless async_=True (then returns a "
          "Transfer). notify: bytes delivered to the target after every byte is placed.")
      .def(
          "read",
          [](PyPeer& p, nb::handle local, nb::handle remote, std::optional<double> timeout,
             bool async_) {
            return p.transfer(Op::kRead, local, remote, nb::none(), timeout, async_);
          },
          "local"_a, "remote"_a, "timeout"_a = nb::none(), "async_"_a = false,
          "One-sided read into local memory; same arguments as write().")
      .def(
          "write_async",
          [](PyPeer& p, nb::handle local, nb::handle remote, nb::handle notify) {
            return p.transfer(Op::kWrite, local, remote, notify, std::nullopt, true);
          },
          "local"_a, "remote"_a, "notify"_a = nb::none())
      .def(
          "read_async",
          [](PyPeer& p, nb::handle local, nb::handle remote) {
            return p.transfer(Op::kRead, local, remote, nb::none(), std::nullopt, true);
          },
          "local"_a, "remote"_a)
      .def(
          "write_batch",
          [](PyPeer& p, PyRegion* region, nb::handle lo, nb::handle descs, nb::handle di,
             nb::handle ro, nb::handle ln, nb::handle notify, std::optional<double> timeout,
             bool async_) {
            return p.batch(Op::kWrite, region, lo, descs, di, ro, ln, notify, timeout, async_);
          },
          "region"_a, "local_offsets"_a, "descriptors"_a, "desc_index"_a = nb::none(),
          "remote_offsets"_a = nb::none(), "lengths"_a = nb::none(), "notify"_a = nb::none(),
          "timeout"_a = nb::none(), "async_"_a = false,
          "Batched write with columns as numpy arrays (uint64; desc_index uint32), built in "
          "C++ without a per-entry Python loop. A column may be one int (broadcast).")
      .def(
          "read_batch",
          [](PyPeer& p, PyRegion* region, nb::handle lo, nb::handle descs, nb::handle di,
             nb::handle ro, nb::handle ln, std::optional<double> timeout, bool async_) {
            return p.batch(Op::kRead, region, lo, descs, di, ro, ln, nb::none(), timeout, async_);
          },
          "region"_a, "local_offsets"_a, "descriptors"_a, "desc_index"_a = nb::none(),
          "remote_offsets"_a = nb::none(), "lengths"_a = nb::none(), "timeout"_a = nb::none(),
          "async_"_a = false)
      .def(
          "prepare_write",
          [](PyPeer& p, PyRegion* region, nb::handle lo, nb::handle descs, nb::handle di,
             nb::handle ro,
             nb::handle ln) { return prepare(p, Op::kWrite, region, lo, descs, di, ro, ln); },
          "region"_a.none(), "local_offsets"_a, "descriptors"_a, "desc_index"_a = nb::none(),
          "remote_offsets"_a = nb::none(), "lengths"_a = nb::none(),
          "A write_batch checked and built once, to post many times: PreparedTransfer.post() "
          "(async) or .run() (blocking). Same columns as write_batch; region=None: "
          "local_offsets are addresses in memory registered with this engine.")
      .def(
          "prepare_read",
          [](PyPeer& p, PyRegion* region, nb::handle lo, nb::handle descs, nb::handle di,
             nb::handle ro,
             nb::handle ln) { return prepare(p, Op::kRead, region, lo, descs, di, ro, ln); },
          "region"_a.none(), "local_offsets"_a, "descriptors"_a, "desc_index"_a = nb::none(),
          "remote_offsets"_a = nb::none(), "lengths"_a = nb::none(),
          "A read_batch checked and built once, to post many times (region=None: local "
          "addresses, as for prepare_write).")
      .def(
          "_post_addresses",
          [](PyPeer& p, const std::string& op, nb::handle addrs, nb::handle lengths,
             nb::handle descs, nb::handle remote_offsets, nb::handle notify,
             std::optional<double> timeout, bool async_) {
            Op o = op == "write" ? Op::kWrite
                   : op == "read"
                       ? Op::kRead
                       : (raise(StatusCode::kInvalidArgument, "op must be 'write' or 'read'"),
                          Op::kWrite);
            return p.batch(o, nullptr, addrs, descs, nb::none(), remote_offsets, lengths, notify,
                           timeout, async_);
          },
          "op"_a, "addresses"_a, "lengths"_a, "descriptors"_a, "remote_offsets"_a = nb::none(),
          "notify"_a = nb::none(), "timeout"_a = nb::none(), "async_"_a = false,
          "Raw form used by ferry.compat: local iovs are absolute addresses inside registered "
          "regions; one descriptor per iov (or one for all).")
      .def("notify", &PyPeer::notify, "payload"_a)
      .def("__eq__",
           [](const PyPeer& a, nb::handle b) {
             PyPeer* o = nullptr;
             return nb::try_cast<PyPeer*>(b, o, false) && o && o->box == a.box && o->id == a.id;
           })
      .def("__hash__", [](const PyPeer& p) { return std::hash<uint64_t>()(p.id); })
      .def("__repr__", &PyPeer::repr);

  nb::class_<PyEngine>(m, "Engine", "A Ferry engine: registers memory and moves bytes to peers.")
      .def(nb::init<const std::string&, nb::handle, nb::kwargs>(), "listen"_a = "127.0.0.1:0",
           "options"_a = nb::none(), "kwargs"_a,
           "Engine(listen='127.0.0.1:0', options=None, **opts): opts map to engine options "
           "with the first '_' turned into '.', e.g. tcp_streams=4 -> 'tcp.streams'.")
      .def_prop_ro("id", &PyEngine::id)
      .def_prop_ro("listen_address", &PyEngine::listen_address)
      .def_prop_ro("closed", &PyEngine::closed)
      .def("metadata", &PyEngine::metadata, "Bytes a peer passes to connect() to reach us.")
      .def("options", &PyEngine::options, "Every option with its effective value and source.")
      .def("peers", &PyEngine::peers, "Ids of the peers connected now (either direction).")
      .def("transports", &PyEngine::transports,
           "The transports this engine runs, in preference order, and those it could not "
           "start: [{'name', 'running', 'same_host_only', 'detail', 'counters'}] (detail: the "
           "address, or why it is not running; counters: {name: total} of what it did, e.g. "
           "fabric's 'combined_calls').")
      .def("peer_transports", &PyEngine::peer_transports, "peer_id"_a,
           "How this engine reaches a peer, one entry per running transport: [{'transport', "
           "'connected', 'carries', 'reason', 'via'}] (carries: a comma list of 'host memory', "
           "'peer GPU memory', 'local GPU with peer host memory', or ''; reason: why it carries "
           "nothing or less; via: how a connected transport reaches the peer, e.g. shm's mode).")
      .def("peer_address", &PyEngine::peer_address, "peer_id"_a,
           "The connected peer's 'ip:port' on its side of the connection (NotFound if not "
           "connected).")
      .def("peer", &PyEngine::peer, "peer_id"_a, "A Peer handle for a known peer id.")
      .def("connect", &PyEngine::connect, "target"_a, "timeout"_a = 0.0,
           "Connect by metadata bytes or 'host:port' -- or, with a directory, by an engine "
           "name (waiting up to timeout seconds for it to appear); cached per peer.")
      .def_prop_ro("name", &PyEngine::name, "This engine's name in its directory ('' without).")
      .def("publish", &PyEngine::publish, "key"_a, "descriptor"_a,
           "Publish a descriptor of this engine under (its name, key) in its directory.")
      .def("lookup", &PyEngine::lookup, "name"_a, "key"_a, "timeout"_a = 0.0,
           "The descriptor bytes engine `name` published under `key` (waits up to timeout s).")
      .def("register", &PyEngine::register_buffer, "buffer"_a,
           "Register a numpy array, buffer-protocol object, DLPack producer or tensor-like "
           "object (data_ptr()/nbytes). The Region keeps it alive.")
      .def("register_ptr", &PyEngine::register_ptr, "ptr"_a, "size"_a,
           "Register raw memory [ptr, ptr+size); the caller keeps it alive.")
      .def("notify", &PyEngine::notify, "peer"_a, "payload"_a)
      .def("notifications", &PyEngine::notifications,
           "Take every notification received so far: [(peer_id, bytes), ...].")
      .def("wait_notifications", &PyEngine::wait_notifications, "timeout"_a = nb::none(),
           "Block until at least one notification is there (or the timeout, in seconds, "
           "passes: then []). Ctrl-C raises KeyboardInterrupt.")
      .def("close", &PyEngine::close,
           "Deregister every region and shut the engine down. Idempotent.")
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
      .def("__exit__", [](PyEngine& e, nb::args) { e.close(); })
      .def("__repr__", &PyEngine::repr);
}
