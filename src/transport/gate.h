#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "transport/handshake.h"
#include "transport/socket.h"

namespace fairring {

// Local peers (same machine) and rail peers (other machines) connect to
// different listeners: the local one needs only loopback, and only there may
// a connection offer to have its bodies read out of the sender's memory.
enum class Reach : int { kRail = 0, kLocal = 1 };

// The only thing that listens, and only during start-up. It accepts, reads
// exactly one fixed-size hello from each connection and lets a connection
// join only if the hello names a rank of this job that is expected on this
// listener and carries the job token. Strangers (garbage, HTTP, a wrong
// token, silence) are closed without anything beyond those bytes being read,
// so none of them can disturb the job; a port scan is just a closed socket.
class Gate {
 public:
  // Whether `hello` (with the right token), arriving on `reach`, may join.
  using Check = std::function<HelloReply::Verdict(Reach reach, const Hello& hello)>;
  // Takes a connection that passed Check and got its reply.
  using Adopt = std::function<void(Reach reach, const Hello& hello, Socket socket, bool readsMemory)>;

  Gate(std::string who, std::string token, Check check, Adopt adopt);
  ~Gate();

  // Opens the listener for `reach` on `host` (before start()).
  Status listen(Reach reach, const std::string& host, std::string& url);
  void start();
  // Closes the listeners and every connection not adopted yet; joins.
  void stop();

 private:
  struct Pending {
    Reach reach;
    Socket socket;
    Clock::time_point deadline;
    uint8_t hello[Hello::kBytes];
    size_t have{0};
  };

  void run();
  void acceptAll(Reach reach);
  void makeRoom();
  // False once the connection is done with (adopted or dropped).
  bool readHello(Pending& p);
  // Answers a hello that carries our magic with why it may not join; closes.
  void turnAway(Pending& p, HelloReply reply, const std::string& why);
  void refuse(Pending& p, const std::string& why);

  const std::string who_;
  const std::string token_;
  const Check check_;
  const Adopt adopt_;
  Socket listeners_[2];
  Socket wake_; // an eventfd: stop() interrupts poll()
  std::vector<Pending> pending_;
  std::thread thread_;
  std::mutex stopMu_;
  bool stopped_{false};
  int refusals_{0};
};

} // namespace fairring
