#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>

#include "common/status.h"

namespace fairring {

using Clock = std::chrono::steady_clock;

// An owned TCP socket descriptor. Closing is separate from shutting down so
// that a thread blocked on the socket can be woken (shutdown) before the
// descriptor number is released (close) and possibly reused under it.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket();
  Socket(Socket&& other) noexcept;
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const {
    return fd_;
  }
  bool valid() const {
    return fd_ >= 0;
  }
  // Wakes every thread blocked on this socket; the peer sees the close.
  void shutdown() const;
  void close();

 private:
  int fd_{-1};
};

// "tcp://127.0.0.1:4242" or "tcp://[::1]:4242".
std::string formatUrl(const std::string& host, int port);

// A listening socket on `host` (an IP literal), on a port the kernel picks.
// The socket is non-blocking: it is only ever accepted from under poll().
Status listenOn(const std::string& host, Socket& out, std::string& url);

// What one attempt to connect came to: kNotYet (refused or unanswered by
// `until`: nothing there yet, a full queue, a slow host) is worth another
// try, kFailed will not get better.
enum class ConnectAttempt { kConnected, kNotYet, kFailed };

// One attempt to connect to `url`, given up at `until`; unless kConnected,
// `why` says what happened.
ConnectAttempt connectOnce(const std::string& url, Clock::time_point until, Socket& out, Status& why);

// Blocking, whole-buffer I/O. `closed` is set when the peer closed cleanly
// before the first byte (an orderly end rather than a torn message).
Status readFull(const Socket& s, void* data, size_t bytes, bool* closed = nullptr);
Status writeFull(const Socket& s, struct iovec* iov, int count);
Status writeFull(const Socket& s, const void* data, size_t bytes);

// Waits until `s` is readable or `deadline` passes (false then).
// `stop` (if given) is asked every 50 ms: true ends the wait early (false).
bool waitReadable(const Socket& s, Clock::time_point deadline, const std::function<bool()>& stop = {});

// Whether `s` is readable now (data, or the peer's close), without waiting.
bool hasInput(const Socket& s);

void setBlocking(const Socket& s, bool blocking);
void setNoDelay(const Socket& s);
// A blocking send returns once at most `bytes` of what it wrote wait unsent in
// the kernel (TCP_NOTSENT_LOWAT): the order of sends on different sockets is
// then nearly the order on the wire.
void setLowUnsent(const Socket& s, int bytes);
// TCP_CONGESTION: the socket's congestion control algorithm ("reno", ...).
Status setCongestion(const Socket& s, const std::string& algorithm);

// "127.0.0.1:53412": who is at the other end, for messages.
std::string peerName(const Socket& s);

} // namespace fairring
