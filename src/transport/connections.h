#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "common/status.h"
#include "transport/socket.h"
#include "transport/wire.h"

namespace fairring {

// PeerMesh's connections and their threads (transport/peer_mesh.h).

using SendDone = std::function<void(Status)>;

struct OutgoingMessage {
  std::string header;
  void* data{nullptr};
  size_t bytes{0};
  SendDone done;
  bool first{false}; // sent ahead of the queue (PeerMesh::Priority::kFirst)
};

// Where an inbound connection's thread is: what a late reader still has to
// do before it reaches a close (PeerMesh::readerBehind).
enum class ReaderAt : uint8_t {
  kReading, // in the kernel, for the next header (or a body)
  kHandling, // handing a header on (OnMessage)
  kAwaitingPost, // for receive() to say where the announced body goes
  kExited, // at the connection's end (a close, an error, or ours)
};

// One connection a peer writes to: its thread reads a message's header, hands
// it on, and reads the body where it is told.
struct InboundConnection {
  int peer;
  Track track;
  Socket socket;
  bool readsMemory;
  pid_t pid;
  std::thread thread;

  std::mutex mu;
  std::condition_variable cv;
  bool stop{false};
  std::atomic<ReaderAt> at{ReaderAt::kReading};
  // The body destination that receive() posted for the announced message.
  bool posted{false};
  void* data{nullptr};
  size_t bytes{0};
  SendDone done;
};

struct ConnectionWriter;

struct OutboundConnection {
  int peer;
  Track track;
  Socket socket;
  bool readsMemory;
  ConnectionWriter* writer{nullptr};
  // Touched only by the writer's thread: after a failed send nothing more
  // goes out on this connection.
  bool broken{false};
  Status brokenStatus;
};

// One thread that writes a queue of messages, in queue order, to one
// connection or (rail: every rail connection of one track) to several.
struct ConnectionWriter {
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  bool stop{false};
  std::deque<std::pair<OutboundConnection*, OutgoingMessage>> queue;
};

} // namespace fairring
