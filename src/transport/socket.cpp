#include "transport/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace fairring {

namespace {

std::string errnoText(int err) {
  return std::string(std::strerror(err));
}

// Splits "tcp://HOST:PORT" (HOST may be "[v6]").
bool splitUrl(const std::string& url, std::string& host, std::string& port) {
  const std::string scheme = "tcp://";
  if (url.compare(0, scheme.size(), scheme) != 0) {
    return false;
  }
  const std::string rest = url.substr(scheme.size());
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == rest.size()) {
    return false;
  }
  host = rest.substr(0, colon);
  port = rest.substr(colon + 1);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return true;
}

Status resolve(const std::string& host, const std::string& port, struct addrinfo** out) {
  struct addrinfo hints {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  // Only literals: a name lookup could block start-up on DNS.
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, out);
  if (rc != 0) {
    return Status::error("'" + host + "' is not an IP address (" + ::gai_strerror(rc) + ")");
  }
  return Status();
}

std::string hostOf(const struct sockaddr_storage& addr, int* port) {
  char text[INET6_ADDRSTRLEN] = {0};
  if (addr.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const struct sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof(text));
    *port = ntohs(a->sin6_port);
  } else {
    const auto* a = reinterpret_cast<const struct sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof(text));
    *port = ntohs(a->sin_port);
  }
  return text;
}

} // namespace

Socket::~Socket() {
  close();
}

Socket::Socket(Socket&& other) noexcept : fd_(other.fd_) {
  other.fd_ = -1;
}

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

void Socket::shutdown() const {
  if (fd_ >= 0) {
    ::shutdown(fd_, SHUT_RDWR);
  }
}

void Socket::close() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

