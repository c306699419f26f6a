// Codecs: RemoteDescriptor (64 bytes), EngineMetadata, ByteReader/ByteWriter.
//
// Every malformed input is decoded from a GuardedBuffer, so a decoder that
// reads even one byte past its span crashes the test instead of passing.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/byte_codec.h"
#include "core/metadata.h"
#include "ferry/gpu.h"
#include "ferry/types.h"
#include "guarded_buffer.h"

namespace ferry {
namespace {

using testing::GuardedBuffer;

// ---------------------------------------------------------------------------
// RemoteDescriptor
// ---------------------------------------------------------------------------

uint32_t Crc32Reflected(ByteView data, uint32_t poly) {
  uint32_t crc = 0xFFFFFFFFu;
  for (uint8_t byte : data) {
    crc ^= byte;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (poly & (0u - (crc & 1u)));
  }
  return ~crc;
}
constexpr uint32_t kPolyIeee = 0xEDB88320u;        // zlib crc32
constexpr uint32_t kPolyCastagnoli = 0x82F63B78u;  // crc32c

RemoteDescriptor RandomDescriptor(std::mt19937_64& rng) {
  RemoteDescriptor d;
  d.engine_id = rng();
  d.region_id = rng();
  d.address = rng();
  d.region_offset = rng() >> 1;
  d.length = rng() >> 2;
  d.key = rng();
  d.access = static_cast<uint8_t>(1 + rng() % 3);
  if (rng() % 2) {
    d.kind = MemoryKind::kCuda;
    d.device = static_cast<int32_t>(rng() % 8);
    // Half of them name their GPU (format 2), as every build from format 2
    // on does; the others are what an older build sends.
    if (rng() % 2) d.gpu_pci = static_cast<uint32_t>(1 + rng() % 0xffffffffu);
  } else {
    d.kind = MemoryKind::kHost;
    d.device = -1;
  }
  return d;
}

void ExpectSameDescriptor(const RemoteDescriptor& a, const RemoteDescriptor& b) {
  EXPECT_EQ(a.engine_id, b.engine_id);
  EXPECT_EQ(a.region_id, b.region_id);
  EXPECT_EQ(a.address, b.address);
  EXPECT_EQ(a.region_offset, b.region_offset);
  EXPECT_EQ(a.length, b.length);
  EXPECT_EQ(a.key, b.key);
  EXPECT_EQ(a.access, b.access);
  EXPECT_EQ(a.kind, b.kind);
  EXPECT_EQ(a.device, b.device);
  EXPECT_EQ(a.gpu_pci, b.gpu_pci);
}

Result<RemoteDescriptor> DecodeGuarded(const Bytes& bytes) {
  GuardedBuffer g(bytes);
  return RemoteDescriptor::from_bytes(g.span());
}

TEST(DescriptorCodec, RoundTripRandomFieldsIsExactly64Bytes) {
  std::mt19937_64 rng(0xC0FFEE);
  for (int i = 0; i < 2000; ++i) {
    const RemoteDescriptor d = RandomDescriptor(rng);
    const Bytes b = d.to_bytes();
    ASSERT_EQ(b.size(), RemoteDescriptor::kEncodedSize);
    ASSERT_EQ(b.size(), 64u);
    auto r = DecodeGuarded(b);
    ASSERT_TRUE(r.ok()) << "iteration " << i << ": " << r.status().to_string();
    ExpectSameDescriptor(d, *r);
    // Encoding is a pure function of the fields.
    EXPECT_EQ(r->to_bytes(), b);
  }
}

TEST(DescriptorCodec, RoundTripExtremeValues) {
  for (uint64_t v : {uint64_t{0}, uint64_t{1}, std::numeric_limits<uint64_t>::max()}) {
    RemoteDescriptor d;
    d.engine_id = v;
    d.region_id = v;
    d.address = v;
    d.region_offset = v == std::numeric_limits<uint64_t>::max() ? v - 1 : v;
    d.length = 1;
    d.key = v;
    auto r = DecodeGuarded(d.to_bytes());
    ASSERT_TRUE(r.ok()) << "value " << v << ": " << r.status().to_string();
    ExpectSameDescriptor(d, *r);
  }
}

TEST(DescriptorCodec, RejectsEveryTruncatedLength) {
  std::mt19937_64 rng(1);
  const Bytes b = RandomDescriptor(rng).to_bytes();
  ASSERT_EQ(b.size(), 64u);
  for (size_t n = 0; n < b.size(); ++n) {
    Bytes cut(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(n));
    auto r = DecodeGuarded(cut);
    EXPECT_FALSE(r.ok()) << "accepted a descriptor truncated to " << n << " bytes";
    if (!r.ok()) {
      EXPECT_FALSE(r.status().message().empty()) << n;
    }
  }
}

TEST(DescriptorCodec, RejectsOversizedInput) {
  std::mt19937_64 rng(2);
  const Bytes b = RandomDescriptor(rng).to_bytes();
  for (size_t extra : {1u, 2u, 64u}) {
    Bytes longer = b;
    longer.resize(b.size() + extra, 0);
    EXPECT_FALSE(DecodeGuarded(longer).ok()) << "accepted " << longer.size() << " bytes";
  }
  // Two valid descriptors back to back are not one descriptor either.
  Bytes twice = b;
  twice.insert(twice.end(), b.begin(), b.end());
  EXPECT_FALSE(DecodeGuarded(twice).ok());
}

TEST(DescriptorCodec, RejectsEverySingleBitFlip) {
  std::mt19937_64 rng(3);
  for (int round = 0; round < 4; ++round) {
    const Bytes b = RandomDescriptor(rng).to_bytes();
    ASSERT_TRUE(DecodeGuarded(b).ok());
    for (size_t byte = 0; byte < b.size(); ++byte) {
      for (int bit = 0; bit < 8; ++bit) {
        Bytes bad = b;
        bad[byte] ^= static_cast<uint8_t>(1u << bit);
        EXPECT_FALSE(DecodeGuarded(bad).ok())
            << "accepted a descriptor with bit " << bit << " of byte " << byte << " flipped";
      }
    }
  }
}

TEST(DescriptorCodec, RejectsAllZeroAndAllOnes) {
  EXPECT_FALSE(DecodeGuarded(Bytes(64, 0x00)).ok());
  EXPECT_FALSE(DecodeGuarded(Bytes(64, 0xFF)).ok());
}

TEST(DescriptorCodec, RejectsInvalidAccess) {
  std::mt19937_64 rng(4);
  for (uint8_t access : {uint8_t{0}, uint8_t{4}, uint8_t{7}, uint8_t{0x80}, uint8_t{0xFF}}) {
    RemoteDescriptor d = RandomDescriptor(rng);
    d.access = access;
    auto r = DecodeGuarded(d.to_bytes());
    EXPECT_FALSE(r.ok()) << "accepted access " << int(access);
  }
  for (uint8_t access : {kAccessRead, kAccessWrite, kAccessReadWrite}) {
    RemoteDescriptor d = RandomDescriptor(rng);
    d.access = access;
    EXPECT_TRUE(DecodeGuarded(d.to_bytes()).ok()) << "refused access " << int(access);
  }
}

TEST(DescriptorCodec, RejectsInvalidMemoryKind) {
  std::mt19937_64 rng(5);
  for (uint8_t kind : {uint8_t{2}, uint8_t{3}, uint8_t{0x7F}, uint8_t{0xFF}}) {
    RemoteDescriptor d = RandomDescriptor(rng);
    d.kind = static_cast<MemoryKind>(kind);
    auto r = DecodeGuarded(d.to_bytes());
    EXPECT_FALSE(r.ok()) << "accepted memory kind " << int(kind);
  }
}

// Field-level rejection needs a correct checksum on a lying field, so these
// tests rely on the layout documented at the top of src/core/descriptor.cc:
//   0 u16 magic | 2 u8 version | 3 u8 access | 4 u8 kind | 5..7 reserved zero
//   8..55 six u64 fields | 56 i32 device | 60 u32 crc32 (zlib) of bytes 0..59
// The first assertion checks that assumption, so a layout change shows up as
// a clear failure here instead of as a silently vacuous test.
class DescriptorFields : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(6);
    RemoteDescriptor d = RandomDescriptor(rng);
    d.gpu_pci = 0;  // format 1, the layout below
    good_ = d.to_bytes();
    ASSERT_EQ(good_.size(), 64u);
    ASSERT_EQ(good_[2], 1) << "descriptor version byte is not at offset 2 any more";
    ASSERT_EQ(Crc32At(good_, 60), Crc32Reflected(ByteView(good_.data(), 60), kPolyIeee))
        << "descriptor checksum is not zlib crc32 of bytes 0..59 at offset 60";
  }
  static uint32_t Crc32At(const Bytes& b, size_t at) {
    uint32_t v;
    std::memcpy(&v, b.data() + at, 4);
    return v;
  }
  static Bytes Reseal(Bytes b) {
    const uint32_t crc = Crc32Reflected(ByteView(b.data(), 60), kPolyIeee);
    std::memcpy(b.data() + 60, &crc, 4);
    return b;
  }
  Bytes good_;
};

