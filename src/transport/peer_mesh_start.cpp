// PeerMesh's start-up: listen, publish, connect to every peer (a hello each,
// checked by the peer's gate) and wait for every peer to connect back.

#include <unistd.h>

#include <algorithm>
#include <optional>
#include <thread>

#include "faults/fault_points.h"
#include "faults/plants.h"
#include "transport/handshake.h"
#include "transport/peer_mesh.h"

namespace fairring {

namespace {

// Unsent bytes a rail socket may hold (see setLowUnsent): about 1 ms of a
// 1 Gbit/s link, enough to keep it busy while the next message is issued.
constexpr int kRailUnsentBytes = 128 * 1024;
// Between attempts to get past a gate that had no room.
constexpr auto kRetryPause = std::chrono::milliseconds(50);
// The longest one dial may wait for a host's answer: a peer that does not
// answer yet holds the others' connections back no longer than this.
constexpr auto kDialSlice = std::chrono::milliseconds(200);
// Between looks at the store for a peer's address.
constexpr auto kStorePoll = std::chrono::milliseconds(10);

std::string addressKey(Reach reach, int rank) {
  return std::string(reach == Reach::kLocal ? "addr/local/" : "addr/rail/") + std::to_string(rank);
}

} // namespace

Status PeerMesh::start(c10d::Store& store, GiveUp giveUp) {
  giveUp_ = std::move(giveUp);
  const std::string me = layout_.describe(layout_.rank());
  if (options_.token.size() != Hello::kTokenBytes) {
    return Status::error(
        "fairring: the job token must be " + std::to_string(Hello::kTokenBytes) + " characters, got " +
        std::to_string(options_.token.size()));
  }
  const auto deadline = Clock::now() + options_.startTimeout;
  const std::vector<int> peers = layout_.peers();
  if (peers.empty()) {
    return Status();
  }
  std::string urls[2];
  if (Status s = openGate(me, urls); !s.ok()) {
    return s;
  }
  try {
    for (int r = 0; r < 2; ++r) {
      if (!urls[r].empty()) {
        store.set(addressKey(static_cast<Reach>(r), layout_.rank()), std::vector<uint8_t>(urls[r].begin(), urls[r].end()));
      }
    }
    if (Status s = connectAll(store, peers, deadline); !s.ok()) {
      return s;
    }
  } catch (const std::exception& e) {
    return Status::error(
        "fairring: exchanging listener addresses through the store failed on " + me + ": " + e.what());
  }
  if (Status s = awaitPeers(me, peers, deadline); !s.ok()) {
    return s;
  }
  // Every peer is in: nothing needs to listen any more, and a closed port
  // refuses strangers before they can send a byte.
  gate_->stop();
  return Status();
}

Status PeerMesh::openGate(const std::string& me, std::string urls[2]) {
  auto gate = std::make_unique<Gate>(
      me, options_.token, [this](Reach reach, const Hello& h) { return check(reach, h); },
      [this](Reach, const Hello& h, Socket s, bool readsMemory) { adopt(h, std::move(s), readsMemory); });
  for (Reach reach : {Reach::kLocal, Reach::kRail}) {
    const bool needed = reach == Reach::kLocal ? layout_.localSize() > 1 : layout_.numMachines() > 1;
    if (!needed) {
      continue;
    }
    // Local peers share this machine, so their listener needs only loopback.
    const std::string host = reach == Reach::kLocal ? "127.0.0.1" : options_.listenAddress;
    if (Status s = gate->listen(reach, host, urls[static_cast<int>(reach)]); !s.ok()) {
      return Status::error("fairring: " + me + ": " + s.message());
    }
  }
  // A close() meanwhile (a shutdown during start-up) must find the gate, or
  // this start must see the close.
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_ || interrupted_) {
    return Status::error("fairring: the process group was shut down while " + me + " was connecting");
  }
  gate_ = std::move(gate);
  gate_->start();
  return Status();
}

Status PeerMesh::awaitPeers(const std::string& me, const std::vector<int>& peers, Clock::time_point deadline) {
  const size_t expected = peers.size() * kNumTracks;
  auto missing = [&] {
    std::string named;
    std::lock_guard<std::mutex> lock(mu_);
    for (int peer : peers) {
      if (!inbound_.count({peer, Track::kReduce}) || !inbound_.count({peer, Track::kGather})) {
        named += (named.empty() ? "" : ", ") + layout_.describe(peer);
      }
    }
    return named;
  };
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      const auto until = std::min(deadline, Clock::now() + kStorePoll);
      cv_.wait_until(lock, until, [&] { return closed_ || interrupted_ || inbound_.size() == expected; });
      if (!closed_ && !interrupted_ && inbound_.size() == expected) {
        return Status();
      }
    }
    if (auto why = stopped()) { // a shutdown, or the give-up (asked without our lock)
      // What it waited for: a peer the give-up's reason does not name is how it
      // reaches this rank (the peer waits in turn, for the rank at fault).
      const std::string waited = missing();
      bool shutDown = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        shutDown = closed_ || interrupted_;
      }
      if (waited.empty() && !shutDown) {
        return Status(); // all in meanwhile: the ranks' last wait sees the failure
      }
      return Status::error(*why + " (while waiting for " + waited + " to connect)");
    }
    if (Clock::now() >= deadline) {
      return Status::error(
          "fairring: " + me + " timed out after " + std::to_string(options_.startTimeout.count()) + " ms waiting for " +
          missing() + " to connect");
    }
  }
}

