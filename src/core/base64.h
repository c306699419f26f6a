// Base64 (RFC 4648, section 4): the standard alphabet with '=' padding, as
// etcd's JSON gateway carries keys and values. Decoding is strict: it accepts
// exactly what encoding produces and says what is wrong with anything else.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"

namespace ferry {

std::string base64_encode(std::span<const uint8_t> bytes);

// The bytes `text` encodes, or InvalidArgument when it is not canonical
// base64: a length not a multiple of 4, a character outside the alphabet
// (whitespace and the URL-safe '-' '_' included), '=' anywhere but the one or
// two last places, or non-zero bits left over in the last character.
Result<std::vector<uint8_t>> base64_decode(std::string_view text);

}  // namespace ferry
