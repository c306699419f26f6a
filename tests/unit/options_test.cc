// Declared options (DESIGN.md §7): byte sizes, defaults, config, environment,
// validation.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/options.h"

namespace ferry {
namespace {

const OptionInfo* FindInfo(const OptionSet& set, std::string_view name) {
  for (const auto& info : set.list()) {
    if (info.name == name) return &info;
  }
  return nullptr;
}

bool Contains(const std::string& haystack, std::string_view needle) {
  return haystack.find(needle) != std::string::npos;
}

// Sets an environment variable for one scope and restores what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// ---------------------------------------------------------------------------
// parse_byte_size
// ---------------------------------------------------------------------------

TEST(ParseByteSize, AcceptsPlainAndBinaryAndDecimalUnits) {
  struct Case {
    const char* text;
    uint64_t bytes;
  } cases[] = {
      {"0", 0},
      {"1", 1},
      {"1048576", 1048576},
      {"4KiB", 4096},
      {"1MiB", 1048576},
      {"3GiB", 3ull << 30},
      {"64KiB", 65536},
      {"1KB", 1000},
      {"5MB", 5000000},
      {"2GB", 2000000000},
      {"18446744073709551615", UINT64_MAX},
  };
  for (const auto& c : cases) {
    auto r = parse_byte_size(c.text);
    ASSERT_TRUE(r.ok()) << c.text << ": " << r.status().to_string();
    EXPECT_EQ(*r, c.bytes) << c.text;
  }
}

TEST(ParseByteSize, RejectsGarbage) {
  for (const char* text : {"", "abc", "KiB", "-1", "-4KiB", "4XB", "4 KiB", " 4", "4KiB ",
                           "1.5MiB", "0x10", "4KiBKiB", "1e6", "12abc", "4i"}) {
    auto r = parse_byte_size(text);
    EXPECT_FALSE(r.ok()) << "accepted '" << text << "' as " << (r.ok() ? *r : 0);
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << text;
      EXPECT_FALSE(r.status().message().empty());
    }
  }
}

TEST(ParseByteSize, RejectsOverflow) {
  for (const char* text : {"18446744073709551616", "99999999999999999999999", "17179869184GiB",
                           "18446744073709552KB", "16777216TiB"}) {
    auto r = parse_byte_size(text);
    EXPECT_FALSE(r.ok()) << "accepted '" << text << "' as " << (r.ok() ? *r : 0);
  }
}

// ---------------------------------------------------------------------------
// OptionSet::resolve
// ---------------------------------------------------------------------------

// A test-only component table; names chosen so that no real engine option
// (or a variable set in the CI environment) interferes, except tcp.streams,
// which the brief names explicitly.
const OptionSpec kSpecs[] = {
    {"tcp.streams", OptionType::kUint, "4", "TCP connections per peer", 1, 64},
    {"unittest.chunk", OptionType::kBytes, "1MiB", "chunk size", 4096, 1ull << 30},
    {"unittest.enabled", OptionType::kBool, "true", "switch"},
    {"unittest.name", OptionType::kString, "alpha", "a name"},
    {"unittest.timeout", OptionType::kDurationMs, "250", "a timeout", 1, 60000},
};

class OptionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const auto& s : kSpecs) unsetenv(option_env_name(s.name).c_str());
  }
  void TearDown() override {
    for (const auto& s : kSpecs) unsetenv(option_env_name(s.name).c_str());
  }
};

TEST_F(OptionsTest, EnvNames) {
  EXPECT_EQ(option_env_name("tcp.streams"), "FERRY_TCP_STREAMS");
  EXPECT_EQ(option_env_name("unittest.chunk"), "FERRY_UNITTEST_CHUNK");
}

