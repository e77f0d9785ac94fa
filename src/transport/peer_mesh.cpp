#include "transport/peer_mesh.h"

#include <unistd.h>

#include <algorithm>
#include <optional>
#include <atomic>
#include <random>

#include "failure/group_failure.h"
#include "faults/fault_points.h"
#include "transport/frame.h"
#include "transport/handshake.h"
#include "transport/memory_reader.h"

namespace fairring {

namespace {

// Below this a body rides in the stream: the acknowledgement a memory read
// needs costs more than copying a small body twice.
constexpr size_t kMemoryReadMinBytes = 64 * 1024;
// Unsent bytes a rail socket may hold (see setLowUnsent): about 1 ms of a
// 1 Gbit/s link, enough to keep it busy while the next message is issued.
constexpr int kRailUnsentBytes = 128 * 1024;
// Between attempts to get past a gate that had no room.
constexpr auto kRetryPause = std::chrono::milliseconds(50);
// Between looks at the store for a peer's address.
constexpr auto kStorePoll = std::chrono::milliseconds(10);

std::string addressKey(Reach reach, int rank) {
  return std::string(reach == Reach::kLocal ? "addr/local/" : "addr/rail/") + std::to_string(rank);
}

uint64_t randomProbe() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ 1; // never 0
}

} // namespace

struct PeerMesh::Inbound {
  int peer;
  Lane lane;
  Socket socket;
  bool readsMemory;
  pid_t pid;
  std::thread thread;

  std::mutex mu;
  std::condition_variable cv;
  bool stop{false};
  std::atomic<bool> exited{false};
  // The body destination that receive() posted for the announced message.
  bool posted{false};
  void* data{nullptr};
  size_t bytes{0};
  Done done;
};

struct PeerMesh::Outbound {
  int peer;
  Lane lane;
  Socket socket;
  bool readsMemory;
  Writer* writer{nullptr};
  // Touched only by the writer's thread: after a failed send nothing more
  // goes out on this connection.
  bool broken{false};
  Status brokenStatus;
};

// One thread that writes a queue of messages, in queue order, to one
// connection or (rail: every rail connection of one lane) to several.
struct PeerMesh::Writer {
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  bool stop{false};
  std::deque<std::pair<Outbound*, Outgoing>> queue;
};

PeerMesh::PeerMesh(const RankLayout& layout, Options options, OnMessage onMessage)
    : layout_(layout), options_(std::move(options)), onMessage_(std::move(onMessage)), probe_(randomProbe()) {}

PeerMesh::~PeerMesh() {
  close();
}

Status PeerMesh::failure(const std::string& what, int peer, const std::string& why) const {
  return Status::error(
      "fairring: " + what + " " + layout_.describe(peer) + " failed on " + layout_.describe(layout_.rank()) +
      ": " + why);
}

Reach PeerMesh::reachOf(int peer) const {
  return layout_.machineOf(peer) == layout_.machine() ? Reach::kLocal : Reach::kRail;
}

