// Declared, typed, printable options (DESIGN.md §7). Each component declares a
// table of OptionSpec; OptionSet resolves them from the engine config and the
// FERRY_<COMPONENT>_<NAME> environment. Absent → default; invalid → error.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "ferry/engine.h"
#include "ferry/status.h"

namespace ferry {

enum class OptionType { kUint, kBytes, kBool, kString, kDurationMs };

struct OptionSpec {
  const char* name;  // "tcp.streams"
  OptionType type;
  const char* default_value;
  const char* doc;
  uint64_t min = 0;  // for numeric types
  uint64_t max = UINT64_MAX;
};

// "FERRY_TCP_STREAMS" for "tcp.streams".
std::string option_env_name(std::string_view option_name);
// Parses "4KiB", "1MiB", "1048576", "2GB" (decimal) into bytes.
Result<uint64_t> parse_byte_size(std::string_view text);
// Parses 1/true/yes/on and 0/false/no/off, as boolean options take them.
Result<bool> parse_bool(std::string_view text);

class OptionSet {
 public:
  // Resolves every spec; unknown names in `given` and invalid values are errors.
  static Result<OptionSet> resolve(std::span<const OptionSpec> specs,
                                   const std::map<std::string, std::string>& given);

  uint64_t get_uint(std::string_view name) const;  // also bytes and durations
  bool get_bool(std::string_view name) const;
  const std::string& get_string(std::string_view name) const;
  const std::vector<OptionInfo>& list() const { return infos_; }

 private:
  struct Value {
    std::string text;
    uint64_t number = 0;
  };
  const Value& at(std::string_view name) const;
  std::map<std::string, Value, std::less<>> values_;
  std::vector<OptionInfo> infos_;
};

}  // namespace ferry