TEST_F(DescriptorFields, ResealedUnchangedBytesAreAccepted) {
  // Guards the tests below: resealing alone must not make a descriptor invalid.
  EXPECT_TRUE(DecodeGuarded(Reseal(good_)).ok());
}

TEST_F(DescriptorFields, RejectsUnknownVersion) {
  for (uint8_t v : {uint8_t{0}, uint8_t{3}, uint8_t{0xFF}}) {
    Bytes b = good_;
    b[2] = v;
    auto r = DecodeGuarded(Reseal(b));
    ASSERT_FALSE(r.ok()) << "accepted descriptor version " << int(v);
    EXPECT_NE(r.status().message().find(std::to_string(v)), std::string::npos)
        << "message does not name the version: " << r.status().message();
  }
}

TEST_F(DescriptorFields, RejectsBadMagicWithValidChecksum) {
  for (int i = 0; i < 2; ++i) {
    Bytes b = good_;
    b[static_cast<size_t>(i)] ^= 0x01;
    EXPECT_FALSE(DecodeGuarded(Reseal(b)).ok()) << "magic byte " << i;
  }
}

// GPU memory is named by its GPU's PCI bus id (format 2), because the owner's
// ordinal means nothing to a process with another CUDA_VISIBLE_DEVICES; host
// memory keeps format 1, byte for byte what older builds read.
TEST(DescriptorCodec, GpuDescriptorNamesItsGpuAndHostDescriptorStaysFormat1) {
  RemoteDescriptor g;
  g.engine_id = 7;
  g.region_id = 9;
  g.length = 4096;
  g.kind = MemoryKind::kCuda;
  g.device = 1;
  g.gpu_pci = pack_pci_bus_id(0x0001, 0x9a, 0x00, 0);
  const Bytes b = g.to_bytes();
  EXPECT_EQ(b[2], 2) << "a GPU descriptor naming its GPU is format 2";
  EXPECT_EQ(b[6] | b[7] << 8, 1) << "the owner's ordinal at byte 6";
  uint32_t pci;
  std::memcpy(&pci, b.data() + 56, 4);
  EXPECT_EQ(pci, g.gpu_pci);
  auto r = DecodeGuarded(b);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ExpectSameDescriptor(g, *r);
  EXPECT_EQ(pci_bus_id_text(r->gpu_pci), "0001:9a:00.0");

  RemoteDescriptor h = g;
  h.kind = MemoryKind::kHost;
  h.device = -1;
  h.gpu_pci = 0;
  const Bytes hb = h.to_bytes();
  EXPECT_EQ(hb[2], 1);
  EXPECT_EQ(hb[5] | hb[6] | hb[7], 0);
  int32_t dev;
  std::memcpy(&dev, hb.data() + 56, 4);
  EXPECT_EQ(dev, -1) << "format 1 keeps the ordinal at byte 56";

  // What an older build sends for GPU memory: format 1, no PCI bus id.
  RemoteDescriptor old = g;
  old.gpu_pci = 0;
  const Bytes ob = old.to_bytes();
  EXPECT_EQ(ob[2], 1);
  auto o = DecodeGuarded(ob);
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->device, 1);
  EXPECT_EQ(o->gpu_pci, 0u);
}

