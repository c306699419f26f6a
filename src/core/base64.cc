#include "core/base64.h"

#include <array>

#include "fmt/format.h"

namespace ferry {
namespace {

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
constexpr uint8_t kInvalid = 0xff;

constexpr std::array<uint8_t, 256> make_decode_table() {
  std::array<uint8_t, 256> t{};
  for (auto& v : t) v = kInvalid;
  for (uint8_t i = 0; i < 64; ++i) t[static_cast<uint8_t>(kAlphabet[i])] = i;
  return t;
}
constexpr std::array<uint8_t, 256> kDecode = make_decode_table();

std::string describe(char c) {
  const auto u = static_cast<unsigned char>(c);
  if (u >= 0x21 && u < 0x7f) return fmt::format("'{}'", c);
  return fmt::format("byte {:#04x}", u);
}

}  // namespace

std::string base64_encode(std::span<const uint8_t> bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const uint32_t v = (uint32_t{bytes[i]} << 16) | (uint32_t{bytes[i + 1]} << 8) | bytes[i + 2];
    out += kAlphabet[v >> 18];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += kAlphabet[v & 63];
  }
  const size_t rest = bytes.size() - i;
  if (rest > 0) {
    const uint32_t v = (uint32_t{bytes[i]} << 16) | (rest == 2 ? uint32_t{bytes[i + 1]} << 8 : 0);
    out += kAlphabet[v >> 18];
    out += kAlphabet[(v >> 12) & 63];
    out += rest == 2 ? kAlphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

Result<std::vector<uint8_t>> base64_decode(std::string_view text) {
  if (text.size() % 4 != 0) {
    return err::InvalidArgument(fmt::format(
        "base64: length {} is not a multiple of 4 (truncated or unpadded?)", text.size()));
  }
  // '=' may only end the text, once or twice.
  size_t padding = 0;
  while (padding < 2 && padding < text.size() && text[text.size() - 1 - padding] == '=') {
    ++padding;
  }
  const size_t chars = text.size() - padding;
  std::vector<uint8_t> out;
  out.reserve(text.size() / 4 * 3);
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < chars; ++i) {
    const uint8_t v = kDecode[static_cast<uint8_t>(text[i])];
    if (v == kInvalid) {
      return err::InvalidArgument(
          text[i] == '='
              ? fmt::format("base64: '=' at offset {} of {}: padding may only end the text", i,
                            text.size())
              : fmt::format("base64: {} at offset {} is not in the standard alphabet",
                            describe(text[i]), i));
    }
    acc = (acc << 6) | v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<uint8_t>(acc >> bits));
      acc &= (1u << bits) - 1;
    }
  }
  // Canonical: the bits over after the last byte of a padded group (4 after
  // 2 characters, 2 after 3) must be zero. (With the length a multiple of 4
  // and at most two '=', a group of one character cannot occur.)
  if (acc != 0) {
    return err::InvalidArgument(fmt::format(
        "base64: the last character {} leaves non-zero bits after the last byte (not canonical)",
        describe(text[chars - 1])));
  }
  return out;
}

}  // namespace ferry