Status PeerMesh::start(c10d::Store& store) {
  const std::string me = layout_.describe(layout_.rank());
  if (options_.token.size() != Hello::kTokenBytes) {
    return Status::error(
        "fairring: the job token must be " + std::to_string(Hello::kTokenBytes) + " characters, got " +
        std::to_string(options_.token.size()));
  }
  const auto deadline = Clock::now() + options_.timeout;
  const std::vector<int> peers = layout_.peers();
  if (peers.empty()) {
    return Status();
  }
  gate_ = std::make_unique<Gate>(
      me, options_.token, [this](Reach reach, const Hello& h) { return check(reach, h); },
      [this](Reach, const Hello& h, Socket s, bool readsMemory) { adopt(h, std::move(s), readsMemory); });
  std::string urls[2];
  for (Reach reach : {Reach::kLocal, Reach::kRail}) {
    const bool needed = reach == Reach::kLocal ? layout_.localSize() > 1 : layout_.numMachines() > 1;
    if (!needed) {
      continue;
    }
    // Local peers share this machine, so their listener needs only loopback.
    const std::string host = reach == Reach::kLocal ? "127.0.0.1" : options_.listenAddress;
    if (Status s = gate_->listen(reach, host, urls[static_cast<int>(reach)]); !s.ok()) {
      return Status::error("fairring: " + me + ": " + s.message());
    }
  }
  gate_->start();
  try {
    for (int r = 0; r < 2; ++r) {
      if (!urls[r].empty()) {
        store.set(addressKey(static_cast<Reach>(r), layout_.rank()), std::vector<uint8_t>(urls[r].begin(), urls[r].end()));
      }
    }
    for (int peer : peers) {
      std::string url;
      if (Status s = addressOf(store, peer, deadline, url); !s.ok()) {
        return s;
      }
      faults::hit("mesh.connect", peer);
      for (int l = 0; l < kNumLanes; ++l) {
        if (Status s = connect(peer, static_cast<Lane>(l), url, deadline); !s.ok()) {
          return s;
        }
      }
    }
  } catch (const std::exception& e) {
    return Status::error(
        "fairring: exchanging listener addresses through the store failed on " + me + ": " + e.what());
  }

  std::unique_lock<std::mutex> lock(mu_);
  const size_t expected = peers.size() * kNumLanes;
  const bool all =
      cv_.wait_until(lock, deadline, [&] { return closed_ || interrupted_ || inbound_.size() == expected; });
  if (closed_ || interrupted_) {
    return Status::error("fairring: the process group was shut down while " + me + " was connecting");
  }
  if (!all) {
    std::string missing;
    for (int peer : peers) {
      if (!inbound_.count({peer, Lane::kReduce}) || !inbound_.count({peer, Lane::kGather})) {
        missing += (missing.empty() ? "" : ", ") + layout_.describe(peer);
      }
    }
    return Status::error(
        "fairring: " + me + " timed out after " + std::to_string(options_.timeout.count()) + " ms waiting for " +
        missing + " to connect");
  }
  lock.unlock();
  // Every peer is in: nothing needs to listen any more, and a closed port
  // refuses strangers before they can send a byte.
  gate_->stop();
  return Status();
}

Status PeerMesh::addressOf(c10d::Store& store, int peer, Clock::time_point deadline, std::string& url) {
  const std::string key = addressKey(reachOf(peer), peer);
  while (!store.check({key})) {
    if (interrupted()) {
      return Status::error("fairring: the process group was shut down while " + layout_.describe(layout_.rank()) +
                           " was connecting");
    }
    if (Clock::now() >= deadline) {
      return failure(
          "waiting for the address of", peer,
          "it published none within " + std::to_string(options_.timeout.count()) + " ms (did it start?)");
    }
    std::this_thread::sleep_for(kStorePoll);
  }
  const std::vector<uint8_t> raw = store.get(key);
  url.assign(raw.begin(), raw.end());
  return Status();
}

bool PeerMesh::interrupted() {
  std::lock_guard<std::mutex> lock(mu_);
  return interrupted_ || closed_;
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
  if (inbound_.count({hello.rank, hello.lane})) {
    return HelloReply::Verdict::kAlreadyConnected;
  }
  return HelloReply::Verdict::kAccepted;
}

void PeerMesh::adopt(const Hello& hello, Socket socket, bool readsMemory) {
  auto in = std::make_unique<Inbound>();
  in->peer = hello.rank;
  in->lane = hello.lane;
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
    inbound_[{hello.rank, hello.lane}] = std::move(in);
  }
  cv_.notify_all();
}