Status PeerMesh::connectAll(c10d::Store& store, const std::vector<int>& peers, Clock::time_point deadline) {
  struct Pending {
    int peer;
    std::string url; // empty until the peer published it
    int tracksDone{0};
    Status notYet; // why its last dial did not connect
  };
  std::vector<Pending> pending;
  for (int peer : peers) {
    pending.push_back({peer, {}, 0, Status()});
  }
  for (;;) {
    bool progressed = false;
    for (auto it = pending.begin(); it != pending.end();) {
      if (it != pending.begin() && plants::planted(plants::Plant::kMeshConnectsInOrder)) {
        break;
      }
      if (it->url.empty()) {
        const std::string key = addressKey(reachOf(it->peer), it->peer);
        if (!store.check({key})) {
          ++it;
          continue;
        }
        const std::vector<uint8_t> raw = store.get(key);
        it->url.assign(raw.begin(), raw.end());
        faults::hit(faults::kMeshConnect, it->peer);
      }
      for (; it->tracksDone < kNumTracks; ++it->tracksDone) {
        bool dialed = true;
        if (Status s = connect(it->peer, static_cast<Track>(it->tracksDone), it->url, deadline, dialed); !s.ok()) {
          if (dialed) {
            return s;
          }
          it->notYet = s;
          break;
        }
        progressed = true;
      }
      it = it->tracksDone == kNumTracks ? pending.erase(it) : it + 1;
    }
    if (pending.empty()) {
      return Status();
    }
    std::string named; // what each peer still missing did
    for (const Pending& p : pending) {
      named += (named.empty() ? "" : "; ") + layout_.describe(p.peer) +
          (p.url.empty() ? " published no address (did it start?)"
                         : " did not take a connection (" + p.notYet.message() + "; did it die?)");
    }
    if (auto why = stopped()) {
      return Status::error(*why + " (while connecting: " + named + ")");
    }
    if (Clock::now() >= deadline) {
      return Status::error(
          "fairring: " + layout_.describe(layout_.rank()) + " timed out after " +
          std::to_string(options_.startTimeout.count()) + " ms connecting to its peers: " + named);
    }
    if (!progressed) {
      std::this_thread::sleep_for(kStorePoll);
    }
  }
}

bool PeerMesh::interrupted() {
  return stopped().has_value();
}

std::optional<std::string> PeerMesh::stopped() {
  bool shutDown = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutDown = interrupted_ || closed_;
  }
  if (shutDown) {
    return "fairring: the process group was shut down while " + layout_.describe(layout_.rank()) + " was connecting";
  }
  if (giveUp_) {
    if (auto why = giveUp_()) {
      return "fairring: " + layout_.describe(layout_.rank()) + " stopped connecting: " + *why;
    }
  }
  return std::nullopt;
}

void PeerMesh::interrupt() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    interrupted_ = true;
  }
  cv_.notify_all();
}

HelloReply::Verdict PeerMesh::check(Reach reach, const Hello& hello) {
  const std::vector<int> peers = layout_.peers();
  if (std::find(peers.begin(), peers.end(), hello.rank) == peers.end()) {
    return HelloReply::Verdict::kNotAPeer;
  }
  if (reachOf(hello.rank) != reach) {
    return HelloReply::Verdict::kWrongListener;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) {
    return HelloReply::Verdict::kClosing;
  }
  if (inbound_.count({hello.rank, hello.track})) {
    return HelloReply::Verdict::kAlreadyConnected;
  }
  return HelloReply::Verdict::kAccepted;
}

void PeerMesh::adopt(const Hello& hello, Socket socket, bool readsMemory) {
  auto in = std::make_unique<Inbound>();
  in->peer = hello.rank;
  in->track = hello.track;
  in->socket = std::move(socket);
  in->readsMemory = readsMemory;
  in->pid = hello.pid;
  Inbound* raw = in.get();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      return;
    }
    raw->thread = std::thread([this, raw] { readLoop(*raw); });
    inbound_[{hello.rank, hello.track}] = std::move(in);
  }
  cv_.notify_all();
}