TEST(DescriptorCodec, Format2RefusesHostMemoryAndAMissingGpu) {
  RemoteDescriptor g;
  g.length = 1;
  g.kind = MemoryKind::kCuda;
  g.device = 0;
  g.gpu_pci = pack_pci_bus_id(0, 0x18, 0, 0);
  const Bytes good = g.to_bytes();
  ASSERT_EQ(good[2], 2);
  auto reseal = [](Bytes b) {
    const uint32_t crc = Crc32Reflected(ByteView(b.data(), 60), kPolyIeee);
    std::memcpy(b.data() + 60, &crc, 4);
    return b;
  };
  Bytes host = good;
  host[4] = static_cast<uint8_t>(MemoryKind::kHost);
  auto r = DecodeGuarded(reseal(host));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("names a GPU"), std::string::npos) << r.status().message();
  Bytes nopci = good;
  std::memset(nopci.data() + 56, 0, 4);
  EXPECT_FALSE(DecodeGuarded(reseal(nopci)).ok()) << "format 2 without a PCI bus id";
  Bytes pad = good;
  pad[5] = 1;
  EXPECT_FALSE(DecodeGuarded(reseal(pad)).ok()) << "format 2 with byte 5 set";
}

TEST(GpuNames, PciBusIdPacksAndPrints) {
  EXPECT_EQ(pci_bus_id_text(pack_pci_bus_id(0, 0x18, 0, 0)), "0000:18:00.0");
  EXPECT_EQ(pci_bus_id_text(pack_pci_bus_id(0xffff, 0xff, 0x1f, 7)), "ffff:ff:1f.7");
  // A name that is neither a UUID nor a PCI bus id is refused, naming it
  // (before any GPU is asked, so this holds on machines without one).
  auto r = gpu_ordinal("gpu0");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().to_string();
  EXPECT_NE(r.status().message().find("gpu0"), std::string::npos);
  // Well-formed names reach the lookup: on a machine without a GPU, NotSupported.
  for (const char* name : {"0000:18:00.0", "18:00.0", "00000000:18:00.0",
                           "GPU-8f6c0e1a-1b2c-3d4e-5f60-718293a4b5c6"}) {
    auto o = gpu_ordinal(name);
    if (!o.ok()) {
      EXPECT_NE(o.status().code(), StatusCode::kInvalidArgument)
          << name << ": " << o.status().to_string();
    }
  }
}