Status PeerMesh::connect(int peer, Lane lane, const std::string& url, Clock::time_point deadline) {
  Hello hello;
  hello.rank = layout_.rank();
  hello.lane = lane;
  hello.token = options_.token;
  if (reachOf(peer) == Reach::kLocal) {
    hello.pid = static_cast<int32_t>(::getpid());
    hello.probeAddress = reinterpret_cast<uint64_t>(&probe_);
    hello.probeValue = probe_;
  }
  const auto bytes = encode(hello);
  Socket socket;
  std::optional<HelloReply> reply;
  std::string closedWhy;
  int attempts = 0;
  // A gate closes a connection without an answer only when it had no room
  // (a storm of strangers at start-up): that is worth another try. A verdict
  // is final.
  while (!reply) {
    if (attempts++ > 0) {
      if (Clock::now() + kRetryPause >= deadline) {
        return failure(
            "connecting to", peer,
            "it closed the connection without answering, " + std::to_string(attempts - 1) + " times (" +
                closedWhy + "; is " + url + " a listener of this job? its log says why)");
      }
      std::this_thread::sleep_for(kRetryPause);
    }
    if (Status s = connectTo(url, deadline, socket, [this] { return interrupted(); }); !s.ok()) {
      return failure("connecting to", peer, s.message());
    }
    if (Status s = writeFull(socket, bytes.data(), bytes.size()); !s.ok()) {
      closedWhy = s.message();
      continue;
    }
    if (!waitReadable(socket, deadline)) {
      return failure(
          "connecting to", peer,
          "no answer to its hello within " + std::to_string(options_.timeout.count()) + " ms");
    }
    uint8_t raw[HelloReply::kBytes];
    if (Status s = readFull(socket, raw, sizeof(raw)); !s.ok()) {
      closedWhy = s.message();
      continue;
    }
    reply = decodeHelloReply(raw);
    if (!reply) {
      return failure("connecting to", peer, "a malformed answer to its hello");
    }
  }
  if (reply->verdict == HelloReply::Verdict::kWrongVersion) {
    return failure("connecting to", peer, describeVersions(reply->version, helloVersion()));
  }
  if (reply->verdict != HelloReply::Verdict::kAccepted) {
    return failure("connecting to", peer, "it refused this rank's hello: " + describe(reply->verdict));
  }
  const bool rail = reachOf(peer) == Reach::kRail;
  // With one rail peer there is no order between sockets to keep, and on a
  // fast link the extra wake-ups cost CPU.
  if (rail && layout_.numMachines() > 2) {
    setLowUnsent(socket, kRailUnsentBytes);
  }
  auto out = std::make_unique<Outbound>();
  out->peer = peer;
  out->lane = lane;
  out->socket = std::move(socket);
  out->readsMemory = reply->readsMemory;
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) {
    return Status::error("fairring: the process group was closed during start-up");
  }
  Writer*& shared = railWriters_[static_cast<int>(lane)];
  if (!rail || shared == nullptr) {
    writers_.push_back(std::make_unique<Writer>());
    Writer* w = writers_.back().get();
    w->thread = std::thread([this, w] { writeLoop(*w); });
    if (rail) {
      shared = w;
    }
  }
  out->writer = rail ? shared : writers_.back().get();
  outbound_[{peer, lane}] = std::move(out);
  return Status();
}

void PeerMesh::report(int peer, Lane lane, Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      return; // our own close, not the peer's failure
    }
  }
  onMessage_(peer, lane, std::move(status), {}, 0);
}

void PeerMesh::readLoop(Inbound& in) {
  const int peer = in.peer;
  while (true) {
    Frame frame;
    bool closed = false;
    Status s = readFull(in.socket, &frame, sizeof(frame), &closed);
    std::string header;
    if (s.ok()) {
      if (frame.magic != Frame::kMagic || frame.headerBytes > Frame::kMaxHeaderBytes ||
          (frame.bodyAddress != 0 && !in.readsMemory)) {
        report(peer, in.lane, Status::error("fairring: malformed message from " + layout_.describe(peer)));
        break;
      }
      header.resize(frame.headerBytes);
      s = readFull(in.socket, header.data(), header.size());
    }
    if (!s.ok()) {
      report(
          peer, in.lane,
          closed ? Status::error(
                       "fairring: " + layout_.describe(peer) + " closed its connection to " +
                       layout_.describe(layout_.rank()) + " (it exited, crashed or destroyed its process group)")
                 : failure("the connection from", peer, s.message()));
      break;
    }
    onMessage_(peer, in.lane, Status(), std::move(header), frame.bodyBytes);

    void* data = nullptr;
    size_t bytes = 0;
    Done done;
    {
      std::unique_lock<std::mutex> lock(in.mu);
      in.cv.wait(lock, [&] { return in.posted || in.stop; });
      if (!in.posted) {
        break;
      }
      in.posted = false;
      data = in.data;
      bytes = in.bytes;
      done = std::move(in.done);
    }
    Status body;
    if (bytes != frame.bodyBytes) {
      body = Status::error(
          "its message has " + std::to_string(frame.bodyBytes) + " bytes, " + std::to_string(bytes) +
          " were expected");
    } else if (frame.bodyAddress != 0) {
      if (data != nullptr) {
        body = readMemoryOf(in.pid, frame.bodyAddress, data, bytes);
      }
      const uint8_t ack = 1;
      if (body.ok()) {
        body = writeFull(in.socket, &ack, 1);
      }
    } else if (data != nullptr) {
      body = readFull(in.socket, data, bytes);
    } else {
      body = skip(in.socket, bytes);
    }
    const Status status = body.ok() ? body : failure("receiving from", peer, body.message());
    done(status);
    if (!status.ok()) {
      // Also as a failure of the connection: whoever posted this read may
      // not be waiting on it (a dropped body), but everything after it is lost.
      report(peer, in.lane, status);
      break;
    }
  }
  {
    std::lock_guard<std::mutex> lock(in.mu);
    in.exited = true;
  }
  std::lock_guard<std::mutex> lock(mu_);
  cv_.notify_all();
}

