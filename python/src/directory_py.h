// Python bindings of the etcd metadata directory (include/ferry/directory.h):
// ferry/directory.py's EtcdDirectory is a thin layer over them, so C++ and
// Python share one etcd client.
#pragma once

#include <nanobind/nanobind.h>

namespace ferry_py {

// Adds _Directory to the module.
void bind_directory(nanobind::module_& m);

}  // namespace ferry_py