TEST_F(DescriptorFields, RejectsNonZeroReservedBytes) {
  for (size_t i = 5; i < 8; ++i) {
    Bytes b = good_;
    b[i] = 0x01;
    EXPECT_FALSE(DecodeGuarded(Reseal(b)).ok()) << "reserved byte " << i;
  }
}

TEST_F(DescriptorFields, RejectsInvalidAccessAndKindWithValidChecksum) {
  for (uint8_t access : {uint8_t{0}, uint8_t{4}, uint8_t{0xFF}}) {
    Bytes b = good_;
    b[3] = access;
    EXPECT_FALSE(DecodeGuarded(Reseal(b)).ok()) << "access " << int(access);
  }
  for (uint8_t kind : {uint8_t{2}, uint8_t{0xFF}}) {
    Bytes b = good_;
    b[4] = kind;
    EXPECT_FALSE(DecodeGuarded(Reseal(b)).ok()) << "kind " << int(kind);
  }
}

TEST(DescriptorCodec, RejectsRangeThatOverflows) {
  RemoteDescriptor d;
  d.engine_id = 1;
  d.region_id = 1;
  d.region_offset = std::numeric_limits<uint64_t>::max() - 10;
  d.length = 11;
  EXPECT_FALSE(DecodeGuarded(d.to_bytes()).ok()) << "accepted region_offset+length past 2^64";
  d.length = 10;
  EXPECT_TRUE(DecodeGuarded(d.to_bytes()).ok());
}

// ---------------------------------------------------------------------------
// EngineMetadata
// ---------------------------------------------------------------------------

EngineMetadata SampleMetadata() {
  EngineMetadata m;
  m.engine_id = 0x0123456789ABCDEFull;
  m.protocol_version = 7;
  m.hostname = "node-17.example";
  m.host_id = "c24a7a6a-71d3-452c-89b8-ffd79478cc5d";
  m.transports.push_back({"tcp", Bytes{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}});
  m.transports.push_back({"shm", Bytes{}});
  m.transports.push_back({"fabric", Bytes(300, 0xA5)});
  return m;
}

// Which CRC polynomial the encoder uses (the header only says "crc32").
uint32_t DetectPoly() {
  const Bytes b = SampleMetadata().encode();
  if (b.size() < 4) return 0;
  uint32_t stored;
  std::memcpy(&stored, b.data() + b.size() - 4, 4);
  ByteView body(b.data(), b.size() - 4);
  if (Crc32Reflected(body, kPolyIeee) == stored) return kPolyIeee;
  if (Crc32Reflected(body, kPolyCastagnoli) == stored) return kPolyCastagnoli;
  return 0;
}

// Appends the crc32 of everything in `body` (as the encoder does).
Bytes Seal(Bytes body, uint32_t poly) {
  const uint32_t crc = Crc32Reflected(body, poly);
  ByteWriter w(body);
  w.u32(crc);
  return body;
}