void PeerMesh::awaitDrained(int peer) {
  // A peer that fails sends its reason on every lane, then closes. Our send
  // to it may see the close first (a broken pipe) while the reason still sits
  // in our readers' buffers; once one reader has reached the close, it has
  // read the reason before it.
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, GroupFailure::kSendFailureWait, [&] {
    if (closed_) {
      return true;
    }
    for (int l = 0; l < kNumLanes; ++l) {
      auto it = inbound_.find({peer, static_cast<Lane>(l)});
      if (it == inbound_.end() || it->second->exited.load()) {
        return true;
      }
    }
    return false;
  });
}

Status PeerMesh::skip(const Socket& socket, size_t bytes) {
  // A body nobody wants (its operation failed) still has to leave the stream;
  // reading it through a small buffer costs no memory whatever it claims.
  std::vector<uint8_t> scratch(std::min<size_t>(bytes, 64 * 1024));
  while (bytes > 0) {
    const size_t n = std::min(bytes, scratch.size());
    if (Status s = readFull(socket, scratch.data(), n); !s.ok()) {
      return s;
    }
    bytes -= n;
  }
  return Status();
}

void PeerMesh::writeLoop(Writer& writer) {
  while (true) {
    std::pair<Outbound*, Outgoing> next;
    {
      std::unique_lock<std::mutex> lock(writer.mu);
      writer.cv.wait(lock, [&] { return writer.stop || !writer.queue.empty(); });
      if (writer.stop) {
        break;
      }
      next = std::move(writer.queue.front());
      writer.queue.pop_front();
    }
    auto& [out, msg] = next;
    if (msg.first) {
      faults::hit("mesh.send.first", out->peer);
    }
    if (!out->broken) {
      Status s = transmit(*out, msg);
      if (!s.ok()) {
        awaitDrained(out->peer);
        out->broken = true;
        out->brokenStatus = failure("sending to", out->peer, s.message());
      }
    }
    msg.done(out->broken ? out->brokenStatus : Status());
  }
  // Closing: what was not sent will not be.
  std::deque<std::pair<Outbound*, Outgoing>> left;
  {
    std::lock_guard<std::mutex> lock(writer.mu);
    left.swap(writer.queue);
  }
  for (auto& [out, msg] : left) {
    msg.done(Status::error("fairring: the connection to " + layout_.describe(out->peer) + " was closed"));
  }
}

Status PeerMesh::transmit(Outbound& out, Outgoing& msg) {
  const bool fromMemory = out.readsMemory && msg.bytes >= kMemoryReadMinBytes;
  Frame frame;
  frame.headerBytes = static_cast<uint32_t>(msg.header.size());
  frame.bodyBytes = msg.bytes;
  frame.bodyAddress = fromMemory ? reinterpret_cast<uint64_t>(msg.data) : 0;
  struct iovec iov[3] = {
      {&frame, sizeof(frame)},
      {msg.header.data(), msg.header.size()},
      {msg.data, fromMemory ? 0 : msg.bytes},
  };
  if (Status s = writeFull(out.socket, iov, 3); !s.ok()) {
    return s;
  }
  if (fromMemory) {
    // The body must stay put until the peer has copied it.
    uint8_t ack = 0;
    if (Status s = readFull(out.socket, &ack, 1); !s.ok()) {
      return s;
    }
  }
  return Status();
}

