// ferry.Transfer (an asynchronous write or read) and the waits every transfer
// call shares: slices of engine waits with the GIL released between them,
// cancellation on Ctrl-C or a timeout.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <optional>
#include <string>
#include <system_error>
#include <thread>

#include "ferry_py_internal.h"

using namespace nb::literals;

namespace ferry_py {

// Waits once for up to `slice`: the final status, or InProgress. Resolves the
// ambiguity of Engine::wait answering Timeout (still running, or a final Timeout).
ferry::Status wait_slice(ferry::Engine& eng, ferry::TransferId tid, milliseconds slice) {
  ferry::Status st = eng.wait(tid, slice);
  if (st.code() != StatusCode::kTimeout) return st;
  ferry::Status t = eng.test(tid);
  if (t.code() == StatusCode::kNotFound) return st;  // the Timeout was final
  return t;                                          // InProgress or final
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

namespace {

// Cancels, then takes the final status if the engine has it already
// (InProgress otherwise: the caller hands the transfer to EngineBox::orphans).
ferry::Status cancel_and_poll(ferry::Engine& eng, ferry::TransferId tid) {
  ferry::Status c = eng.cancel(tid);
  if (c.code() == StatusCode::kNotFound) return c;
  return wait_slice(eng, tid, milliseconds(0));
}

struct PyTransfer {
  BoxPtr box;
  ferry::TransferId tid = 0;
  std::string op;
  size_t iovs = 0;
  uint64_t bytes = 0;
  std::mutex mu;  // taken only with the GIL released
  // Set under `mu` (GIL released) once final_status is written; read without
  // the lock by threads that hold the GIL, two of which may wait on one
  // transfer: atomic, so that a reader that sees it sees final_status too.
  std::atomic<bool> finished{false};
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

}  // namespace

nb::object make_transfer(const BoxPtr& box, ferry::TransferId tid, const char* op, size_t iovs,
                         uint64_t bytes, Holder&& holder) {
  auto* t = new PyTransfer();
  t->box = box;
  t->tid = tid;
  t->op = op;
  t->iovs = iovs;
  t->bytes = bytes;
  t->holder = std::move(holder);
  return nb::cast(t, nb::rv_policy::take_ownership);
}

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

void bind_transfer(nb::module_& m) {
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
}

}  // namespace ferry_py
