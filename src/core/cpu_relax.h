#pragma once

// A hint to the CPU that this thread spins on a memory location: lets the
// sibling hyper-thread run and saves power, without giving up the core.
namespace ferry {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace ferry
