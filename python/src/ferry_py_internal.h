// Declarations the binding's files share (ferry_py.cc and the *_py.cc files
// it calls): turning Python objects into memory, the engine box every object
// holds, and the classes more than one file reaches into (Region, Peer).
// Everything here is internal to the extension module.
#pragma once

#include <nanobind/nanobind.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ferry/engine.h"
#include "ferry/status.h"
#include "ferry/types.h"
#include "status_error.h"
#include "wait_slices.h"

namespace nb = nanobind;

namespace ferry_py {

using ferry::StatusCode;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

inline bool interpreter_finalizing() {
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

std::string tname(nb::handle h);

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

// obj as an unsigned 64-bit int (anything with __index__); `what` names it in
// the error.
uint64_t as_u64(nb::handle h, const char* what);

// Exposes obj's memory. writable: fail on read-only memory (else mark it).
BufferRef acquire(nb::handle obj, bool need_writable);

// 'r', 'w', 'rw' or ferry.ACCESS_* flags; None: read-only memory gets 'r'.
uint8_t parse_access(nb::handle h, bool readonly_default);

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

nb::bytes to_py_bytes(const ferry::Bytes& b);
ferry::RemoteDescriptor parse_descriptor(nb::handle h);

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
// Region (region_py.cc)

struct PyRegion {
  BoxPtr box;
  ferry::MemoryRegion mr;
  BufferRef buf;
  bool registered = false;

  ~PyRegion();
  void require_registered() const;
  void deregister();
  nb::bytes advertise(uint64_t offset, std::optional<uint64_t> length, nb::handle access);
  std::string repr() const;
};

// ---------------------------------------------------------------------------
// Transfer (transfer_py.cc)

// Waits once for up to `slice`: the final status, or InProgress.
ferry::Status wait_slice(ferry::Engine& eng, ferry::TransferId tid, milliseconds slice);

// Cancels tid on a thread of its own (Engine::cancel may block).
void cancel_in_background(const std::shared_ptr<ferry::Engine>& eng, ferry::TransferId tid);

// A Python Transfer for a posted asynchronous transfer; it owns `holder`.
nb::object make_transfer(const BoxPtr& box, ferry::TransferId tid, const char* op, size_t iovs,
                         uint64_t bytes, Holder&& holder);

// Blocking completion of a transfer posted by a synchronous call (see transfer_py.cc).
void wait_sync(EngineBox& box, const std::shared_ptr<ferry::Engine>& engp, ferry::TransferId tid,
               std::optional<double> timeout, const WaitDeadline& deadline, ferry::Status first,
               const char* op, size_t iovs, Holder& holder);

// ---------------------------------------------------------------------------
// Peer (peer_py.cc; the batch and prepared forms in batch_py.cc)

enum class Op { kWrite, kRead };
inline const char* op_name(Op op) {
  return op == Op::kWrite ? "write" : "read";
}

struct Scratch {
  std::vector<ferry::LocalIov> local;
  std::vector<ferry::RemoteIov> remote;
  std::vector<ferry::RemoteDescriptor> descs;
};

// Nanoseconds the binding spent on the last transfer call of this thread before
// handing it to the engine (argument conversion, iov arrays): what a Python call
// costs on top of the same C++ call. Read by bench/python_bench.py. Inline: one
// variable for every file of the module.
inline thread_local uint64_t t_binding_ns = 0;
inline thread_local Clock::time_point t_call_start;

// [{"transport", "connected", "carries", "reason"}, ...] for Engine.peer_transports
// and Peer.transports().
nb::list peer_transport_list(ferry::Engine& engine, uint64_t peer_id);

struct PyPeer {
  BoxPtr box;
  uint64_t id = 0;

  // Posts local/remote (already built) and completes per `async_`.
  nb::object submit(Op op, std::span<const ferry::LocalIov> local,
                    std::span<const ferry::RemoteIov> remote, nb::handle notify,
                    std::optional<double> timeout, bool async_, Holder&& holder,
                    uint64_t total_bytes);

  // local: list of (buffer-or-region[, offset[, length]]) or one such entry;
  // remote: list of (descriptor[, offset[, length]]) or one such entry.
  nb::object transfer(Op op, nb::handle local, nb::handle remote, nb::handle notify,
                      std::optional<double> timeout, bool async_);

  // Normalizes one entry or a list of entries to a fast sequence of entries.
  static nb::object as_entry_list(nb::handle h, bool remote);

  static void split_entry(nb::handle e, nb::handle& obj, nb::handle& off, nb::handle& len,
                          bool remote, Py_ssize_t i);

  // The numpy fast path: one loop in C++ with the GIL released (batch_py.cc).
  nb::object batch(Op op, PyRegion* region, nb::handle local_offsets, nb::handle descriptors,
                   nb::handle desc_index, nb::handle remote_offsets, nb::handle lengths,
                   nb::handle notify, std::optional<double> timeout, bool async_);

  // Checks the columns and builds the iov arrays of a batch into `s`
  // (batch_py.cc).
  uint64_t build_batch(Op op, PyRegion* region, nb::handle local_offsets, nb::handle descriptors,
                       nb::handle desc_index, nb::handle remote_offsets, nb::handle lengths,
                       Scratch& s, Holder& holder);

  void notify(nb::handle payload);

  std::string repr() const;
};

// Peer.prepare_write / prepare_read: a batch built once, posted many times
// (batch_py.cc).
nb::object prepare(PyPeer& p, Op op, PyRegion* region, nb::handle lo, nb::handle descs,
                   nb::handle di, nb::handle ro, nb::handle ln);

// ---------------------------------------------------------------------------
// What each file adds to the module (NB_MODULE in ferry_py.cc calls them in
// this order).

void bind_buffers(nb::module_& m);   // _address_of, Descriptor
void bind_region(nb::module_& m);    // Region
void bind_transfer(nb::module_& m);  // Transfer
void bind_prepared(nb::module_& m);  // PreparedTransfer
void bind_peer(nb::module_& m);      // Peer, _last_binding_ns, _cpp_loop
void bind_engine(nb::module_& m);    // Engine

}  // namespace ferry_py
