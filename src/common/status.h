#pragma once

#include <string>
#include <utility>

namespace fairring {

// Errors travel as values through the transport and pipeline layers, so that a
// failure on a connection's thread can be attached to the operations it affects
// instead of unwinding through a callback that has no caller to catch it.
class Status {
 public:
  Status() = default;

  static Status error(std::string message) {
    Status s;
    s.failed_ = true;
    s.message_ = std::move(message);
    return s;
  }

  bool ok() const {
    return !failed_;
  }

  explicit operator bool() const {
    return failed_;
  }

  const std::string& message() const {
    return message_;
  }

 private:
  bool failed_{false};
  std::string message_;
};

} // namespace fairring
