#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace fairring {

// Copies `bytes` from address `address` of process `pid` (a rank on this
// machine) into `dst`, with process_vm_readv: one copy, where the socket
// path costs two and a trip through the TCP stack. The kernel allows it
// between processes of the same user unless a ptrace policy forbids it,
// which is why each connection tries it once at start-up (canReadMemoryOf).
Status readMemoryOf(pid_t pid, uint64_t address, void* dst, size_t bytes);

// Whether the 8 bytes at `address` in `pid` can be read and equal `expected`:
// proves both that the kernel allows the copy and that `pid` names the
// sender in this process's view (containers may not share a pid namespace).
bool canReadMemoryOf(pid_t pid, uint64_t address, uint64_t expected);

} // namespace fairring