Status PeerMesh::connect(int peer, Track track, const std::string& url, Clock::time_point deadline, bool& dialed) {
  Socket socket;
  HelloReply reply;
  if (Status s = hello(peer, track, url, deadline, socket, reply, dialed); !s.ok()) {
    return s;
  }
  if (reply.verdict == HelloReply::Verdict::kWrongVersion) {
    return failure("connecting to", peer, describeVersions(reply.version, helloVersion()));
  }
  if (reply.verdict != HelloReply::Verdict::kAccepted) {
    return failure("connecting to", peer, "it refused this rank's hello: " + describe(reply.verdict));
  }
  // With one rail peer there is no order between sockets to keep, and on a
  // fast link the extra wake-ups cost CPU.
  if (reachOf(peer) == Reach::kRail && layout_.numMachines() > 2) {
    setLowUnsent(socket, kRailUnsentBytes);
    // The writer's rotation makes each of these flows start and stop; BBR
    // paces a flow at the share it last measured (while the others sent to
    // the same machine), which left a 300 Mbit/s link half idle at 4 x 1
    // (docs/design.md, "Rail sockets").
    if (!options_.railCongestion.empty() && options_.railCongestion != "system") {
      if (Status s = setCongestion(socket, options_.railCongestion); !s.ok()) {
        return failure("connecting to", peer, "FAIRRING_RAIL_CONGESTION: " + s.message());
      }
    }
  }
  return add(peer, track, std::move(socket), reply.readsMemory);
}

Status PeerMesh::hello(
    int peer,
    Track track,
    const std::string& url,
    Clock::time_point deadline,
    Socket& socket,
    HelloReply& reply,
    bool& dialed) {
  Hello hello;
  hello.rank = layout_.rank();
  hello.track = track;
  hello.token = options_.token;
  if (reachOf(peer) == Reach::kLocal) {
    hello.pid = static_cast<int32_t>(::getpid());
    hello.probeAddress = reinterpret_cast<uint64_t>(&probe_);
    hello.probeValue = probe_;
  }
  const auto bytes = encode(hello);
  std::string closedWhy;
  // A gate closes a connection without an answer only when it had no room
  // (a storm of strangers at start-up): that is worth another try. A verdict
  // is final.
  for (int attempts = 0;; ++attempts) {
    if (attempts > 0) {
      if (Clock::now() + kRetryPause >= deadline) {
        return failure(
            "connecting to", peer,
            "it closed the connection without answering, " + std::to_string(attempts) + " times (" + closedWhy +
                "; is " + url + " a listener of this job? its log says why)");
      }
      std::this_thread::sleep_for(kRetryPause);
    }
    Status why;
    switch (connectOnce(url, std::min(deadline, Clock::now() + kDialSlice), socket, why)) {
      case ConnectAttempt::kConnected:
        break;
      case ConnectAttempt::kNotYet:
        dialed = false;
        return why;
      case ConnectAttempt::kFailed:
        return failure("connecting to", peer, why.message());
    }
    if (Status s = writeFull(socket, bytes.data(), bytes.size()); !s.ok()) {
      closedWhy = s.message();
      continue;
    }
    if (!waitReadable(socket, deadline, [this] { return interrupted(); })) {
      if (auto why = stopped()) {
        return Status::error(*why);
      }
      return failure(
          "connecting to", peer, "no answer to its hello within " + std::to_string(options_.startTimeout.count()) + " ms");
    }
    uint8_t raw[HelloReply::kBytes];
    if (Status s = readFull(socket, raw, sizeof(raw)); !s.ok()) {
      closedWhy = s.message();
      continue;
    }
    const std::optional<HelloReply> decoded = decodeHelloReply(raw);
    if (!decoded) {
      return failure("connecting to", peer, "a malformed answer to its hello");
    }
    reply = *decoded;
    return Status();
  }
}

Status PeerMesh::add(int peer, Track track, Socket socket, bool readsMemory) {
  const bool rail = reachOf(peer) == Reach::kRail;
  auto out = std::make_unique<Outbound>();
  out->peer = peer;
  out->track = track;
  out->socket = std::move(socket);
  out->readsMemory = readsMemory;
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) {
    return Status::error("fairring: the process group was closed during start-up");
  }
  Writer*& shared = railWriters_[static_cast<int>(track)];
  if (!rail || shared == nullptr) {
    writers_.push_back(std::make_unique<Writer>());
    Writer* w = writers_.back().get();
    w->thread = std::thread([this, w] { writeLoop(*w); });
    if (rail) {
      shared = w;
    }
  }
  out->writer = rail ? shared : writers_.back().get();
  outbound_[{peer, track}] = std::move(out);
  return Status();
}

} // namespace fairring