// Writes the documented layout field by field, so tests can lie in any field
// and still carry a correct checksum.
struct RawMeta {
  char magic[4] = {'F', 'R', 'Y', 'M'};
  uint16_t format_version = EngineMetadata::kFormatVersion;
  uint16_t protocol_version = 7;
  uint64_t engine_id = 42;
  std::string hostname = "host";
  std::string host_id = "boot-1";
  struct T {
    std::string name;
    Bytes blob;
    std::optional<uint16_t> name_len;  // a lie, if set
    std::optional<uint32_t> blob_len;  // a lie, if set
  };
  std::vector<T> transports = {{"tcp", Bytes{9, 8, 7, 6}, {}, {}}};
  std::optional<uint16_t> hostname_len;     // a lie, if set
  std::optional<uint16_t> transport_count;  // a lie, if set
  Bytes trailing_before_crc;

  Bytes Body() const {
    Bytes out;
    ByteWriter w(out);
    w.bytes(magic, 4);
    w.u16(format_version);
    w.u16(protocol_version);
    w.u64(engine_id);
    w.u16(hostname_len.value_or(static_cast<uint16_t>(hostname.size())));
    w.bytes(hostname.data(), hostname.size());
    w.u16(static_cast<uint16_t>(host_id.size()));
    w.bytes(host_id.data(), host_id.size());
    w.u16(transport_count.value_or(static_cast<uint16_t>(transports.size())));
    for (const auto& t : transports) {
      w.u16(t.name_len.value_or(static_cast<uint16_t>(t.name.size())));
      w.bytes(t.name.data(), t.name.size());
      w.u32(t.blob_len.value_or(static_cast<uint32_t>(t.blob.size())));
      w.bytes(t.blob.data(), t.blob.size());
    }
    w.bytes(trailing_before_crc.data(), trailing_before_crc.size());
    return out;
  }
};

Result<EngineMetadata> DecodeMetaGuarded(const Bytes& bytes) {
  GuardedBuffer g(bytes);
  return EngineMetadata::decode(g.span());
}

class MetadataCodec : public ::testing::Test {
 protected:
  void SetUp() override {
    poly_ = DetectPoly();
    ASSERT_NE(poly_, 0u) << "metadata trailer is neither crc32 (zlib) nor crc32c of the body";
  }
  Bytes Sealed(const RawMeta& m) const { return Seal(m.Body(), poly_); }
  uint32_t poly_ = 0;
};

TEST_F(MetadataCodec, RoundTrip) {
  const EngineMetadata m = SampleMetadata();
  const Bytes b = m.encode();
  ASSERT_LE(b.size(), EngineMetadata::kMaxEncodedSize);
  auto r = DecodeMetaGuarded(b);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->engine_id, m.engine_id);
  EXPECT_EQ(r->protocol_version, m.protocol_version);
  EXPECT_EQ(r->hostname, m.hostname);
  ASSERT_EQ(r->transports.size(), m.transports.size());
  for (size_t i = 0; i < m.transports.size(); ++i) {
    EXPECT_EQ(r->transports[i].transport, m.transports[i].transport);
    EXPECT_EQ(r->transports[i].blob, m.transports[i].blob);
  }
  ASSERT_NE(r->find("fabric"), nullptr);
  EXPECT_EQ(r->find("fabric")->blob, Bytes(300, 0xA5));
  EXPECT_EQ(r->find("udp"), nullptr);
  EXPECT_EQ(r->encode(), b);
}

TEST_F(MetadataCodec, RoundTripEmptyAndRandom) {
  EngineMetadata empty;
  empty.engine_id = 1;  // 0 is not a valid engine id
  auto r0 = DecodeMetaGuarded(empty.encode());
  ASSERT_TRUE(r0.ok()) << r0.status().to_string();
  EXPECT_TRUE(r0->transports.empty());
  EXPECT_TRUE(r0->hostname.empty());

  std::mt19937_64 rng(11);
  for (int i = 0; i < 200; ++i) {
    EngineMetadata m;
    m.engine_id = rng() | 1;
    m.protocol_version = static_cast<uint16_t>(rng());
    m.hostname.resize(rng() % 64);
    for (auto& c : m.hostname) c = static_cast<char>('a' + rng() % 26);
    const size_t nt = rng() % 5;
    for (size_t t = 0; t < nt; ++t) {
      TransportAddress a;
      a.transport = "t" + std::to_string(t);
      a.blob.resize(rng() % 100);
      for (auto& x : a.blob) x = static_cast<uint8_t>(rng());
      m.transports.push_back(a);
    }
    auto r = DecodeMetaGuarded(m.encode());
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->engine_id, m.engine_id);
    EXPECT_EQ(r->protocol_version, m.protocol_version);
    EXPECT_EQ(r->hostname, m.hostname);
    ASSERT_EQ(r->transports.size(), nt);
    for (size_t t = 0; t < nt; ++t) EXPECT_EQ(r->transports[t].blob, m.transports[t].blob);
  }
}

