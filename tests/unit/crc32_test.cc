// CRC-32 (core/crc32.h) against zlib's crc32 (the implementation it
// replaces), in one piece and in pieces, and the bytes of a descriptor and of
// engine metadata as the build with zlib encoded them: checksums on the wire
// must not change.
#include "core/crc32.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string_view>
#include <vector>

#include "core/metadata.h"
#include "ferry/types.h"
#include "guarded_buffer.h"
#include "hex.h"

namespace ferry {
namespace {

using testing::FromHex;

std::span<const uint8_t> Text(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

struct CrcVector {
  const char* bytes;  // hex
  uint32_t crc;
};

constexpr CrcVector kCrcRandom[] = {
    {"24", 0xee010b5cu},
    {"b9c1", 0x98bdf528u},
    {"2db399", 0x89efda3au},
    {"6db36d2a", 0x24f86cb7u},
    {"53b3cdfa7f", 0x01c8c3fbu},
    {"b35a47618fe7de", 0xd29073a8u},
    {"c9e6aca02ead354c", 0x32548768u},
    {"0527d8b449e424b5d1247c6667d7e2", 0x64f2aa00u},
    {"a25155426333ed09c023d81106492ff7", 0xa5c2170du},
    {"a5e3c98629cfb8786583e7f69bb65066bbd74d979287f53e8e9c0d51ed551e", 0x66e527aau},
    {"5a508d84a8499bbf8a570cfe13c6735b7a6d8d08a9532113a6c36763daa8b13022197024a4ab17592b233f25e61d5"
     "52e48c6e045af07a2332977f132",
     0xa2b12a5du},
    {"2164d4e848101ecbfe9d5b1c4b5d844aa960af76f5b93db3cdf749bd88e6bf25a981835e17ca99f5b4fd12b2324e1"
     "dda3c1842478466fa7fd908b5343aba3da8",
     0x1b474035u},
    {"09832226283a85ea3c3d41142943f0117ab6807161fde1409420af4ba8995223beaab3307fa86c1e00dcee19a5690"
     "ce87ac7b76f9f38967635754e368005aa7b74e20f29ed653f047141adbedf8fcda2ea8bc3daac03152508412dfa4e"
     "fd922bdd6c2b92",
     0x7bdec9d1u},
    {"2136d8f56f0cf93c25f9c85a5508b2bd9675118ef409ba359a803e239c9639aeb27b564760e32a15c6e14f0d46abe"
     "1f3e1b60fee685f3408f42463892cc11fbb74e86f6047a0b81d00887951606b9a93acc98c5ce166e7a24c2282cc52"
     "f54b977f9be3ccabab6ae1f01d31e5d6f5695625faf7cddec0c9a72b45e9c451bbcf2cd8077b4590bc544c04d1335"
     "b48768ebd8dfc0ca80962dc80378683d05b3fb620bf065ca065b8ed801681467a051f0043da31e18df4675a27b24b"
     "91715978224df521551497e3ed022b59961640b0af7757154e476765061b253512c043794c64da17eaa99697c42d3"
     "cf46b251e6fd0ac3960f0986a24d937a60b3ae4549251",
     0x647d7c59u},
};
// zlib's crc32 of 1 MiB where byte i is uint8_t(i * 31 + 7).
constexpr uint32_t kCrcPattern1MiB = 0xd424bdc1u;

// Bit by bit, straight from the definition (reflected, 0xEDB88320).
uint32_t BitwiseCrc32(std::span<const uint8_t> data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (uint8_t byte : data) {
    crc ^= byte;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

TEST(Crc32, CheckValue) {
  EXPECT_EQ(crc32(Text("123456789")), 0xCBF43926u);
  EXPECT_EQ(crc32(Text("")), 0u);
  EXPECT_EQ(crc32({}, 0x12345678u), 0x12345678u);  // nothing added: unchanged, as zlib
  EXPECT_EQ(crc32(Text("The quick brown fox jumps over the lazy dog")), 0x414FA339u);
}

TEST(Crc32, SameAsZlib) {
  for (const CrcVector& v : kCrcRandom) {
    const auto bytes = FromHex(v.bytes);
    testing::GuardedBuffer guarded(bytes);
    EXPECT_EQ(crc32(guarded.span()), v.crc) << v.bytes;
  }
  std::vector<uint8_t> big(1 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 31 + 7);
  EXPECT_EQ(crc32(big), kCrcPattern1MiB);
}

TEST(Crc32, InPiecesAsInOne) {
  std::mt19937_64 rng(3);
  for (int round = 0; round < 200; ++round) {
    std::vector<uint8_t> data(rng() % 3000);
    for (auto& b : data) b = static_cast<uint8_t>(rng());
    const uint32_t whole = crc32(data);
    ASSERT_EQ(whole, BitwiseCrc32(data));
    uint32_t crc = 0;
    for (size_t at = 0; at < data.size();) {
      const size_t n = std::min<size_t>(rng() % 70, data.size() - at);
      crc = crc32(std::span<const uint8_t>(data).subspan(at, n), crc);
      at += n;
    }
    EXPECT_EQ(crc, whole) << data.size() << " bytes";
  }
}

// Encoded by the build that used libsodium and zlib (previous commit).
constexpr std::string_view kDescriptorBytes =
    "464401030100000088776655443322112a0000000000000000503412007f00000010000000000000"
    "00001000000000000df0fecaefbeadde01000000c3f93468";
constexpr std::string_view kMetadataBytes =
    "4652594d02000700080706050403020106006e6f64652d610900626f6f742d313233340200030074"
    "6370060000000a0000011f90030073686d040000002f746d70a66b1929";

TEST(Crc32, DescriptorBytesUnchanged) {
  RemoteDescriptor d;
  d.engine_id = 0x1122334455667788ull;
  d.region_id = 42;
  d.address = 0x7f0012345000ull;
  d.region_offset = 4096;
  d.length = 1 << 20;
  d.key = 0xdeadbeefcafef00dull;
  d.access = kAccessReadWrite;
  d.kind = MemoryKind::kCuda;
  d.device = 1;
  EXPECT_EQ(testing::ToHex(d.to_bytes()), kDescriptorBytes);
  auto back = RemoteDescriptor::from_bytes(FromHex(kDescriptorBytes));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->key, d.key);
}

TEST(Crc32, MetadataBytesUnchanged) {
  EngineMetadata m;
  m.engine_id = 0x0102030405060708ull;
  m.protocol_version = 7;
  m.hostname = "node-a";
  m.host_id = "boot-1234";
  m.transports.push_back({"tcp", {10, 0, 0, 1, 0x1f, 0x90}});
  m.transports.push_back({"shm", {'/', 't', 'm', 'p'}});
  EXPECT_EQ(testing::ToHex(m.encode()), kMetadataBytes);
  auto back = EngineMetadata::decode(FromHex(kMetadataBytes));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->hostname, "node-a");
}

}  // namespace
}  // namespace ferry
