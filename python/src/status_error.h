// The C++ side of Ferry's Python errors: a non-Ok ferry::Status is thrown as
// StatusError, and the module's translator (ferry_py.cc) raises the Python
// class that ferry/_errors.py registered for its code.
#pragma once

#include <exception>
#include <string>
#include <utility>

#include "ferry/status.h"

namespace ferry_py {

struct StatusError : std::exception {
  ferry::StatusCode code;
  std::string message;
  StatusError(ferry::StatusCode c, std::string m) : code(c), message(std::move(m)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

[[noreturn]] inline void raise(ferry::StatusCode code, std::string message) {
  throw StatusError(code, std::move(message));
}
[[noreturn]] inline void raise(const ferry::Status& s) {
  throw StatusError(
      s.code(), s.message().empty() ? std::string(ferry::status_code_name(s.code())) : s.message());
}
inline void check(const ferry::Status& s) {
  if (!s.ok()) raise(s);
}
template <typename T>
T unwrap(ferry::Result<T>&& r) {
  if (!r.ok()) raise(r.status());
  return std::move(r).value();
}

}  // namespace ferry_py