TEST_F(MetadataCodec, MatchesDocumentedLayout) {
  RawMeta raw;
  raw.engine_id = 0x1122334455667788ull;
  raw.protocol_version = 3;
  raw.hostname = "h";
  EngineMetadata m;
  m.engine_id = raw.engine_id;
  m.protocol_version = raw.protocol_version;
  m.hostname = raw.hostname;
  m.host_id = raw.host_id;
  m.transports.push_back({"tcp", Bytes{9, 8, 7, 6}});
  EXPECT_EQ(m.encode(), Sealed(raw));
  auto r = DecodeMetaGuarded(Sealed(raw));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->engine_id, raw.engine_id);
}

TEST_F(MetadataCodec, RejectsTruncationAtEveryLength) {
  const Bytes b = SampleMetadata().encode();
  for (size_t n = 0; n < b.size(); ++n) {
    Bytes cut(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(n));
    auto r = DecodeMetaGuarded(cut);
    EXPECT_FALSE(r.ok()) << "accepted metadata truncated to " << n << " of " << b.size();
  }
}

TEST_F(MetadataCodec, RejectsTruncationWithRecomputedCrc) {
  // A naive decoder that trusts a matching crc must still notice the fields
  // run past the end.
  const Bytes full = SampleMetadata().encode();
  const Bytes body(full.begin(), full.end() - 4);
  for (size_t n = 0; n < body.size(); ++n) {
    Bytes cut(body.begin(), body.begin() + static_cast<std::ptrdiff_t>(n));
    auto r = DecodeMetaGuarded(Seal(cut, poly_));
    EXPECT_FALSE(r.ok()) << "accepted a body cut to " << n << " bytes with a valid crc";
  }
}

TEST_F(MetadataCodec, RejectsBadMagic) {
  for (int i = 0; i < 4; ++i) {
    RawMeta raw;
    raw.magic[i] ^= 0x20;
    auto r = DecodeMetaGuarded(Sealed(raw));
    EXPECT_FALSE(r.ok()) << "accepted magic with byte " << i << " changed (crc valid)";
  }
  RawMeta raw;
  std::memcpy(raw.magic, "FRYD", 4);
  EXPECT_FALSE(DecodeMetaGuarded(Sealed(raw)).ok());
}

TEST_F(MetadataCodec, RejectsUnknownFormatVersion) {
  for (uint16_t v : {uint16_t(EngineMetadata::kFormatVersion + 1), uint16_t{0xFFFF}}) {
    RawMeta raw;
    raw.format_version = v;
    EXPECT_FALSE(DecodeMetaGuarded(Sealed(raw)).ok()) << "accepted format version " << v;
  }
}

TEST_F(MetadataCodec, RejectsBadCrc) {
  const Bytes b = SampleMetadata().encode();
  for (size_t i = b.size() - 4; i < b.size(); ++i) {
    Bytes bad = b;
    bad[i] ^= 0x01;
    EXPECT_FALSE(DecodeMetaGuarded(bad).ok()) << "accepted crc with byte " << i << " changed";
  }
  // And a body change without a crc update.
  Bytes bad = b;
  bad[12] ^= 0x40;  // inside the engine id
  EXPECT_FALSE(DecodeMetaGuarded(bad).ok());
}

TEST_F(MetadataCodec, RejectsEverySingleBitFlip) {
  const Bytes b = SampleMetadata().encode();
  for (size_t byte = 0; byte < b.size(); ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      Bytes bad = b;
      bad[byte] ^= static_cast<uint8_t>(1u << bit);
      EXPECT_FALSE(DecodeMetaGuarded(bad).ok())
          << "accepted bit " << bit << " of byte " << byte << " flipped";
    }
  }
}

TEST_F(MetadataCodec, RejectsOversizedTransportCount) {
  for (uint16_t count : {uint16_t{2}, uint16_t{100}, uint16_t{0xFFFF}}) {
    RawMeta raw;
    raw.transport_count = count;  // only one transport follows
    auto r = DecodeMetaGuarded(Sealed(raw));
    EXPECT_FALSE(r.ok()) << "accepted transport count " << count << " with 1 present";
  }
}

