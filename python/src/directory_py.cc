#include "directory_py.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "ferry/directory.h"
#include "status_error.h"

namespace nb = nanobind;

namespace ferry_py {
namespace {

using Millis = std::chrono::milliseconds;

Millis millis(double seconds) {
  return Millis(seconds <= 0 ? 0 : static_cast<int64_t>(seconds * 1000.0 + 0.5));
}

// Runs f without the GIL: every directory call may wait on the store.
template <typename F>
auto unlocked(F&& f) {
  nb::gil_scoped_release release;
  return f();
}

nb::bytes to_py(const ferry::Bytes& b) {
  return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
}

ferry::ByteView view(const nb::bytes& b) {
  return {reinterpret_cast<const uint8_t*>(b.c_str()), b.size()};
}

// One open ferry::Directory. close() revokes its lease (the C++ destructor);
// every call after it is InvalidArgument, never a use of a freed object.
class PyDirectory {
 public:
  explicit PyDirectory(std::unique_ptr<ferry::Directory> d) : dir_(std::move(d)) {}

  ferry::Directory& get() {
    if (!dir_) raise(ferry::StatusCode::kInvalidArgument, "the directory is closed");
    return *dir_;
  }

  void close() {
    std::unique_ptr<ferry::Directory> gone;
    {
      std::lock_guard lock(mu_);
      gone = std::move(dir_);
    }
    nb::gil_scoped_release release;
    gone.reset();  // revokes the lease: every entry vanishes now
  }

  bool closed() const { return !dir_; }

 private:
  std::mutex mu_;
  std::unique_ptr<ferry::Directory> dir_;
};

}  // namespace

void bind_directory(nb::module_& m) {
  nb::class_<PyDirectory>(m, "_Directory",
                          "ferry::Directory over etcd (use ferry.directory.EtcdDirectory)")
      .def_static(
          "open",
          [](const std::string& url, int ttl, double connect_timeout, double request_timeout,
             double claim_wait, const std::string& holder, const std::string& gateway_prefix) {
            ferry::DirectoryOptions o;
            o.lease_ttl = std::chrono::seconds(ttl);
            o.connect_timeout = millis(connect_timeout);
            o.request_timeout = millis(request_timeout);
            o.claim_wait = millis(claim_wait);
            o.holder = holder;
            o.gateway_prefix = gateway_prefix;
            return new PyDirectory(
                unwrap(unlocked([&] { return ferry::Directory::open(url, o); })));
          },
          nb::arg("url"), nb::arg("ttl"), nb::arg("connect_timeout"), nb::arg("request_timeout"),
          nb::arg("claim_wait"), nb::arg("holder"), nb::arg("gateway_prefix"),
          nb::rv_policy::take_ownership)
      .def("publish_engine",
           [](PyDirectory& self, const std::string& name, const nb::bytes& metadata) {
             auto& d = self.get();
             const ferry::ByteView v = view(metadata);
             check(unlocked([&] { return d.publish_engine(name, v); }));
           })
      .def("lookup_engine",
           [](PyDirectory& self, const std::string& name, double timeout) {
             auto& d = self.get();
             return to_py(unwrap(unlocked([&] { return d.lookup_engine(name, millis(timeout)); })));
           })
      .def("publish",
           [](PyDirectory& self, const std::string& name, const std::string& key,
              const nb::bytes& value) {
             auto& d = self.get();
             const ferry::ByteView v = view(value);
             check(unlocked([&] { return d.publish(name, key, v); }));
           })
      .def("lookup",
           [](PyDirectory& self, const std::string& name, const std::string& key, double timeout) {
             auto& d = self.get();
             return to_py(unwrap(unlocked([&] { return d.lookup(name, key, millis(timeout)); })));
           })
      .def("unpublish_engine",
           [](PyDirectory& self, const std::string& name) {
             auto& d = self.get();
             check(unlocked([&] { return d.unpublish_engine(name); }));
           })
      .def("engines",
           [](PyDirectory& self) {
             auto& d = self.get();
             return unwrap(unlocked([&] { return d.engines(); }));
           })
      .def("health", [](PyDirectory& self) { check(self.get().health()); })
      .def_prop_ro("endpoint", [](PyDirectory& self) { return self.get().endpoint(); })
      .def_prop_ro("prefix", [](PyDirectory& self) { return self.get().prefix(); })
      .def_prop_ro("lease_id", [](PyDirectory& self) { return self.get().lease_id(); })
      .def_prop_ro("closed", &PyDirectory::closed)
      .def("close", &PyDirectory::close);
}

}  // namespace ferry_py
