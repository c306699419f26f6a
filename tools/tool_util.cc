#include "tool_util.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace ferry::tools {

std::optional<uint64_t> parse_size(std::string_view text) {
  std::string t = trim(text);
  if (t.empty()) return std::nullopt;
  size_t i = 0;
  uint64_t n = 0;
  while (i < t.size() && std::isdigit(static_cast<unsigned char>(t[i]))) {
    uint64_t d = static_cast<uint64_t>(t[i] - '0');
    if (n > (UINT64_MAX - d) / 10) return std::nullopt;
    n = n * 10 + d;
    ++i;
  }
  if (i == 0) return std::nullopt;
  std::string unit = t.substr(i);
  for (auto& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  uint64_t mult = 1;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kib") mult = 1ull << 10;
  else if (unit == "m" || unit == "mib") mult = 1ull << 20;
  else if (unit == "g" || unit == "gib") mult = 1ull << 30;
  else if (unit == "kb") mult = 1000ull;
  else if (unit == "mb") mult = 1000ull * 1000;
  else if (unit == "gb") mult = 1000ull * 1000 * 1000;
  else return std::nullopt;
  if (n != 0 && mult > UINT64_MAX / n) return std::nullopt;
  return n * mult;
}

std::string format_size(uint64_t b) {
  char buf[64];
  if (b >= (1ull << 30) && b % (1ull << 30) == 0) {
    std::snprintf(buf, sizeof buf, "%lluGiB", static_cast<unsigned long long>(b >> 30));
  } else if (b >= (1ull << 20) && b % (1ull << 20) == 0) {
    std::snprintf(buf, sizeof buf, "%lluMiB", static_cast<unsigned long long>(b >> 20));
  } else if (b >= (1ull << 10) && b % (1ull << 10) == 0) {
    std::snprintf(buf, sizeof buf, "%lluKiB", static_cast<unsigned long long>(b >> 10));
  } else {
    std::snprintf(buf, sizeof buf, "%lluB", static_cast<unsigned long long>(b));
  }
  return buf;
}

std::string to_hex(ferry::ByteView bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

std::optional<ferry::Bytes> from_hex(std::string_view hex) {
  if (hex.size() % 2 != 0) return std::nullopt;
  auto val = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  ferry::Bytes out(hex.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    int hi = val(hex[2 * i]), lo = val(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return out;
}

long proc_status_kib(int pid, const char* field) {
  std::string path = pid == 0 ? std::string("/proc/self/status")
                              : "/proc/" + std::to_string(pid) + "/status";
  std::ifstream in(path);
  std::string line;
  size_t flen = std::strlen(field);
  while (std::getline(in, line)) {
    if (line.compare(0, flen, field) == 0 && line.size() > flen && line[flen] == ':') {
      return std::strtol(line.c_str() + flen + 1, nullptr, 10);
    }
  }
  return -1;
}

double percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  double pos = q * static_cast<double>(v.size() - 1);
  size_t lo = static_cast<size_t>(std::floor(pos));
  size_t hi = std::min(lo + 1, v.size() - 1);
  double frac = pos - static_cast<double>(lo);
  return v[lo] * (1.0 - frac) + v[hi] * frac;
}

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t p = s.find(sep, start);
    out.emplace_back(trim(s.substr(start, p == std::string_view::npos ? s.npos : p - start)));
    if (p == std::string_view::npos) break;
    start = p + 1;
  }
  return out;
}

std::string trim(std::string_view s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return std::string(s.substr(a, b - a));
}

}  // namespace ferry::tools
