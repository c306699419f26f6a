// SipHash-2-4 (core/siphash.h), against vectors taken from libsodium's
// crypto_shorthash (the implementation it replaces), and the descriptor keys
// RegionRegistry::compute_key made with libsodium before: they must not change,
// or descriptors advertised by an older engine would stop matching.
#include "core/siphash.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/region_registry.h"
#include "guarded_buffer.h"
#include "hex.h"

namespace ferry {
namespace {

using testing::FromHex;
using testing::GuardedBuffer;

struct SipVector {
  const char* key;
  const char* message;
  const char* output;  // the 8 output bytes, as crypto_shorthash writes them
};

constexpr uint64_t kSipSequential[64] = {
    0x726fdb47dd0e0e31ull, 0x74f839c593dc67fdull, 0x0d6c8009d9a94f5aull, 0x85676696d7fb7e2dull,
    0xcf2794e0277187b7ull, 0x18765564cd99a68dull, 0xcbc9466e58fee3ceull, 0xab0200f58b01d137ull,
    0x93f5f5799a932462ull, 0x9e0082df0ba9e4b0ull, 0x7a5dbbc594ddb9f3ull, 0xf4b32f46226bada7ull,
    0x751e8fbc860ee5fbull, 0x14ea5627c0843d90ull, 0xf723ca908e7af2eeull, 0xa129ca6149be45e5ull,
    0x3f2acc7f57c29bdbull, 0x699ae9f52cbe4794ull, 0x4bc1b3f0968dd39cull, 0xbb6dc91da77961bdull,
    0xbed65cf21aa2ee98ull, 0xd0f2cbb02e3b67c7ull, 0x93536795e3a33e88ull, 0xa80c038ccd5ccec8ull,
    0xb8ad50c6f649af94ull, 0xbce192de8a85b8eaull, 0x17d835b85bbb15f3ull, 0x2f2e6163076bcfadull,
    0xde4daaaca71dc9a5ull, 0xa6a2506687956571ull, 0xad87a3535c49ef28ull, 0x32d892fad841c342ull,
    0x7127512f72f27cceull, 0xa7f32346f95978e3ull, 0x12e0b01abb051238ull, 0x15e034d40fa197aeull,
    0x314dffbe0815a3b4ull, 0x027990f029623981ull, 0xcadcd4e59ef40c4dull, 0x9abfd8766a33735cull,
    0x0e3ea96b5304a7d0ull, 0xad0c42d6fc585992ull, 0x187306c89bc215a9ull, 0xd4a60abcf3792b95ull,
    0xf935451de4f21df2ull, 0xa9538f0419755787ull, 0xdb9acddff56ca510ull, 0xd06c98cd5c0975ebull,
    0xe612a3cb9ecba951ull, 0xc766e62cfcadaf96ull, 0xee64435a9752fe72ull, 0xa192d576b245165aull,
    0x0a8787bf8ecb74b2ull, 0x81b3e73d20b49b6full, 0x7fa8220ba3b2eceaull, 0x245731c13ca42499ull,
    0xb78dbfaf3a8d83bdull, 0xea1ad565322a1a0bull, 0x60e61c23a3795013ull, 0x6606d7e446282b93ull,
    0x6ca4ecb15c5f91e1ull, 0x9f626da15c9625f3ull, 0xe51b38608ef25f57ull, 0x958a324ceb064572ull,
};

constexpr SipVector kSipRandom[] = {
    {"24b9c12db3996db36d2a53b3cdfa7fb3", "", "daf49599951f6a36"},
    {"5a47618fe7dec9e6aca02ead354c0527", "d8", "b1d062dd025ac7fd"},
    {"b449e424b5d1247c6667d7e2a2515542", "6333ed09c023d8", "a5584889df7d0c63"},
    {"1106492ff7a5e3c98629cfb8786583e7", "f69bb65066bbd74d", "ec422294a4f96ca1"},
    {"979287f53e8e9c0d51ed551e5a508d84", "a8499bbf8a570cfe13", "99e64430361a7acf"},
    {"c6735b7a6d8d08a9532113a6c36763da", "a8b13022197024a4ab17592b233f25", "bb078a07056236a9"},
    {"e61d552e48c6e045af07a2332977f132", "2164d4e848101ecbfe9d5b1c4b5d844a", "d8b093d567bc150c"},
    {"a960af76f5b93db3cdf749bd88e6bf25", "a981835e17ca99f5b4fd12b2324e1dda3c", "f3652aab460ca2dc"},
    {"1842478466fa7fd908b5343aba3da809", "832226283a85ea3c3d41142943f0117ab6807161fde14094",
     "367f158c530d1c30"},
    {"20af4ba8995223beaab3307fa86c1e00", "dcee19a5690ce87ac7b76f9f38967635754e368005aa7b74e2",
     "d98e7da945b8af9f"},
    {"0f29ed653f047141adbedf8fcda2ea8b", "c3daac03152508412dfa4efd922bdd6c2b922136d8f56f0cf9",
     "e94a0cc51575c2f8"},
    {"3c25f9c85a5508b2bd9675118ef409ba", "359a803e239c9639aeb27b564760e32a15c6e14f0d46abe1f3",
     "9fc7e0644a935d5c"},
    {"e1b60fee685f3408f42463892cc11fbb",
     "74e86f6047a0b81d00887951606b9a93acc98c5ce166e7a24c2282cc52f54b", "d80f0f0c0c696f65"},
    {"977f9be3ccabab6ae1f01d31e5d6f569",
     "5625faf7cddec0c9a72b45e9c451bbcf2cd8077b4590bc544c04d1335b48768e", "cf02b4455160766c"},
    {"bd8dfc0ca80962dc80378683d05b3fb6",
     "20bf065ca065b8ed801681467a051f0043da31e18df4675a27b24b91715978224d", "84fc5344e2c2c1bd"},
    {"f521551497e3ed022b59961640b0af77",
     "57154e476765061b253512c043794c64da17eaa99697c42d3cf46b251e6fd0ac3960f0986a24d937a60b3ae454925"
     "1e5fdcc91a3cc293e1da2ae9a2b11f15a",
     "ffef7d6e99f75f47"},
    {"2aef7cc1d192556b5cdcab4c8fff0eba",
     "1974ee360955885125ce003ae24380a7200325dc279ab410684d66594ccf440233852c643dd2934b71e3717914114"
     "7527ff84d141259e273c2e819fbdaeb8b01",
     "f71c5d5025adfda6"},
    {"1f011bc3d552fee9f0cf163c7467e36c",
     "d643fa87ab3814494d17f831010b822f2743f8b9abc5e40188870ac3012ccc1645efd756e5e5fa1062bbcf4ccc7e6"
     "b69e2c21ebce2fe2ceec606172dcbe65890c8",
     "a2464ca972474d4a"},
    {"e95759afd333b687725c3b562d2a6ae7",
     "3b921a83c5bfa2564147b48a82820fa8a4e842c4f7f5796b966edc4882f9fe8f3638a9357d80bac16c739d8752119"
     "9ac193bea75189b1749c6d6f1e0d3c2f4fccb793e7b40407f6014c32997ead15cd0e01f9f6f9339b134923a051d2f"
     "6216fd62a699b6",
     "9afbc821b6710918"},
    {"7af81d7b3f4473fbcf81847383abf102",
     "cbb55275ce0158a05215562cce8e8e1cb2f28ad11087443a58796bf0ef818e46f2f66c71a83b4e54d9d7d07edf10e"
     "8efccf2e236a10ac9a30a4c2b1e204155a8b7eeb9c52cacf90e93a12e0aafdd822bed5d266b10e7daecca12c54a66"
     "380c6ac45b49d60ef9cbef4d690f33f9d93b6d7195f24bd89aedfe905e214d7b7771",
     "cddacd33c0c7d476"},
    {"2f4dc9e12a5c673aa51539f8661de160",
     "888d2c88c2daf4a6bc8851b81a2dc3235f7dfa0a89fd427c5b4c0e14e3088b030fbf3a1a68e97ca09889638a3e369"
     "b3932bea16cf1fda99d88917f9c10dd980e7dc9ee16b719ef1a006e4bf1e8cf7e76857d1a9947dc9c8f7743775c1b"
     "25ea74d9c9a388197d1b29fe85ac838af0fc45b2bb7130967e3b47f9d6e09f2d5b9611",
     "0d714e5b23d30fb8"},
    {"89a81449f56ac550a2d074d496af0f9d",
     "756f762f2afb8a95919bb3302126329e951ef0a466e4c58f49e4ae05dca4c33a092075240621e37e27678150a9cc0"
     "2d658395d46295206f689e56859dae429fa36136ae14864eeb64c0a77465e6bd114d7fe65c9b857c419eb3f4faa19"
     "13f5c62d44d6a5334a763cddc8d508c06ced2bec44d13b27cec6dd9cb768ebde88e8f00361986cb48e2c305666252"
     "b127d95347fc6d37de61d48b2b6f0b6c0bd1c2df21a5cec001f5922118ab168131ff6530d70b84c9d1bb0c5357b60"
     "2b4fcd98c113e64b1b9c74d53363415d7b2c4fd3df3e1a597759e35ff91143dd55df12e6e5f3721067a162bdf200c"
     "db6b528cb317b1cf2371a96bc614f6ed11f61071f27a0",
     "f26b62ab18cd93e9"},
};

// A 1 MiB message (byte i is uint8_t(i * 31 + 7)) under the key 00..0f.
constexpr uint64_t kSipPattern1MiB = 0xfc6bb7b3ab306166ull;

std::array<uint8_t, 16> SequentialKey() {
  std::array<uint8_t, 16> k{};
  for (int i = 0; i < 16; ++i) k[i] = static_cast<uint8_t>(i);
  return k;
}

TEST(SipHash, PaperVectors) {
  // kSipSequential is also the table of the authors' reference code
  // (vectors.h); kSipSequential[15] is the paper's worked example (appendix A).
  const auto key = SequentialKey();
  std::vector<uint8_t> message(64);
  for (size_t i = 0; i < message.size(); ++i) message[i] = static_cast<uint8_t>(i);
  for (size_t n = 0; n < 64; ++n) {
    // Each message ends right before an unreadable page: no over-read of the tail.
    GuardedBuffer guarded(std::span<const uint8_t>(message.data(), n));
    EXPECT_EQ(siphash24(key, guarded.span()), kSipSequential[n]) << "message length " << n;
  }
}

TEST(SipHash, RandomKeysAndMessages) {
  for (const SipVector& v : kSipRandom) {
    const auto key_bytes = FromHex(v.key);
    const auto message = FromHex(v.message);
    ASSERT_EQ(key_bytes.size(), 16u);
    std::array<uint8_t, 16> key;
    std::memcpy(key.data(), key_bytes.data(), 16);
    const uint64_t h = siphash24(key, message);
    std::vector<uint8_t> out(8);
    std::memcpy(out.data(), &h, 8);  // the u64 in memory is crypto_shorthash's output bytes
    EXPECT_EQ(testing::ToHex(out), v.output) << "message of " << message.size() << " bytes";
  }
}

TEST(SipHash, LongMessage) {
  std::vector<uint8_t> message(1 << 20);
  for (size_t i = 0; i < message.size(); ++i) message[i] = static_cast<uint8_t>(i * 31 + 7);
  EXPECT_EQ(siphash24(SequentialKey(), message), kSipPattern1MiB);
}

TEST(SipHash, EveryKeyAndMessageBitMatters) {
  std::mt19937_64 rng(5);
  std::array<uint8_t, 16> key;
  for (auto& b : key) b = static_cast<uint8_t>(rng());
  std::vector<uint8_t> message(25);
  for (auto& b : message) b = static_cast<uint8_t>(rng());
  const uint64_t base = siphash24(key, message);
  for (size_t bit = 0; bit < key.size() * 8; ++bit) {
    auto k = key;
    k[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    EXPECT_NE(siphash24(k, message), base) << "key bit " << bit;
  }
  for (size_t bit = 0; bit < message.size() * 8; ++bit) {
    auto m = message;
    m[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    EXPECT_NE(siphash24(key, m), base) << "message bit " << bit;
  }
  // A trailing zero byte changes the length byte, hence the hash.
  auto longer = message;
  longer.push_back(0);
  EXPECT_NE(siphash24(key, longer), base);
}

struct RegionKeyVector {
  const char* secret;
  uint64_t region_id;
  uint64_t adv_offset;
  uint64_t adv_length;
  uint8_t access;
  uint64_t key;
};

// RegionRegistry::compute_key as it was with libsodium (a build of the
// previous commit): same secret and range, same key.
constexpr RegionKeyVector kRegionKeys[] = {
    {"802527a7cfbd815aff71e71aed215700", 1ull, 0ull, 6666946394006ull, 1, 0xaa1dd3dc519002fdull},
    {"64e45d3e4adafc56866b5bd4c760eea8", 2ull, 10807060961091ull, 18446744073709551615ull, 2,
     0xd9bc644e71dd0e3full},
    {"a0ad059bbc48fe692b390a65625c23bd", 62312059865056ull, 11500565135358ull, 5658650143924ull, 3,
     0xeaa700e4807e0280ull},
    {"5835332187ae21af301ace25d70a3a09", 1956536937ull, 15109608075418ull, 4080279621850ull, 1,
     0x9baab9bd652181b9ull},
    {"b3de1d453d2dd60d5099fdbf7396fc2c", 111410870838ull, 8687456582367ull, 7316609023609ull, 2,
     0x505d63a88125f153ull},
    {"dadf3f0173056f8996214d51743119a4", 134256483924645ull, 17146637219021ull, 15307153695561ull,
     3, 0x65a5a40ae182a2a0ull},
    {"a6ebcc9b300595656469978ef3603e61", 1408ull, 99030361536ull, 9441533278164ull, 1,
     0xa06f222d11935d3eull},
    {"90f663304a42209062b4d4378ff129bd", 1677262261928245ull, 11584334189058ull, 6815341747691ull,
     2, 0xa673a48fd7e8de34ull},
};

TEST(SipHash, RegionKeysUnchanged) {
  for (const RegionKeyVector& v : kRegionKeys) {
    Region region;
    const auto secret = FromHex(v.secret);
    ASSERT_EQ(secret.size(), sizeof region.secret);
    std::memcpy(region.secret, secret.data(), sizeof region.secret);
    region.info.id = v.region_id;
    EXPECT_EQ(RegionRegistry::compute_key(region, v.adv_offset, v.adv_length, v.access), v.key)
        << "region " << v.region_id;
  }
}

}  // namespace
}  // namespace ferry
