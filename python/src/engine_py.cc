// ferry.Engine: creating one from options, registering memory, connecting to
// peers, the directory (publish/lookup), notifications and closing.
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ferry_py_internal.h"

using namespace nb::literals;

namespace ferry_py {
namespace {

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

void bind_engine(nb::module_& m) {
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
      .def_prop_ro(
          "dropped_notifications",
          [](PyEngine& e) { return e.box->get()->dropped_notifications(); },
          "Notifications dropped because those not yet taken already held the option "
          "engine.notification_queue_bytes (256 MiB); 0 while they are taken.")
      .def("close", &PyEngine::close,
           "Deregister every region and shut the engine down. Idempotent.")
      .def("__enter__", [](nb::handle self) { return nb::borrow(self); })
      .def("__exit__", [](PyEngine& e, nb::args) { e.close(); })
      .def("__repr__", &PyEngine::repr);
}

}  // namespace ferry_py
