#include "transport/gate.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <iostream>

#include "transport/memory_reader.h"

namespace fairring {

namespace {
// A rank sends its hello the moment it connects; anything slower is not one.
constexpr auto kHelloTimeout = std::chrono::seconds(10);
// Connections that have not said hello yet; a storm beyond this evicts the
// oldest, so that it cannot exhaust descriptors.
constexpr size_t kMaxPending = 64;
// Refusals are logged, but a scan must not flood the log.
constexpr int kMaxLoggedRefusals = 5;
} // namespace

Gate::Gate(std::string who, std::string token, Check check, Adopt adopt)
    : who_(std::move(who)),
      token_(std::move(token)),
      check_(std::move(check)),
      adopt_(std::move(adopt)),
      wake_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}

Gate::~Gate() {
  stop();
}

Status Gate::listen(Reach reach, const std::string& host, std::string& url) {
  return listenOn(host, listeners_[static_cast<int>(reach)], url);
}

void Gate::start() {
  thread_ = std::thread([this] { run(); });
}

void Gate::stop() {
  {
    std::lock_guard<std::mutex> lock(stopMu_);
    if (stopped_) {
      return;
    }
    stopped_ = true;
  }
  const uint64_t one = 1;
  if (wake_.valid() && ::write(wake_.fd(), &one, sizeof(one)) < 0) {
    // The thread also sees stopped_ within its poll period.
  }
  if (thread_.joinable()) {
    thread_.join();
  }
  // Closed, a port refuses connections instead of queueing them.
  for (Socket& l : listeners_) {
    l.close();
  }
  pending_.clear();
}

void Gate::run() {
  while (true) {
    {
      std::lock_guard<std::mutex> lock(stopMu_);
      if (stopped_) {
        return;
      }
    }
    std::vector<struct pollfd> fds;
    fds.push_back({wake_.fd(), POLLIN, 0});
    for (const Socket& l : listeners_) {
      fds.push_back({l.valid() ? l.fd() : -1, POLLIN, 0});
    }
    auto next = Clock::now() + std::chrono::seconds(1);
    for (const Pending& p : pending_) {
      fds.push_back({p.socket.fd(), POLLIN, 0});
      next = std::min(next, p.deadline);
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count();
    const int rc = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(wait, 0) + 1));
    if (rc < 0 && errno != EINTR) {
      std::cerr << "fairring: " << who_ << " stopped accepting connections: poll failed" << std::endl;
      return;
    }
    if (fds[0].revents) {
      continue; // stop() was called
    }
    // Hellos first: a peer's hello already waiting must not be evicted by a
    // storm of new connections accepted in the same round.
    std::vector<Pending> kept;
    const auto now = Clock::now();
    for (size_t i = 0; i < pending_.size(); ++i) {
      Pending& p = pending_[i];
      if (fds[3 + i].revents) {
        if (!readHello(p)) {
          continue;
        }
      } else if (now >= p.deadline) {
        refuse(p, "it said nothing for " + std::to_string(kHelloTimeout.count()) + " s");
        continue;
      }
      kept.push_back(std::move(p));
    }
    pending_ = std::move(kept);
    for (int r = 0; r < 2; ++r) {
      if (fds[1 + r].revents) {
        acceptAll(static_cast<Reach>(r));
      }
    }
  }
}

void Gate::acceptAll(Reach reach) {
  const Socket& listener = listeners_[static_cast<int>(reach)];
  while (true) {
    Socket s(::accept4(listener.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!s.valid()) {
      return; // EAGAIN: nothing more; anything else is the stranger's problem
    }
    if (pending_.size() >= kMaxPending) {
      makeRoom();
    }
    Pending p{reach, std::move(s), Clock::now() + kHelloTimeout, {}, 0};
    pending_.push_back(std::move(p));
  }
}

void Gate::makeRoom() {
  // A peer sends its hello the moment it connects, so by now it has arrived:
  // take what has, then evict the oldest of those that said nothing at all.
  std::vector<Pending> kept;
  for (Pending& p : pending_) {
    if (readHello(p)) {
      kept.push_back(std::move(p));
    }
  }
  pending_ = std::move(kept);
  if (pending_.size() < kMaxPending) {
    return;
  }
  auto silent = std::find_if(pending_.begin(), pending_.end(), [](const Pending& p) { return p.have == 0; });
  auto victim = silent != pending_.end() ? silent : pending_.begin();
  refuse(*victim, "too many connections were waiting to say hello");
  pending_.erase(victim);
}

bool Gate::readHello(Pending& p) {
  const ssize_t n = ::recv(p.socket.fd(), p.hello + p.have, Hello::kBytes - p.have, 0);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
    return false; // gone before saying hello (a scan): nothing to refuse
  }
  if (n < 0) {
    return true;
  }
  p.have += static_cast<size_t>(n);
  if (p.have < Hello::kBytes && mayBeHello(p.hello, p.have)) {
    return true;
  }
  const auto hello = p.have == Hello::kBytes ? decodeHello(p.hello) : std::nullopt;
  if (!hello) {
    const auto version = p.have == Hello::kBytes ? helloVersionOf(p.hello) : std::nullopt;
    if (version && *version != helloVersion()) {
      HelloReply reply{HelloReply::Verdict::kWrongVersion, false, helloVersion()};
      turnAway(p, reply, describeVersions(*version, helloVersion()));
    } else {
      refuse(p, "it is not a fairring hello");
    }
    return false;
  }
  HelloReply reply{HelloReply::Verdict::kAccepted, false, helloVersion()};
  if (!sameToken(hello->token, token_)) {
    reply.verdict = HelloReply::Verdict::kWrongToken;
  } else {
    reply.verdict = check_(p.reach, *hello);
  }
  if (reply.verdict != HelloReply::Verdict::kAccepted) {
    turnAway(p, reply, "claiming rank " + std::to_string(hello->rank) + ": " + describe(reply.verdict));
    return false;
  }
  const bool readsMemory =
      p.reach == Reach::kLocal && canReadMemoryOf(hello->pid, hello->probeAddress, hello->probeValue);
  setBlocking(p.socket, true);
  setNoDelay(p.socket);
  reply.readsMemory = readsMemory;
  const auto bytes = encode(reply);
  if (!writeFull(p.socket, bytes.data(), bytes.size()).ok()) {
    return false;
  }
  adopt_(p.reach, *hello, std::move(p.socket), readsMemory);
  return false;
}

void Gate::turnAway(Pending& p, HelloReply reply, const std::string& why) {
  const auto bytes = encode(reply);
  // Eight bytes into an empty socket buffer: this does not block. If it fails,
  // the close still says no.
  if (::send(p.socket.fd(), bytes.data(), bytes.size(), MSG_NOSIGNAL) < 0) {
    // nothing more to do
  }
  refuse(p, why);
}

void Gate::refuse(Pending& p, const std::string& why) {
  if (++refusals_ <= kMaxLoggedRefusals) {
    std::cerr << "fairring: " << who_ << " refused a connection from " << peerName(p.socket) << ": " << why
              << (refusals_ == kMaxLoggedRefusals ? " (further refusals are not logged)" : "") << std::endl;
  }
  p.socket.close();
}

} // namespace fairring
