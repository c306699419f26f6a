// Stand-in for NIXL's common/nixl_log.h, found before NIXL's own on the include
// path when the plugin is built.
//
// Why: NIXL's header pulls in Abseil's logging (absl/log/*.h), which Debian 12
// does not ship in a version that has it, and which the NIXL wheel carries only
// as renamed shared libraries. The plugin uses none of NIXL's log macros -- it
// logs through Ferry's logger -- but NIXL's backend headers name NIXL_ASSERT and
// NIXL_ERROR in inline code, so they must parse. Here they discard what they are
// given; nothing in the plugin instantiates that code.
#ifndef __NIXL_LOG_H
#define __NIXL_LOG_H

#include <string>
#include <system_error>

namespace ferry_nixl_standin {
struct DiscardingStream {
  template <typename T>
  const DiscardingStream& operator<<(const T&) const {
    return *this;
  }
};
}  // namespace ferry_nixl_standin

#define NIXL_FATAL ::ferry_nixl_standin::DiscardingStream()
#define NIXL_ERROR ::ferry_nixl_standin::DiscardingStream()
#define NIXL_ERROR_FUNC ::ferry_nixl_standin::DiscardingStream()
#define NIXL_WARN ::ferry_nixl_standin::DiscardingStream()
#define NIXL_INFO ::ferry_nixl_standin::DiscardingStream()
#define NIXL_DEBUG ::ferry_nixl_standin::DiscardingStream()
#define NIXL_TRACE ::ferry_nixl_standin::DiscardingStream()
#define NIXL_ASSERT(condition) ::ferry_nixl_standin::DiscardingStream()
#define NIXL_ASSERT_ALWAYS(condition) ::ferry_nixl_standin::DiscardingStream()

static inline std::string nixl_strerror(int err) {
  return std::error_code(err, std::generic_category()).message();
}

#endif  // __NIXL_LOG_H