std::string formatUrl(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos;
  return "tcp://" + (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

Status listenOn(const std::string& host, Socket& out, std::string& url) {
  struct addrinfo* info = nullptr;
  if (Status s = resolve(host, "0", &info); !s.ok()) {
    return Status::error("cannot listen on " + s.message());
  }
  Socket sock(::socket(info->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  int err = sock.valid() ? 0 : errno;
  if (!err && ::bind(sock.fd(), info->ai_addr, info->ai_addrlen) != 0) {
    err = errno;
  }
  ::freeaddrinfo(info);
  if (!err && ::listen(sock.fd(), 128) != 0) {
    err = errno;
  }
  struct sockaddr_storage bound {};
  socklen_t len = sizeof(bound);
  if (!err && ::getsockname(sock.fd(), reinterpret_cast<struct sockaddr*>(&bound), &len) != 0) {
    err = errno;
  }
  if (err) {
    return Status::error("cannot listen on " + host + ": " + errnoText(err));
  }
  int port = 0;
  const std::string boundHost = hostOf(bound, &port);
  url = formatUrl(boundHost, port);
  out = std::move(sock);
  return Status();
}

namespace {

// The dial's end: connected, or the error that ended it (ETIMEDOUT at `until`).
int dial(const Socket& sock, const struct addrinfo* info, Clock::time_point until) {
  // Non-blocking, so that a host that never answers (no RST: powered off,
  // partitioned) costs the deadline, not the kernel's minutes of SYN retries.
  setBlocking(sock, false);
  if (::connect(sock.fd(), info->ai_addr, info->ai_addrlen) != 0 && errno != EINPROGRESS) {
    return errno;
  }
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    struct pollfd p{sock.fd(), POLLOUT, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::clamp<int64_t>(left, 0, 100)));
    if (rc < 0 && errno != EINTR) {
      return errno;
    }
    if (rc > 0) {
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(sock.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
      return err;
    }
    if (Clock::now() >= until) {
      return ETIMEDOUT;
    }
  }
}

} // namespace

ConnectAttempt connectOnce(const std::string& url, Clock::time_point until, Socket& out, Status& why) {
  std::string host, port;
  if (!splitUrl(url, host, port)) {
    why = Status::error("malformed address '" + url + "'");
    return ConnectAttempt::kFailed;
  }
  struct addrinfo* info = nullptr;
  if (Status s = resolve(host, port, &info); !s.ok()) {
    why = Status::error("cannot connect to " + url + ": " + s.message());
    return ConnectAttempt::kFailed;
  }
  Socket sock(::socket(info->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const int err = sock.valid() ? dial(sock, info, until) : errno;
  ::freeaddrinfo(info);
  if (err == 0) {
    setBlocking(sock, true);
    setNoDelay(sock);
    out = std::move(sock);
    return ConnectAttempt::kConnected;
  }
  why = Status::error("cannot connect to " + url + ": " + errnoText(err));
  // A full accept queue refuses too, and a host may answer late; anything
  // else will not get better.
  const bool transient = err == ECONNREFUSED || err == EAGAIN || err == EINTR || err == ETIMEDOUT;
  return transient ? ConnectAttempt::kNotYet : ConnectAttempt::kFailed;
}

Status readFull(const Socket& s, void* data, size_t bytes, bool* closed) {
  auto* p = static_cast<char*>(data);
  size_t done = 0;
  if (closed) {
    *closed = false;
  }
  while (done < bytes) {
    const ssize_t n = ::recv(s.fd(), p + done, bytes - done, 0);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n == 0) {
      if (closed && done == 0) {
        *closed = true;
      }
      return Status::error(done == 0 ? "connection closed" : "connection closed in the middle of a message");
    } else if (errno != EINTR) {
      return Status::error(errnoText(errno));
    }
  }
  return Status();
}

Status writeFull(const Socket& s, struct iovec* iov, int count) {
  while (count > 0) {
    struct msghdr msg {};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(count);
    // MSG_NOSIGNAL: a peer that went away is an error value here, not SIGPIPE.
    ssize_t n = ::sendmsg(s.fd(), &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      return Status::error(errnoText(errno));
    }
    while (count > 0 && static_cast<size_t>(n) >= iov->iov_len) {
      n -= static_cast<ssize_t>(iov->iov_len);
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + n;
      iov->iov_len -= static_cast<size_t>(n);
    }
  }
  return Status();
}

Status writeFull(const Socket& s, const void* data, size_t bytes) {
  struct iovec iov {const_cast<void*>(data), bytes};
  return writeFull(s, &iov, 1);
}

bool waitReadable(const Socket& s, Clock::time_point deadline, const std::function<bool()>& stop) {
  const long long slice = stop ? 50 : 1000;
  while (true) {
    if (stop && stop()) {
      return false;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      return false;
    }
    struct pollfd pfd {s.fd(), POLLIN, 0};
    const int rc = ::poll(&pfd, 1, static_cast<int>(std::min<long long>(left, slice)));
    if (rc > 0) {
      return true;
    }
    if (rc < 0 && errno != EINTR) {
      return true; // let the read report it
    }
  }
}

bool hasInput(const Socket& s) {
  struct pollfd pfd {s.fd(), POLLIN, 0};
  return ::poll(&pfd, 1, 0) != 0; // an error too: let the read report it
}

void setBlocking(const Socket& s, bool blocking) {
  const int flags = ::fcntl(s.fd(), F_GETFL, 0);
  ::fcntl(s.fd(), F_SETFL, blocking ? (flags & ~O_NONBLOCK) : (flags | O_NONBLOCK));
}

void setNoDelay(const Socket& s) {
  // Headers and aborts are small and latency-bound; bodies go in one writev.
  int one = 1;
  ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void setLowUnsent(const Socket& s, int bytes) {
  ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NOTSENT_LOWAT, &bytes, sizeof(bytes));
}

Status setCongestion(const Socket& s, const std::string& algorithm) {
  if (::setsockopt(s.fd(), IPPROTO_TCP, TCP_CONGESTION, algorithm.data(), algorithm.size()) != 0) {
    return Status::error(
        "the kernel refused TCP congestion control '" + algorithm + "' (" + std::strerror(errno) +
        "): it must be in /proc/sys/net/ipv4/tcp_allowed_congestion_control, or the process needs "
        "CAP_NET_ADMIN");
  }
  return Status();
}

std::string peerName(const Socket& s) {
  struct sockaddr_storage addr {};
  socklen_t len = sizeof(addr);
  if (::getpeername(s.fd(), reinterpret_cast<struct sockaddr*>(&addr), &len) != 0) {
    return "an unknown address";
  }
  int port = 0;
  const std::string host = hostOf(addr, &port);
  return (addr.ss_family == AF_INET6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

} // namespace fairring
