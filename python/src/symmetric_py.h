// Python bindings of symmetric memory and the MoE exchange
// (include/ferry/symmetric.h, include/ferry/moe.h); ferry/symmetric.py wraps them.
#pragma once

#include <nanobind/nanobind.h>

namespace ferry_py {

// Adds _SymmetricMemory, _MoeExchange and _moe_layout to the module.
void bind_symmetric(nanobind::module_& m);

}  // namespace ferry_py
