#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <tensorpipe/tensorpipe.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "common/status.h"
#include "topology/rank_layout.h"
#include "transport/wire.h"

namespace fairring {

// One TensorPipe pipe per (peer, lane, direction) between this rank and the
// ranks it exchanges with (its local peers and its rail peers). Outbound
// pipes only write; inbound pipes only read, one message at a time: the
// receiver sees a header, decides where the bytes go (or waits), then reads.
class PeerMesh {
 public:
  struct Options {
    std::string listenAddress; // IP to bind the TCP listener to
    std::string token; // secret shared through the rendezvous store
    std::chrono::milliseconds timeout;
  };

  // Local peers (same machine) and rail peers (other machines) are reached
  // through separate TensorPipe contexts: the local one may use channels that
  // copy through memory (cma), which must never carry traffic between
  // machines, not even simulated ones sharing a host.
  enum class Reach : int { kRail = 0, kLocal = 1 };

  // Called on a TensorPipe thread once per arriving message (header only:
  // call receive() to read its body), or once with a failure of the pipe.
  using OnMessage = std::function<void(int peer, Lane lane, Status status, std::string header, size_t bytes)>;
  using Done = std::function<void(Status)>;

  PeerMesh(const RankLayout& layout, Options options, OnMessage onMessage);
  ~PeerMesh();

  // Listens, publishes the address in the store, connects to every peer and
  // waits until every peer has connected back, all within the timeout; then
  // stops listening.
  Status start(c10d::Store& store);

  // Queues a message; `done` runs on a TensorPipe thread when it is sent.
  void send(int peer, Lane lane, std::string header, void* data, size_t bytes, Done done);

  // Reads the body of the message last announced on (peer, lane) into
  // `data`, then waits for the next message on that pipe.
  void receive(int peer, Lane lane, void* data, size_t bytes, Done done);

  // Closes every pipe and joins TensorPipe's threads. Idempotent.
  void close();

 private:
  using Key = std::pair<int, Lane>;

  struct Endpoint {
    std::shared_ptr<tensorpipe::Context> context;
    std::shared_ptr<tensorpipe::Listener> listener;
    std::string url;
  };

  Reach reachOf(int peer) const;
  void closeListeners();
  void openEndpoint(Reach reach);
  void accept(Reach reach);
  void onAccepted(Reach reach, std::shared_ptr<tensorpipe::Pipe> pipe);
  void readNext(int peer, Lane lane, const std::shared_ptr<tensorpipe::Pipe>& pipe);
  Status failure(const std::string& what, int peer, const tensorpipe::Error& error) const;

  const RankLayout& layout_;
  const Options options_;
  const OnMessage onMessage_;
  Endpoint endpoints_[2];

  std::mutex mu_;
  std::condition_variable cv_;
  bool closed_{false};
  std::map<Key, std::shared_ptr<tensorpipe::Pipe>> outbound_;
  std::map<Key, std::shared_ptr<tensorpipe::Pipe>> inbound_;
  // Accepted pipes that have not yet said who they are.
  std::vector<std::shared_ptr<tensorpipe::Pipe>> unidentified_;
};

} // namespace fairring