TEST_F(OptionsTest, Defaults) {
  auto r = OptionSet::resolve(kSpecs, {});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->get_uint("tcp.streams"), 4u);
  EXPECT_EQ(r->get_uint("unittest.chunk"), 1u << 20);
  EXPECT_TRUE(r->get_bool("unittest.enabled"));
  EXPECT_EQ(r->get_string("unittest.name"), "alpha");
  EXPECT_EQ(r->get_uint("unittest.timeout"), 250u);
  ASSERT_EQ(r->list().size(), std::size(kSpecs));
  for (const auto& info : r->list()) {
    EXPECT_EQ(info.source, "default") << info.name;
    EXPECT_FALSE(info.doc.empty()) << info.name;
  }
  const OptionInfo* chunk = FindInfo(*r, "unittest.chunk");
  ASSERT_NE(chunk, nullptr);
  EXPECT_EQ(chunk->type, "bytes");
  EXPECT_EQ(chunk->value, "1MiB");
  EXPECT_EQ(FindInfo(*r, "tcp.streams")->type, "uint");
  EXPECT_EQ(FindInfo(*r, "unittest.enabled")->type, "bool");
  EXPECT_EQ(FindInfo(*r, "unittest.name")->type, "string");
  EXPECT_EQ(FindInfo(*r, "unittest.timeout")->type, "duration_ms");
}

TEST_F(OptionsTest, ConfigOverridesDefault) {
  auto r = OptionSet::resolve(kSpecs, {{"tcp.streams", "8"},
                                       {"unittest.chunk", "4KiB"},
                                       {"unittest.enabled", "false"},
                                       {"unittest.name", "beta"},
                                       {"unittest.timeout", "1000"}});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->get_uint("tcp.streams"), 8u);
  EXPECT_EQ(r->get_uint("unittest.chunk"), 4096u);
  EXPECT_FALSE(r->get_bool("unittest.enabled"));
  EXPECT_EQ(r->get_string("unittest.name"), "beta");
  EXPECT_EQ(r->get_uint("unittest.timeout"), 1000u);
  EXPECT_EQ(FindInfo(*r, "tcp.streams")->source, "config");
  EXPECT_EQ(FindInfo(*r, "tcp.streams")->value, "8");
}

TEST_F(OptionsTest, EnvironmentOverridesDefault) {
  ScopedEnv env("FERRY_TCP_STREAMS", "16");
  ScopedEnv env2("FERRY_UNITTEST_CHUNK", "64KiB");
  auto r = OptionSet::resolve(kSpecs, {});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->get_uint("tcp.streams"), 16u);
  EXPECT_EQ(r->get_uint("unittest.chunk"), 65536u);
}

TEST_F(OptionsTest, EnvironmentValueIsReportedWithItsSource) {
  ScopedEnv env("FERRY_TCP_STREAMS", "16");
  auto r = OptionSet::resolve(kSpecs, {});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->get_uint("tcp.streams"), 16u);
  const OptionInfo* info = FindInfo(*r, "tcp.streams");
  ASSERT_NE(info, nullptr);
  EXPECT_TRUE(Contains(info->source, "environment")) << info->source;
  EXPECT_TRUE(Contains(info->source, "FERRY_TCP_STREAMS")) << info->source;
  EXPECT_EQ(info->value, "16");
  EXPECT_EQ(FindInfo(*r, "unittest.name")->source, "default");
}

TEST_F(OptionsTest, ConfigWinsOverEnvironment) {
  ScopedEnv env("FERRY_TCP_STREAMS", "16");
  auto r = OptionSet::resolve(kSpecs, {{"tcp.streams", "2"}});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->get_uint("tcp.streams"), 2u);
  EXPECT_EQ(FindInfo(*r, "tcp.streams")->source, "config");
}

TEST_F(OptionsTest, UnknownOptionIsNamed) {
  auto r = OptionSet::resolve(kSpecs, {{"tcp.streamz", "4"}});
  ASSERT_FALSE(r.ok()) << "an unknown option was silently ignored";
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(r.status().message(), "tcp.streamz")) << r.status().message();
}

