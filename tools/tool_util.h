// Small helpers shared by ferry-bench and ferry-info: byte-size parsing and
// printing, hex, /proc/self/status, percentiles. Public API only.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/types.h"

namespace ferry::tools {

// "4096", "4KiB", "4K", "4k", "1MiB", "1M", "16MiB", "2GiB" (binary), "4KB",
// "1MB", "1GB" (decimal). Returns nullopt on anything else.
std::optional<uint64_t> parse_size(std::string_view text);
// 4096 -> "4KiB", 1179648 -> "1152KiB", 1000 -> "1000B".
std::string format_size(uint64_t bytes);

std::string to_hex(ferry::ByteView bytes);
std::optional<ferry::Bytes> from_hex(std::string_view hex);

// VmRSS / VmHWM of a process in KiB (pid 0 = self); -1 when unreadable.
long proc_status_kib(int pid, const char* field);

// q in [0,1]; sorts `v` in place. 0 for an empty vector.
double percentile(std::vector<double>& v, double q);

std::vector<std::string> split(std::string_view s, char sep);
std::string trim(std::string_view s);

}  // namespace ferry::tools
