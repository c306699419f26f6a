// ferry.Peer: a connected remote engine, and its one-sided writes and reads
// given as lists of (buffer-or-region, offset, length) and (descriptor,
// offset, length) entries; the column (numpy) forms are in batch_py.cc.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "ferry_py_internal.h"

using namespace nb::literals;

namespace ferry_py {

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

// Posts local/remote (already built) and completes per `async_`.
nb::object PyPeer::submit(Op op, std::span<const ferry::LocalIov> local,
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
  return make_transfer(box, tid, op_name(op), local.size(), total_bytes, std::move(holder));
}

// local: list of (buffer-or-region[, offset[, length]]) or one such entry;
// remote: list of (descriptor[, offset[, length]]) or one such entry.
nb::object PyPeer::transfer(Op op, nb::handle local, nb::handle remote, nb::handle notify,
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
nb::object PyPeer::as_entry_list(nb::handle h, bool remote) {
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

void PyPeer::split_entry(nb::handle e, nb::handle& obj, nb::handle& off, nb::handle& len,
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

void PyPeer::notify(nb::handle payload) {
  auto eng = box->get();
  ByteSpan s(payload, "payload");
  ferry::Bytes copy(s.span.begin(), s.span.end());
  const uint64_t peer = id;
  check(without_gil([&] { return eng->notify(peer, copy); }));
}

std::string PyPeer::repr() const {
  char buf[64];
  std::snprintf(buf, sizeof buf, "<ferry.Peer id=0x%016llx>", static_cast<unsigned long long>(id));
  return buf;
}

void bind_peer(nb::module_& m) {
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
}

}  // namespace ferry_py
