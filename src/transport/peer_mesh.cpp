#include "transport/peer_mesh.h"

#include <unistd.h>

#include <algorithm>
#include <optional>
#include <atomic>
#include <random>

#include "failure/group_failure.h"
#include "faults/fault_points.h"
#include "faults/plants.h"
#include "transport/frame.h"
#include "transport/handshake.h"
#include "transport/memory_reader.h"

namespace fairring {

namespace {

// Below this a body rides in the stream: the acknowledgement a memory read
// needs costs more than copying a small body twice.
constexpr size_t kMemoryReadMinBytes = 64 * 1024;

uint64_t randomProbe() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ 1; // never 0
}

} // namespace

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

void PeerMesh::report(int peer, Track track, Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      return; // our own close, not the peer's failure
    }
  }
  onMessage_(peer, track, std::move(status), {}, 0);
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
        report(peer, in.track, Status::error("fairring: malformed message from " + layout_.describe(peer)));
        break;
      }
      header.resize(frame.headerBytes);
      s = readFull(in.socket, header.data(), header.size());
    }
    if (!s.ok()) {
      report(
          peer, in.track,
          closed ? Status::error(
                       "fairring: " + layout_.describe(peer) + " closed its connection to " +
                       layout_.describe(layout_.rank()) + " (it exited, crashed or destroyed its process group)")
                 : failure("the connection from", peer, s.message()));
      break;
    }
    in.at = ReaderAt::kHandling;
    onMessage_(peer, in.track, Status(), std::move(header), frame.bodyBytes);
    void* data = nullptr;
    size_t bytes = 0;
    Done done;
    {
      std::unique_lock<std::mutex> lock(in.mu);
      in.at = ReaderAt::kAwaitingPost;
      in.cv.wait(lock, [&] { return in.posted || in.stop; });
      if (!in.posted) {
        break;
      }
      in.at = ReaderAt::kReading;
      in.posted = false;
      data = in.data;
      bytes = in.bytes;
      done = std::move(in.done);
    }
    Status body;
    if (faults::hit(faults::kMeshReadClose, peer)) {
      in.socket.shutdown(); // the connection breaks under this body
      body = Status::error("the connection broke (fault point mesh.read.close)");
    } else if (bytes != frame.bodyBytes) {
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
      report(peer, in.track, status);
      break;
    }
  }
  {
    std::lock_guard<std::mutex> lock(in.mu);
    in.at = ReaderAt::kExited;
  }
  std::lock_guard<std::mutex> lock(mu_);
  cv_.notify_all();
}

void PeerMesh::awaitDrained(int peer) {
  // A peer that fails sends its reason on every track, then closes. Our send
  // to it may see the close first (a broken pipe) while the reason still sits
  // in our readers' buffers. The gather track is always read, and its abort
  // always leaves before the close (GroupFailure), so once its reader has
  // reached the close the reason is in; the reduce track's close may come
  // without one (its abort held behind a parked message). The peer has
  // closed, so that reader is only waiting for the CPU: a busy host gets
  // kAbortGrace, not the 500 ms that once let a broken pipe pass for the
  // reason (chaos seed 74 at load 12).
  const bool brief = plants::planted(plants::Plant::kSendFailureWaitsBriefly);
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, brief ? GroupFailure::kSendFailureWait : GroupFailure::kAbortGrace, [&] {
    if (closed_) {
      return true;
    }
    for (int l = 0; l < kNumTracks; ++l) {
      const auto track = static_cast<Track>(l);
      if (track != Track::kGather && !brief) {
        continue;
      }
      auto it = inbound_.find({peer, track});
      if (it == inbound_.end() || it->second->at.load() == ReaderAt::kExited) {
        return true;
      }
    }
    return false;
  });
}

bool PeerMesh::readerBehind(int peer, Track track) {
  // Under the lock throughout: close() frees the connection only after it took it.
  std::lock_guard<std::mutex> lock(mu_);
  auto it = inbound_.find({peer, track});
  if (closed_ || it == inbound_.end()) {
    return false;
  }
  const Inbound* in = it->second.get();
  switch (in->at.load()) {
    case ReaderAt::kHandling:
      return true;
    case ReaderAt::kReading:
      return hasInput(in->socket); // a header, or the close, waits for the thread
    case ReaderAt::kAwaitingPost:
    case ReaderAt::kExited:
      return false;
  }
  return false;
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
    if (msg.first && !holdFirst(writer, *out)) {
      // Closed while held: like the rest of the queue, it will not be sent.
      msg.done(Status::error("fairring: the connection to " + layout_.describe(out->peer) + " was closed"));
      continue;
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

bool PeerMesh::holdFirst(Writer& writer, const Outbound& out) {
  // A test holds an abort here (on every track, or on the reduce track only, as a
  // rail writer blocked at a peer's parked reduce track holds it); close() ends
  // the hold, as it ends every wait of a writer, so that destroy's time is not
  // the test's sleep.
  auto held = faults::at(faults::kMeshSendFirst, out.peer);
  if (!held && out.track == Track::kReduce) {
    held = faults::at(faults::kMeshSendFirstReduce, out.peer);
  }
  if (held && held->action == faults::Action::kDelay) {
    std::unique_lock<std::mutex> lock(writer.mu);
    return !writer.cv.wait_for(lock, held->delay, [&] { return writer.stop; });
  }
  return true;
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
    Track track,
    std::string header,
    void* data,
    size_t bytes,
    Done done,
    Priority priority) {
  Outbound* out = find(outbound_, {peer, track});
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

void PeerMesh::receive(int peer, Track track, void* data, size_t bytes, Done done) {
  Inbound* in = find(inbound_, {peer, track});
  if (in == nullptr) {
    done(Status::error("fairring: no connection from " + layout_.describe(peer) + " (closed)"));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(in->mu);
    if (!in->stop && in->at.load() != ReaderAt::kExited && !in->posted) {
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
  Gate* gate = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      return;
    }
    closed_ = true;
    gate = gate_.get(); // set only under this lock, never once closed
  }
  cv_.notify_all();
  if (gate != nullptr) {
    gate->stop();
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
