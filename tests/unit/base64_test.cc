// Base64 (core/base64.h): RFC 4648's examples, encodings taken from
// libsodium's sodium_bin2base64 (the implementation it replaces), the inputs
// sodium_base642bin refused and accepted, malformed text of every kind, and
// random round trips.
#include "core/base64.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "guarded_buffer.h"
#include "hex.h"

namespace ferry {
namespace {

using testing::FromHex;

std::vector<uint8_t> Bytes(std::string_view s) {
  return {s.begin(), s.end()};
}

struct Base64Vector {
  const char* bytes;  // hex
  const char* text;
};

constexpr Base64Vector kBase64Random[] = {
    {"", ""},
    {"24", "JA=="},
    {"b9c1", "ucE="},
    {"2db399", "LbOZ"},
    {"6db36d2a", "bbNtKg=="},
    {"53b3cdfa7f", "U7PN+n8="},
    {"b35a47618fe7", "s1pHYY/n"},
    {"dec9e6aca02ead", "3snmrKAurQ=="},
    {"354c0527d8b449e4", "NUwFJ9i0SeQ="},
    {"24b5d1247c6667d7e2", "JLXRJHxmZ9fi"},
    {"a25155426333ed09c023", "olFVQmMz7QnAIw=="},
    {"d81106492ff7a5e3c98629", "2BEGSS/3pePJhik="},
    {"cfb8786583e7f69bb65066bb", "z7h4ZYPn9pu2UGa7"},
    {"d74d979287f53e8e9c0d51ed55", "102Xkof1Po6cDVHtVQ=="},
    {"1e5a508d84a8499bbf8a570cfe13", "HlpQjYSoSZu/ilcM/hM="},
    {"c6735b7a6d8d08a9532113a6c36763", "xnNbem2NCKlTIROmw2dj"},
    {"daa8b13022197024a4ab17592b233f25", "2qixMCIZcCSkqxdZKyM/JQ=="},
    {"e61d552e48c6e045af07a2332977f13221", "5h1VLkjG4EWvB6IzKXfxMiE="},
    {"64d4e848101ecbfe9d5b1c4b5d844aa960af", "ZNToSBAey/6dWxxLXYRKqWCv"},
    {"76f5b93db3cdf749bd88e6bf25a981835e17ca", "dvW5PbPN90m9iOa/JamBg14Xyg=="},
    {"99f5b4fd12b2324e1dda3c1842478466fa7fd908", "mfW0/RKyMk4d2jwYQkeEZvp/2Qg="},
    {"b5343aba3da809832226283a85ea3c3d41142943f0117ab6807161fde1409420af4ba8995223beaab3307fa86c1e0"
     "0",
     "tTQ6uj2oCYMiJig6heo8PUEUKUPwEXq2gHFh/eFAlCCvS6iZUiO+qrMwf6hsHgA="},
    {"dcee19a5690ce87ac7b76f9f38967635754e368005aa7b74e20f29ed653f047141adbedf8fcda2ea8bc3daac03152"
     "508",
     "3O4ZpWkM6HrHt2+fOJZ2NXVONoAFqnt04g8p7WU/BHFBrb7fj82i6ovD2qwDFSUI"},
    {"412dfa4efd922bdd6c2b922136d8f56f0cf93c25f9c85a5508b2bd9675118ef409ba359a803e239c9639aeb27b564"
     "760e3",
     "QS36Tv2SK91sK5IhNtj1bwz5PCX5yFpVCLK9lnURjvQJujWagD4jnJY5rrJ7Vkdg4w=="},
    {"2a15c6e14f0d46abe1f3e1b60fee685f3408f42463892cc11fbb74e86f6047a0b81d00887951606b9a93acc98c5ce"
     "166e7a24c2282cc52f54b977f9be3ccabab6ae1f01d31e5d6f5695625faf7cddec0c9a72b45e9c451bbcf2cd8077b"
     "4590bc544c04d1",
     "KhXG4U8NRqvh8+G2D+5oXzQI9CRjiSzBH7t06G9gR6C4HQCIeVFga5qTrMmMXOFm56JMIoLMUvVLl3+"
     "b48yrq2rh8B0x5db1aVYl+vfN3sDJpytF6cRRu88s2Ad7RZC8VEwE0Q=="},
};

TEST(Base64, Rfc4648Examples) {
  const std::pair<const char*, const char*> kExamples[] = {
      {"", ""},
      {"f", "Zg=="},
      {"fo", "Zm8="},
      {"foo", "Zm9v"},
      {"foob", "Zm9vYg=="},
      {"fooba", "Zm9vYmE="},
      {"foobar", "Zm9vYmFy"},
  };
  for (const auto& [plain, text] : kExamples) {
    EXPECT_EQ(base64_encode(Bytes(plain)), text);
    auto decoded = base64_decode(text);
    ASSERT_TRUE(decoded.ok()) << text << ": " << decoded.status().to_string();
    EXPECT_EQ(*decoded, Bytes(plain)) << text;
  }
}

TEST(Base64, SameAsLibsodium) {
  for (const Base64Vector& v : kBase64Random) {
    const auto bytes = FromHex(v.bytes);
    EXPECT_EQ(base64_encode(bytes), v.text);
    auto decoded = base64_decode(v.text);
    ASSERT_TRUE(decoded.ok()) << v.text << ": " << decoded.status().to_string();
    EXPECT_EQ(*decoded, bytes) << v.text;
  }
}

TEST(Base64, EveryByteValue) {
  std::vector<uint8_t> all(256);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint8_t>(i);
  const std::string text = base64_encode(all);
  EXPECT_EQ(text.substr(0, 8), "AAECAwQF");
  EXPECT_EQ(text.substr(text.size() - 8), "/P3+/w==");  // as Python's base64
  auto decoded = base64_decode(text);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(*decoded, all);
}

// What sodium_base642bin (original variant, nothing ignored) said of each.
TEST(Base64, AcceptsAndRefusesAsLibsodiumDid) {
  const std::pair<const char*, bool> kVerdicts[] = {
      {"", true},          {"Zg==", true},      {"Zm8=", true},    {"Zm9v", true},
      {"Zm9vYg==", true},  {"Zm9vYmE=", true},  {"Zg", false},     {"Zg=", false},
      {"Zh==", false},     {"Zm9=", false},     {"Zm9vYg", false}, {"Zm9v=", false},
      {"Zm9v====", false}, {"Zg==Zg==", false}, {"Z===", false},   {"Z", false},
      {"Zm 9v", false},    {"Zm9v\\n", false},  {"Zm-v", false},   {"Zm_v", false},
      {"=Zm9", false},     {"Zm=v", false},     {"Zg=A", false},   {"Zm9vYmF=", false},
      {"====", false},     {"Zm9vY", false},
  };
  for (const auto& [text, accepted] : kVerdicts) {
    EXPECT_EQ(base64_decode(text).ok(), accepted) << "'" << text << "'";
  }
}

// The message says what is wrong and where.
void ExpectRefused(std::string_view text, std::string_view says) {
  auto r = base64_decode(text);
  ASSERT_FALSE(r.ok()) << "'" << text << "' was accepted";
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(says), std::string::npos)
      << "'" << text << "': " << r.status().message();
}

TEST(Base64, DecodeErrorsSayWhy) {
  ExpectRefused("Zg", "length 2 is not a multiple of 4");
  ExpectRefused("Zm9vY", "length 5 is not a multiple of 4");
  ExpectRefused("Zm9v=", "length 5");
  ExpectRefused("Zm 9", "byte 0x20 at offset 2 is not in the standard alphabet");
  ExpectRefused("Zm9\n", "byte 0x0a at offset 3");
  ExpectRefused("Zm\\v", "'\\' at offset 2");
  ExpectRefused(std::string_view("Zm\09v", 4), "byte 0x00 at offset 2");
  ExpectRefused("Zm-v", "'-' at offset 2 is not in the standard alphabet");
  ExpectRefused("Zm_v", "'_' at offset 2");
  ExpectRefused("Zm9v\xff\xff\xff\xff", "byte 0xff at offset 4");
  ExpectRefused("=Zm9", "'=' at offset 0 of 4: padding may only end the text");
  ExpectRefused("Zm=v", "'=' at offset 2");
  ExpectRefused("Zg==Zg==", "'=' at offset 2 of 8");
  ExpectRefused("Z===", "'=' at offset 1");
  ExpectRefused("====", "'=' at offset 0");
  ExpectRefused("Zh==", "the last character 'h' leaves non-zero bits");
  ExpectRefused("Zm9=", "the last character '9' leaves non-zero bits");
}

TEST(Base64, EveryCharacterOutsideTheAlphabetIsRefused) {
  const std::string alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  for (int c = 0; c < 256; ++c) {
    std::string text = "QUJD";  // "ABC"
    for (size_t at = 0; at < text.size(); ++at) {
      std::string t = text;
      t[at] = static_cast<char>(c);
      const bool in_alphabet = alphabet.find(static_cast<char>(c)) != std::string::npos;
      // '=' last is padding, and then "QUJ=" leaves bits of 'J' over: refused too.
      EXPECT_EQ(base64_decode(t).ok(), in_alphabet) << "byte " << c << " at " << at;
    }
  }
}

TEST(Base64, RandomRoundTrips) {
  std::mt19937_64 rng(11);
  for (size_t n = 0; n < 600; ++n) {
    std::vector<uint8_t> bytes(n < 300 ? n : rng() % 5000);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    const std::string text = base64_encode(bytes);
    ASSERT_EQ(text.size(), (bytes.size() + 2) / 3 * 4);
    // Decoding reads the text only: it ends right before an unreadable page.
    testing::GuardedBuffer guarded(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
    auto decoded = base64_decode(std::string_view(
        reinterpret_cast<const char*>(guarded.span().data()), guarded.span().size()));
    ASSERT_TRUE(decoded.ok()) << decoded.status().to_string();
    ASSERT_EQ(*decoded, bytes);
    // Cut short by 1 to 3 characters: refused, never a shorter result.
    for (size_t cut = 1; cut < 4 && cut <= text.size(); ++cut) {
      EXPECT_FALSE(base64_decode(std::string_view(text).substr(0, text.size() - cut)).ok());
    }
  }
}

}  // namespace
}  // namespace ferry
