#include "transport/memory_reader.h"

#include <sys/uio.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace fairring {

Status readMemoryOf(pid_t pid, uint64_t address, void* dst, size_t bytes) {
  size_t done = 0;
  while (done < bytes) {
    struct iovec local {static_cast<char*>(dst) + done, bytes - done};
    struct iovec remote {reinterpret_cast<void*>(address + done), bytes - done};
    const ssize_t n = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      return Status::error(std::string("reading the sender's memory failed: ") + std::strerror(errno));
    }
    if (n == 0) {
      return Status::error("reading the sender's memory returned nothing");
    }
    done += static_cast<size_t>(n);
  }
  return Status();
}

bool canReadMemoryOf(pid_t pid, uint64_t address, uint64_t expected) {
  uint64_t value = 0;
  return pid > 0 && address != 0 && readMemoryOf(pid, address, &value, sizeof(value)).ok() && value == expected;
}

} // namespace fairring