TEST_F(MetadataCodec, RejectsOversizedHostnameLength) {
  for (uint16_t len : {uint16_t{5}, uint16_t{200}, uint16_t{0xFFFF}}) {
    RawMeta raw;
    raw.hostname = "host";
    raw.transports.clear();
    raw.hostname_len = len;  // only 4 bytes follow (+2 for count)
    auto r = DecodeMetaGuarded(Sealed(raw));
    EXPECT_FALSE(r.ok()) << "accepted hostname length " << len;
  }
}

TEST_F(MetadataCodec, RejectsOversizedTransportNameLength) {
  for (uint16_t len : {uint16_t{0xFFFF}, uint16_t{1000}}) {
    RawMeta raw;
    raw.transports[0].name_len = len;
    EXPECT_FALSE(DecodeMetaGuarded(Sealed(raw)).ok()) << "accepted name length " << len;
  }
}

TEST_F(MetadataCodec, RejectsOversizedBlobLength) {
  for (uint32_t len : {uint32_t{5}, uint32_t{70000}, uint32_t{0x7FFFFFFF}, uint32_t{0xFFFFFFFF},
                       uint32_t{0xFFFFFFFC}}) {
    RawMeta raw;
    raw.transports[0].blob_len = len;  // 4 bytes follow
    auto r = DecodeMetaGuarded(Sealed(raw));
    EXPECT_FALSE(r.ok()) << "accepted blob length " << len;
  }
}

TEST_F(MetadataCodec, RejectsTrailingGarbage) {
  const Bytes b = SampleMetadata().encode();
  for (size_t extra : {1u, 3u, 4u, 17u}) {
    Bytes longer = b;
    longer.resize(b.size() + extra, 0x5A);
    EXPECT_FALSE(DecodeMetaGuarded(longer).ok()) << extra << " trailing bytes after the crc";
  }
  // Garbage between the last field and a crc that covers it.
  RawMeta raw;
  raw.trailing_before_crc = {1, 2, 3, 4, 5};
  EXPECT_FALSE(DecodeMetaGuarded(Sealed(raw)).ok()) << "accepted garbage before a valid crc";
}

TEST_F(MetadataCodec, RejectsInputLargerThanMax) {
  RawMeta raw;
  raw.transports[0].blob = Bytes(EngineMetadata::kMaxEncodedSize + 16, 0x11);
  const Bytes b = Sealed(raw);
  ASSERT_GT(b.size(), EngineMetadata::kMaxEncodedSize);
  EXPECT_FALSE(DecodeMetaGuarded(b).ok()) << "accepted " << b.size() << " bytes of metadata";
}

TEST_F(MetadataCodec, RandomGarbageNeverCrashes) {
  std::mt19937_64 rng(99);
  const Bytes good = SampleMetadata().encode();
  for (int i = 0; i < 3000; ++i) {
    Bytes b;
    if (i % 2) {
      b.resize(rng() % 200);
      for (auto& x : b) x = static_cast<uint8_t>(rng());
    } else {
      // Mutate a valid body in a few places and re-seal, so the crc passes and
      // the parser proper is exercised.
      Bytes body(good.begin(), good.end() - 4);
      const int n = 1 + static_cast<int>(rng() % 4);
      for (int k = 0; k < n; ++k) body[rng() % body.size()] = static_cast<uint8_t>(rng());
      if (rng() % 3 == 0) body.resize(rng() % body.size());
      b = Seal(body, poly_);
    }
    auto r = DecodeMetaGuarded(b);
    if (r.ok()) {
      // Whatever was accepted must re-encode to exactly the input.
      EXPECT_EQ(r->encode(), b) << "iteration " << i;
    }
  }
}

// ---------------------------------------------------------------------------
// ByteReader / ByteWriter
// ---------------------------------------------------------------------------

