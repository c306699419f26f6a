// Names the calling thread (as top -H, perf and gdb show it) so that a user
// can tell Ferry's threads from the application's. Linux keeps 15 bytes.
#pragma once

#include <pthread.h>

#include <string>

namespace ferry {

inline void name_this_thread(const std::string& name) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

}  // namespace ferry
