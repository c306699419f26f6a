// Python bindings of the batched local copy (include/ferry/gpu.h).
#pragma once

#include <nanobind/nanobind.h>

namespace ferry_py {

// Adds cuda_available, cuda_unavailable_reason, cuda_device_count,
// copy_blocks and _CopyStream to the module.
void bind_gpu_copy(nanobind::module_& m);

}  // namespace ferry_py