TEST_F(OptionsTest, InvalidConfigValueNamesOptionAndValue) {
  struct Case {
    const char* name;
    const char* value;
  } cases[] = {
      {"tcp.streams", "many"},       {"tcp.streams", "-3"},   {"tcp.streams", "4.5"},
      {"unittest.chunk", "lots"},    {"unittest.chunk", "4XB"},
      {"unittest.enabled", "maybe"}, {"unittest.timeout", "soon"},
  };
  for (const auto& c : cases) {
    auto r = OptionSet::resolve(kSpecs, {{c.name, c.value}});
    ASSERT_FALSE(r.ok()) << c.name << "=" << c.value << " was accepted";
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(r.status().message(), c.name)) << r.status().message();
    EXPECT_TRUE(Contains(r.status().message(), c.value)) << r.status().message();
  }
}

TEST_F(OptionsTest, InvalidEnvironmentValueIsAnErrorNotIgnored) {
  ScopedEnv env("FERRY_TCP_STREAMS", "lots");
  auto r = OptionSet::resolve(kSpecs, {});
  ASSERT_FALSE(r.ok()) << "an invalid environment value was silently ignored";
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(r.status().message(), "tcp.streams")) << r.status().message();
  EXPECT_TRUE(Contains(r.status().message(), "lots")) << r.status().message();
}

TEST_F(OptionsTest, MinAndMaxBounds) {
  // tcp.streams in [1, 64]
  for (const char* ok : {"1", "64"}) {
    auto r = OptionSet::resolve(kSpecs, {{"tcp.streams", ok}});
    ASSERT_TRUE(r.ok()) << ok << ": " << r.status().to_string();
  }
  for (const char* bad : {"0", "65", "18446744073709551615"}) {
    auto r = OptionSet::resolve(kSpecs, {{"tcp.streams", bad}});
    ASSERT_FALSE(r.ok()) << "tcp.streams=" << bad << " accepted outside [1, 64]";
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(r.status().message(), "tcp.streams")) << r.status().message();
    EXPECT_TRUE(Contains(r.status().message(), bad)) << r.status().message();
  }
  // unittest.chunk (bytes) in [4096, 1 GiB]
  EXPECT_TRUE(OptionSet::resolve(kSpecs, {{"unittest.chunk", "4KiB"}}).ok());
  EXPECT_TRUE(OptionSet::resolve(kSpecs, {{"unittest.chunk", "1GiB"}}).ok());
  EXPECT_FALSE(OptionSet::resolve(kSpecs, {{"unittest.chunk", "4095"}}).ok());
  EXPECT_FALSE(OptionSet::resolve(kSpecs, {{"unittest.chunk", "2GB"}}).ok());
  // unittest.timeout (duration) in [1, 60000]
  EXPECT_FALSE(OptionSet::resolve(kSpecs, {{"unittest.timeout", "0"}}).ok());
  EXPECT_FALSE(OptionSet::resolve(kSpecs, {{"unittest.timeout", "60001"}}).ok());
}

TEST_F(OptionsTest, BoundsApplyToEnvironmentToo) {
  ScopedEnv env("FERRY_TCP_STREAMS", "0");
  auto r = OptionSet::resolve(kSpecs, {});
  ASSERT_FALSE(r.ok()) << "FERRY_TCP_STREAMS=0 accepted below the minimum of 1";
  EXPECT_TRUE(Contains(r.status().message(), "tcp.streams")) << r.status().message();
}

TEST_F(OptionsTest, BooleanSpellings) {
  for (const char* t : {"true", "1"}) {
    auto r = OptionSet::resolve(kSpecs, {{"unittest.enabled", t}});
    ASSERT_TRUE(r.ok()) << t;
    EXPECT_TRUE(r->get_bool("unittest.enabled")) << t;
  }
  for (const char* f : {"false", "0"}) {
    auto r = OptionSet::resolve(kSpecs, {{"unittest.enabled", f}});
    ASSERT_TRUE(r.ok()) << f;
    EXPECT_FALSE(r->get_bool("unittest.enabled")) << f;
  }
}

}  // namespace
}  // namespace ferry
