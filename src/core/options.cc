#include "core/options.h"

#include <cctype>
#include <charconv>
#include <cstdlib>
#include <set>

#include "fmt/format.h"

namespace ferry {
namespace {

const char* type_name(OptionType t) {
  switch (t) {
    case OptionType::kUint:
      return "uint";
    case OptionType::kBytes:
      return "bytes";
    case OptionType::kBool:
      return "bool";
    case OptionType::kString:
      return "string";
    case OptionType::kDurationMs:
      return "duration_ms";
  }
  return "?";
}

Result<uint64_t> parse_uint(std::string_view text) {
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || p != text.data() + text.size() || text.empty()) {
    return err::InvalidArgument(fmt::format("'{}' is not an unsigned integer", text));
  }
  return v;
}

Result<uint64_t> parse_value(const OptionSpec& spec, std::string_view text) {
  switch (spec.type) {
    case OptionType::kUint:
    case OptionType::kDurationMs:
      return parse_uint(text);
    case OptionType::kBytes:
      return parse_byte_size(text);
    case OptionType::kBool: {
      auto b = parse_bool(text);
      if (!b.ok()) return b.status();
      return uint64_t{*b ? 1u : 0u};
    }
    case OptionType::kString:
      return uint64_t{0};
  }
  return err::Internal("unknown option type");
}

}  // namespace

Result<bool> parse_bool(std::string_view text) {
  if (text == "1" || text == "true" || text == "yes" || text == "on") return true;
  if (text == "0" || text == "false" || text == "no" || text == "off") return false;
  return err::InvalidArgument(fmt::format("'{}' is not a boolean (true/false)", text));
}

std::string option_env_name(std::string_view option_name) {
  std::string env = "FERRY_";
  for (char c : option_name) {
    env += (c == '.' || c == '-') ? '_'
                                  : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  return env;
}

Result<uint64_t> parse_byte_size(std::string_view text) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  if (digits == 0) return err::InvalidArgument(fmt::format("'{}' is not a byte size", text));
  auto number = parse_uint(text.substr(0, digits));
  if (!number.ok()) return number.status();
  std::string unit(text.substr(digits));
  for (auto& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  uint64_t scale = 0;
  if (unit.empty() || unit == "b")
    scale = 1;
  else if (unit == "k" || unit == "kib")
    scale = 1ull << 10;
  else if (unit == "m" || unit == "mib")
    scale = 1ull << 20;
  else if (unit == "g" || unit == "gib")
    scale = 1ull << 30;
  else if (unit == "kb")
    scale = 1000;
  else if (unit == "mb")
    scale = 1000 * 1000;
  else if (unit == "gb")
    scale = 1000ull * 1000 * 1000;
  else
    return err::InvalidArgument(fmt::format("'{}' has an unknown size unit '{}'", text, unit));
  if (*number > UINT64_MAX / scale) {
    return err::InvalidArgument(fmt::format("'{}' overflows 64 bits", text));
  }
  return *number * scale;
}

Result<OptionSet> OptionSet::resolve(std::span<const OptionSpec> specs,
                                     const std::map<std::string, std::string>& given) {
  std::set<std::string_view> known;
  for (const auto& s : specs) known.insert(s.name);
  for (const auto& [name, value] : given) {
    if (!known.count(name)) {
      std::string all;
      for (auto k : known) all += fmt::format("{}{}", all.empty() ? "" : ", ", k);
      return err::InvalidArgument(fmt::format("unknown option '{}' (known: {})", name, all));
    }
  }
  OptionSet set;
  for (const auto& spec : specs) {
    std::string text = spec.default_value;
    std::string source = "default";
    const std::string env = option_env_name(spec.name);
    if (auto it = given.find(spec.name); it != given.end()) {
      text = it->second;
      source = "config";
    } else if (const char* e = std::getenv(env.c_str()); e != nullptr) {
      text = e;
      source = "environment " + env;
    }
    auto parsed = parse_value(spec, text);
    if (!parsed.ok()) {
      return err::InvalidArgument(
          fmt::format("option {} (from {}): {}", spec.name, source, parsed.status().message()));
    }
    if (spec.type != OptionType::kString && spec.type != OptionType::kBool &&
        (*parsed < spec.min || *parsed > spec.max)) {
      return err::InvalidArgument(fmt::format("option {} (from {}) = {} is outside [{}, {}]",
                                              spec.name, source, text, spec.min, spec.max));
    }
    set.values_[spec.name] = Value{text, *parsed};
    set.infos_.push_back(OptionInfo{spec.name, type_name(spec.type), text, source, spec.doc});
  }
  return set;
}

const OptionSet::Value& OptionSet::at(std::string_view name) const {
  auto it = values_.find(name);
  if (it == values_.end()) {
    // A component asking for an option it never declared is a programming error
    // caught by the tests; answer with an empty value rather than crash.
    static const Value kEmpty;
    return kEmpty;
  }
  return it->second;
}

uint64_t OptionSet::get_uint(std::string_view name) const {
  return at(name).number;
}
bool OptionSet::get_bool(std::string_view name) const {
  return at(name).number != 0;
}
const std::string& OptionSet::get_string(std::string_view name) const {
  return at(name).text;
}

}  // namespace ferry
