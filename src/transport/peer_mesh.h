#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "common/status.h"
#include "topology/rank_layout.h"
#include "transport/connections.h"
#include "transport/gate.h"
#include "transport/handshake.h"
#include "transport/socket.h"
#include "transport/wire.h"

namespace fairring {

// One TCP connection per (peer, track, direction) between this rank and the
// ranks it exchanges with (its local peers and its rail peers). Outbound
// connections only carry messages out, inbound ones only in, one message at
// a time: the receiver sees a header, decides where the body goes (or
// waits), then reads it. Each inbound connection and each local outbound one
// has its own thread, blocked in the kernel when idle, so a slow peer holds
// up only its own connection; the rail outbound connections of a track share
// one writer (see railWriters_).
class PeerMesh {
 public:
  struct Options {
    std::string listenAddress; // IP to bind the rail listener to
    std::string token; // secret shared through the rendezvous store
    std::chrono::milliseconds startTimeout; // start() connects every peer within it
    // The TCP congestion control of the rail sockets a rank sends to several
    // machines on, in turn (empty: the system's); see connect().
    std::string railCongestion;
  };

  // Called on a connection's thread once per arriving message (header only:
  // call receive() to read its body), or once with a failure of the connection.
  using OnMessage = std::function<void(int peer, Track track, Status status, std::string header, size_t bytes)>;
  using Done = SendDone;

  PeerMesh(const RankLayout& layout, Options options, OnMessage onMessage);
  ~PeerMesh();

  // Asked while start() waits (every few ms): a reason to stop connecting,
  // such as another group of the same ranks having lost one of them.
  using GiveUp = std::function<std::optional<std::string>()>;

  // Listens, publishes the address in the store, connects to every peer and
  // waits until every peer has connected back, all within the timeout; then
  // stops listening. Every wait ends early at interrupt() or at `giveUp`.
  Status start(c10d::Store& store, GiveUp giveUp = {});

  enum class Priority : uint8_t {
    kInOrder, // behind everything queued for that connection's writer
    kFirst, // ahead of everything not yet being written (a failure's abort)
  };

  // Queues a message; `done` runs on the writer's thread once it is sent
  // (for a body read out of this process's memory: once the peer has read it).
  void send(
      int peer,
      Track track,
      std::string header,
      void* data,
      size_t bytes,
      Done done,
      Priority priority = Priority::kInOrder);

  // Reads the body of the message last announced on (peer, track) into
  // `data` (null: drops it), then waits for the next message on that
  // connection.
  void receive(int peer, Track track, void* data, size_t bytes, Done done);

  // Whether the reader of (peer, track) has yet to reach what its peer last
  // sent (a header in hand, or bytes or a close waiting in its socket), as a
  // reader waiting for the CPU has; false while it waits for a receive() (it
  // reads nothing more until then) and once it has exited.
  bool readerBehind(int peer, Track track);

  // Makes a start() in progress give up at once (a shutdown during start-up);
  // connections already made stay until close(). Idempotent.
  void interrupt();

  // Closes every connection and joins their threads. Idempotent.
  void close();

 private:
  using Key = std::pair<int, Track>;
  using Inbound = InboundConnection;
  using Outbound = OutboundConnection;
  using Writer = ConnectionWriter;
  using Outgoing = OutgoingMessage;

  Reach reachOf(int peer) const;
  // The connection for `key`, or null once closed.
  template <typename Connection>
  Connection* find(const std::map<Key, std::unique_ptr<Connection>>& connections, Key key);
  HelloReply::Verdict check(Reach reach, const Hello& hello);
  void adopt(const Hello& hello, Socket socket, bool readsMemory);
  // Creates the gate and its listeners (`urls`, by Reach), unless closed meanwhile.
  Status openGate(const std::string& me, std::string urls[2]);
  // Waits until every peer has connected back (both tracks).
  Status awaitPeers(const std::string& me, const std::vector<int>& peers, Clock::time_point deadline);
  // One connection to `peer`; `dialed` false (and the error why) where
  // nothing took the dial yet: worth another try.
  Status connect(int peer, Track track, const std::string& url, Clock::time_point deadline, bool& dialed);
  // Connects to `url` and exchanges the hello, retrying where the gate closed
  // the connection without a verdict; the verdict in `reply`.
  Status hello(
      int peer,
      Track track,
      const std::string& url,
      Clock::time_point deadline,
      Socket& socket,
      HelloReply& reply,
      bool& dialed);
  // Adds the connection to `peer` and its writer (rail connections of a track share one).
  Status add(int peer, Track track, Socket socket, bool readsMemory);
  // Connects to each peer once its address is in the store, in whatever order
  // they appear: a peer that never publishes (dead, or stuck before its start)
  // holds no other connection back, so the peers waiting for this rank do not
  // time out naming it in place of the rank at fault. The store is polled so
  // that interrupt() and the deadline end the wait.
  Status connectAll(c10d::Store& store, const std::vector<int>& peers, Clock::time_point deadline);
  bool interrupted();
  // Why start() stops now (interrupt(), close() or giveUp), or nullopt.
  std::optional<std::string> stopped();
  void readLoop(Inbound& in);
  void writeLoop(Writer& writer);
  // Holds an abort where a test armed it; false if the mesh closed meanwhile.
  bool holdFirst(Writer& writer, const Outbound& out);
  Status transmit(Outbound& out, Outgoing& msg);
  Status skip(const Socket& socket, size_t bytes);
  void awaitDrained(int peer);
  void report(int peer, Track track, Status status);
  Status failure(const std::string& what, int peer, const std::string& why) const;

  const RankLayout& layout_;
  const Options options_;
  const OnMessage onMessage_;
  // The memory probe: its address and value go in every local hello.
  const uint64_t probe_;
  std::unique_ptr<Gate> gate_;
  GiveUp giveUp_; // set by start(), used only by its thread

  std::mutex mu_;
  std::condition_variable cv_;
  bool closed_{false};
  bool interrupted_{false};
  std::map<Key, std::unique_ptr<Outbound>> outbound_;
  std::vector<std::unique_ptr<Writer>> writers_;
  // Messages to other machines share this rank's link. The rail connections
  // of one track share one writer, which sends their messages one at a time in
  // the order the engine queued them (segment by segment, peers in rotation:
  // at any moment every rank sends to a different machine), each socket
  // keeping little unsent data (setLowUnsent, with 2+ rail peers) so that this
  // is also the order on the wire, rather than 2·(M-1) flows fighting for the
  // link. On 4 × 1 at 1 Gbit/s, letting each socket buffer what the kernel
  // allows instead cost 3-9% (docs/design.md). A writer blocked on one peer
  // (which holds a reduce message until it has a staging slot) delays this
  // track's messages to the others; the engine's order makes that safe
  // (docs/design.md, "Tracks, staging and why it does not deadlock").
  Writer* railWriters_[kNumTracks] = {nullptr, nullptr};
  std::map<Key, std::unique_ptr<Inbound>> inbound_;
};

} // namespace fairring
