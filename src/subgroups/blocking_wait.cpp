#include "subgroups/blocking_wait.h"

#include <array>
#include <cctype>
#include <cstdlib>

namespace fairring {

BlockingWait readBlockingWait(const std::function<const char*(const char*)>& lookup) {
  static constexpr std::array<const char*, 2> kNames{"TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"};
  BlockingWait read;
  // Last name first, as getCvarBool does: an earlier name's value replaces a
  // later one's, and any value that is not a truth value is an error.
  for (auto it = kNames.rbegin(); it != kNames.rend(); ++it) {
    const char* raw = lookup(*it);
    if (raw == nullptr) {
      continue;
    }
    std::string value(raw);
    for (char& c : value) {
      c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    if (value == "1" || value == "y" || value == "yes" || value == "t" || value == "true") {
      read.on = true;
    } else if (value == "0" || value == "n" || value == "no" || value == "f" || value == "false") {
      read.on = false;
    } else {
      return BlockingWait{
          false,
          Status::error(
              std::string("fairring: ") + *it + "='" + raw +
              "' is not a truth value; use 1, true, yes, y or t (or 0, false, no, n, f)")};
    }
  }
  return read;
}

BlockingWait blockingWaitFromEnv() {
  return readBlockingWait([](const char* name) { return std::getenv(name); });
}

} // namespace fairring