template <typename Connection>
Connection* PeerMesh::find(const std::map<Key, std::unique_ptr<Connection>>& connections, Key key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = connections.find(key);
  return closed_ || it == connections.end() ? nullptr : it->second.get();
}

void PeerMesh::send(
    int peer,
    Lane lane,
    std::string header,
    void* data,
    size_t bytes,
    Done done,
    Priority priority) {
  Outbound* out = find(outbound_, {peer, lane});
  if (out == nullptr) {
    done(Status::error("fairring: no connection to " + layout_.describe(peer) + " (closed)"));
    return;
  }
  Writer& writer = *out->writer;
  {
    std::lock_guard<std::mutex> lock(writer.mu);
    if (!writer.stop) {
      Outgoing msg{std::move(header), data, bytes, std::move(done), priority == Priority::kFirst};
      if (priority == Priority::kFirst) {
        // Behind the other firsts only: they keep their order.
        auto at = writer.queue.begin();
        while (at != writer.queue.end() && at->second.first) {
          ++at;
        }
        writer.queue.emplace(at, out, std::move(msg));
      } else {
        writer.queue.emplace_back(out, std::move(msg));
      }
      writer.cv.notify_one();
      return;
    }
  }
  done(Status::error("fairring: no connection to " + layout_.describe(peer) + " (closed)"));
}

void PeerMesh::receive(int peer, Lane lane, void* data, size_t bytes, Done done) {
  Inbound* in = find(inbound_, {peer, lane});
  if (in == nullptr) {
    done(Status::error("fairring: no connection from " + layout_.describe(peer) + " (closed)"));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(in->mu);
    if (!in->stop && !in->exited && !in->posted) {
      in->posted = true;
      in->data = data;
      in->bytes = bytes;
      in->done = std::move(done);
      in->cv.notify_one();
      return;
    }
  }
  done(Status::error("fairring: the connection from " + layout_.describe(peer) + " is closed"));
}

void PeerMesh::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      return;
    }
    closed_ = true;
  }
  cv_.notify_all();
  if (gate_) {
    gate_->stop();
  }
  std::map<Key, std::unique_ptr<Outbound>> outbound;
  std::map<Key, std::unique_ptr<Inbound>> inbound;
  std::vector<std::unique_ptr<Writer>> writers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    outbound.swap(outbound_);
    inbound.swap(inbound_);
    writers.swap(writers_);
    railWriters_[0] = railWriters_[1] = nullptr;
  }
  for (auto& writer : writers) {
    std::lock_guard<std::mutex> lock(writer->mu);
    writer->stop = true;
    writer->cv.notify_all();
  }
  for (auto& [key, out] : outbound) {
    out->socket.shutdown();
  }
  for (auto& [key, in] : inbound) {
    std::lock_guard<std::mutex> lock(in->mu);
    in->stop = true;
    in->socket.shutdown();
    in->cv.notify_all();
  }
  const auto self = std::this_thread::get_id();
  auto finish = [&](std::thread& t, auto& owner) {
    if (t.get_id() == self) {
      // Closed from one of our own callbacks: that thread is still inside
      // its loop, so what it uses must outlive it.
      t.detach();
      owner.release();
      return true;
    }
    if (t.joinable()) {
      t.join();
    }
    return false;
  };
  bool writerDetached = false;
  for (auto& writer : writers) {
    writerDetached = finish(writer->thread, writer) || writerDetached;
  }
  if (writerDetached) {
    for (auto& [key, out] : outbound) {
      out.release(); // the detached writer may still hold any of them
    }
  }
  for (auto& [key, in] : inbound) {
    finish(in->thread, in);
  }
  // A receive posted but never read gets its answer (the engine may wait on it).
  for (auto& [key, in] : inbound) {
    if (in && in->posted && in->done) {
      in->done(Status::error("fairring: the connection from " + layout_.describe(in->peer) + " was closed"));
    }
  }
}

} // namespace fairring