TEST(ByteCodec, WriterIsLittleEndianAndReaderRoundTrips) {
  Bytes out;
  ByteWriter w(out);
  w.u8(0xAB);
  w.u16(0x0102);
  w.u32(0x03040506);
  w.u64(0x0708090A0B0C0D0Eull);
  w.str16("hi");
  const uint8_t raw[] = {0xDE, 0xAD};
  w.bytes(raw, 2);
  const Bytes expect = {0xAB, 0x02, 0x01, 0x06, 0x05, 0x04, 0x03, 0x0E, 0x0D, 0x0C, 0x0B,
                        0x0A, 0x09, 0x08, 0x07, 0x02, 0x00, 'h',  'i',  0xDE, 0xAD};
  EXPECT_EQ(out, expect);

  GuardedBuffer g(out);
  ByteReader r(g.span());
  EXPECT_EQ(r.u8(), 0xAB);
  EXPECT_EQ(r.u16(), 0x0102);
  EXPECT_EQ(r.u32(), 0x03040506u);
  EXPECT_EQ(r.u64(), 0x0708090A0B0C0D0Eull);
  EXPECT_EQ(r.str16(), "hi");
  auto b = r.bytes(2);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0], 0xDE);
  EXPECT_EQ(b[1], 0xAD);
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.remaining(), 0u);
  EXPECT_EQ(r.position(), out.size());
}

TEST(ByteCodec, ShortReadsFailAndStayFailed) {
  for (size_t len = 0; len < 8; ++len) {
    Bytes data(len, 0xFF);
    GuardedBuffer g(data);
    ByteReader r(g.span());
    EXPECT_EQ(r.u64(), 0u) << len;
    EXPECT_FALSE(r.ok()) << len;
    EXPECT_EQ(r.remaining(), 0u);
    // A failed reader never recovers, even for reads that would fit.
    EXPECT_EQ(r.u8(), 0u);
    EXPECT_FALSE(r.ok());
    EXPECT_TRUE(r.bytes(0).empty());
    EXPECT_FALSE(r.ok());
  }
}

TEST(ByteCodec, BytesLengthNeverOverflows) {
  Bytes data(16, 1);
  GuardedBuffer g(data);
  for (size_t n : {size_t{17}, std::numeric_limits<size_t>::max(),
                   std::numeric_limits<size_t>::max() - 8, size_t{1} << 63}) {
    ByteReader r(g.span());
    r.u64();  // position 8: pos + n overflows for the huge n
    auto b = r.bytes(n);
    EXPECT_TRUE(b.empty()) << n;
    EXPECT_FALSE(r.ok()) << n;
  }
}

TEST(ByteCodec, Str16LengthBeyondEndFails) {
  Bytes data;
  ByteWriter w(data);
  w.u16(0xFFFF);
  w.bytes("abc", 3);
  GuardedBuffer g(data);
  ByteReader r(g.span());
  EXPECT_EQ(r.str16(), "");
  EXPECT_FALSE(r.ok());
}

TEST(ByteCodec, ExactEndIsOk) {
  Bytes data = {1, 2, 3, 4};
  GuardedBuffer g(data);
  ByteReader r(g.span());
  EXPECT_EQ(r.u32(), 0x04030201u);
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.remaining(), 0u);
  EXPECT_TRUE(r.bytes(0).empty());
  EXPECT_TRUE(r.ok());
  EXPECT_EQ(r.u8(), 0u);
  EXPECT_FALSE(r.ok());
}

TEST(ByteCodec, RandomOperationsNeverReadPastTheSpan) {
  std::mt19937_64 rng(7);
  for (int iter = 0; iter < 2000; ++iter) {
    Bytes data(rng() % 40);
    for (auto& x : data) x = static_cast<uint8_t>(rng());
    GuardedBuffer g(data);
    ByteReader r(g.span());
    size_t pos = 0;
    bool ok = true;
    for (int op = 0; op < 12; ++op) {
      size_t want = 0;
      switch (rng() % 6) {
        case 0: r.u8(); want = 1; break;
        case 1: r.u16(); want = 2; break;
        case 2: r.u32(); want = 4; break;
        case 3: r.u64(); want = 8; break;
        case 4: want = rng() % 12; r.bytes(want); break;
        case 5: {
          const size_t before = pos;
          std::string s = r.str16();
          if (ok && before + 2 <= data.size()) {
            const size_t n = data[before] | (size_t{data[before + 1]} << 8);
            want = 2 + n;
            if (before + want <= data.size()) {
              EXPECT_EQ(s.size(), n);
            }
          } else {
            want = 2;
          }
          break;
        }
      }
      if (ok && pos + want <= data.size()) {
        pos += want;
      } else {
        ok = false;
      }
      ASSERT_EQ(r.ok(), ok) << "iteration " << iter << " op " << op;
      if (ok) {
        ASSERT_EQ(r.position(), pos);
      }
      ASSERT_EQ(r.remaining(), ok ? data.size() - pos : 0u);
    }
  }
}

}  // namespace
}  // namespace ferry
