#include "transport/peer_mesh.h"

#include <tensorpipe/channel/basic/factory.h>
#include <tensorpipe/channel/cma/factory.h>
#include <tensorpipe/transport/uv/factory.h>

#include <algorithm>
#include <iostream>

namespace fairring {

namespace {

std::string addressKey(PeerMesh::Reach reach, int rank) {
  return std::string(reach == PeerMesh::Reach::kLocal ? "addr/local/" : "addr/rail/") + std::to_string(rank);
}

bool isClosing(const tensorpipe::Error& e) {
  return e.isOfType<tensorpipe::PipeClosedError>() || e.isOfType<tensorpipe::ContextClosedError>() ||
      e.isOfType<tensorpipe::ListenerClosedError>();
}

// Token comparison that takes the same time wherever the first difference is.
bool sameToken(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) {
    return false;
  }
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

tensorpipe::Message makeMessage(std::string header, void* data, size_t bytes) {
  tensorpipe::Message message;
  message.metadata = std::move(header);
  if (bytes > 0) {
    tensorpipe::Message::Tensor t;
    t.buffer = tensorpipe::CpuBuffer{data};
    t.length = bytes;
    message.tensors.push_back(std::move(t));
  }
  return message;
}

} // namespace

PeerMesh::PeerMesh(const RankLayout& layout, Options options, OnMessage onMessage)
    : layout_(layout), options_(std::move(options)), onMessage_(std::move(onMessage)) {}

PeerMesh::~PeerMesh() {
  close();
}

Status PeerMesh::failure(const std::string& what, int peer, const tensorpipe::Error& error) const {
  return Status::error(
      "fairring: " + what + " " + layout_.describe(peer) + " failed on " + layout_.describe(layout_.rank()) +
      ": " + error.what());
}

PeerMesh::Reach PeerMesh::reachOf(int peer) const {
  return layout_.machineOf(peer) == layout_.machine() ? Reach::kLocal : Reach::kRail;
}

void PeerMesh::openEndpoint(Reach reach) {
  Endpoint& ep = endpoints_[static_cast<int>(reach)];
  const bool local = reach == Reach::kLocal;
  ep.context = std::make_shared<tensorpipe::Context>(tensorpipe::ContextOptions().name(
      "fairring-rank" + std::to_string(layout_.rank()) + (local ? "-local" : "-rail")));
  ep.context->registerTransport(0, "uv", tensorpipe::transport::uv::create());
  ep.context->registerChannel(0, "basic", tensorpipe::channel::basic::create());
  if (local) {
    // One copy straight from the sender's memory (process_vm_readv); TensorPipe
    // falls back to "basic" where the kernel does not allow it.
    ep.context->registerChannel(10, "cma", tensorpipe::channel::cma::create());
  }
  // Local peers share this machine, so their listener needs only loopback.
  ep.listener = ep.context->listen({"uv://" + (local ? std::string("127.0.0.1") : options_.listenAddress)});
  ep.url = ep.listener->url("uv");
  accept(reach);
}

Status PeerMesh::start(c10d::Store& store) {
  const std::vector<int> peers = layout_.peers();
  if (layout_.localSize() > 1) {
    openEndpoint(Reach::kLocal);
  }
  if (layout_.numMachines() > 1) {
    openEndpoint(Reach::kRail);
  }
  try {
    for (int r = 0; r < 2; ++r) {
      const Endpoint& ep = endpoints_[r];
      if (ep.context) {
        store.set(addressKey(static_cast<Reach>(r), layout_.rank()), std::vector<uint8_t>(ep.url.begin(), ep.url.end()));
      }
    }
    for (int peer : peers) {
      const Reach reach = reachOf(peer);
      const std::vector<uint8_t> raw = store.get(addressKey(reach, peer));
      const std::string peerUrl(raw.begin(), raw.end());
      for (int l = 0; l < kNumLanes; ++l) {
        const Lane lane = static_cast<Lane>(l);
        auto pipe = endpoints_[static_cast<int>(reach)].context->connect(peerUrl);
        const std::string hello = encode(Hello{layout_.rank(), lane, options_.token});
        pipe->write(makeMessage(hello, nullptr, 0), [](const tensorpipe::Error&) {
          // A failed hello surfaces again on the first write of data.
        });
        std::lock_guard<std::mutex> lock(mu_);
        outbound_[{peer, lane}] = std::move(pipe);
      }
    }
  } catch (const std::exception& e) {
    return Status::error(
        std::string("fairring: exchanging listener addresses through the store failed on ") +
        layout_.describe(layout_.rank()) + ": " + e.what());
  }

  std::unique_lock<std::mutex> lock(mu_);
  const size_t expected = peers.size() * kNumLanes;
  const bool all = cv_.wait_for(lock, options_.timeout, [&] { return closed_ || inbound_.size() == expected; });
  if (!all || closed_) {
    std::string missing;
    for (int peer : peers) {
      if (!inbound_.count({peer, Lane::kReduce}) || !inbound_.count({peer, Lane::kGather})) {
        missing += (missing.empty() ? "" : ", ") + layout_.describe(peer);
      }
    }
    return Status::error(
        "fairring: " + layout_.describe(layout_.rank()) + " timed out after " +
        std::to_string(options_.timeout.count()) + " ms waiting for " + missing + " to connect");
  }
  lock.unlock();
  closeListeners();
  return Status();
}

void PeerMesh::closeListeners() {
  // Every peer is connected, so nothing needs to listen any more. TensorPipe's
  // listener cannot face strangers: an error while reading any one incoming
  // handshake fails the whole listener, and a forged length makes it
  // allocate without bound. Closed, the port refuses them instead.
  for (Endpoint& ep : endpoints_) {
    if (ep.listener) {
      ep.listener->close();
    }
  }
  // Connections that never said who they are (a stranger, or a half-open
  // socket from start-up) have nothing left to wait for.
  std::vector<std::shared_ptr<tensorpipe::Pipe>> strangers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    strangers.swap(unidentified_);
  }
  for (auto& pipe : strangers) {
    pipe->close();
  }
}

void PeerMesh::accept(Reach reach) {
  endpoints_[static_cast<int>(reach)].listener->accept(
      [this, reach](const tensorpipe::Error& error, std::shared_ptr<tensorpipe::Pipe> pipe) {
        if (error) {
          if (!isClosing(error)) {
            std::cerr << "fairring: listener on " << layout_.describe(layout_.rank())
                      << " stopped accepting: " << error.what() << std::endl;
          }
          return;
        }
        onAccepted(reach, std::move(pipe));
        accept(reach);
      });
}

void PeerMesh::onAccepted(Reach reach, std::shared_ptr<tensorpipe::Pipe> pipe) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      pipe->close();
      return;
    }
    unidentified_.push_back(pipe);
  }
  std::weak_ptr<tensorpipe::Pipe> weak = pipe;
  pipe->readDescriptor([this, weak, reach](const tensorpipe::Error& error, tensorpipe::Descriptor descriptor) {
    auto pipe = weak.lock();
    if (!pipe) {
      return;
    }
    auto forget = [&] {
      std::lock_guard<std::mutex> lock(mu_);
      unidentified_.erase(std::remove(unidentified_.begin(), unidentified_.end(), pipe), unidentified_.end());
    };
    if (error) {
      forget();
      return;
    }
    const auto hello = decodeHello(descriptor.metadata);
    const bool known = hello && sameToken(hello->token, options_.token) && hello->rank >= 0 &&
        hello->rank < layout_.worldSize() && descriptor.tensors.empty() && descriptor.payloads.empty();
    const std::vector<int> peers = layout_.peers();
    if (!known || std::find(peers.begin(), peers.end(), hello->rank) == peers.end() ||
        reachOf(hello->rank) != reach) {
      std::cerr << "fairring: " << layout_.describe(layout_.rank())
                << " refused a connection that is not from a peer of this job" << std::endl;
      forget();
      pipe->close();
      return;
    }
    // The hello has no body, but TensorPipe wants the read to complete it.
    pipe->read(tensorpipe::Allocation{}, [this, weak, hello](const tensorpipe::Error& error) {
      auto pipe = weak.lock();
      if (!pipe || error) {
        return;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        unidentified_.erase(std::remove(unidentified_.begin(), unidentified_.end(), pipe), unidentified_.end());
        if (closed_ || inbound_.count({hello->rank, hello->lane})) {
          pipe->close();
          return;
        }
        inbound_[{hello->rank, hello->lane}] = pipe;
      }
      cv_.notify_all();
      readNext(hello->rank, hello->lane, pipe);
    });
  });
}

void PeerMesh::readNext(int peer, Lane lane, const std::shared_ptr<tensorpipe::Pipe>& pipe) {
  pipe->readDescriptor([this, peer, lane](const tensorpipe::Error& error, tensorpipe::Descriptor descriptor) {
    if (error) {
      if (isClosing(error)) {
        return;
      }
      if (error.isOfType<tensorpipe::EOFError>()) {
        onMessage_(
            peer, lane,
            Status::error(
                "fairring: " + layout_.describe(peer) + " closed its connection to " +
                layout_.describe(layout_.rank()) + " (it exited, crashed or destroyed its process group)"),
            {}, 0);
      } else {
        onMessage_(peer, lane, failure("the connection from", peer, error), {}, 0);
      }
      return;
    }
    size_t bytes = 0;
    for (const auto& t : descriptor.tensors) {
      bytes += t.length;
    }
    if (descriptor.tensors.size() > 1 || !descriptor.payloads.empty()) {
      onMessage_(
          peer, lane,
          Status::error("fairring: malformed message from " + layout_.describe(peer)), {}, 0);
      return;
    }
    onMessage_(peer, lane, Status(), std::move(descriptor.metadata), bytes);
  });
}

void PeerMesh::send(int peer, Lane lane, std::string header, void* data, size_t bytes, Done done) {
  std::shared_ptr<tensorpipe::Pipe> pipe;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = outbound_.find({peer, lane});
    if (closed_ || it == outbound_.end()) {
      done(Status::error("fairring: no connection to " + layout_.describe(peer) + " (closed)"));
      return;
    }
    pipe = it->second;
  }
  pipe->write(makeMessage(std::move(header), data, bytes), [this, peer, done](const tensorpipe::Error& error) {
    done(error ? failure("sending to", peer, error) : Status());
  });
}

void PeerMesh::receive(int peer, Lane lane, void* data, size_t bytes, Done done) {
  std::shared_ptr<tensorpipe::Pipe> pipe;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = inbound_.find({peer, lane});
    if (closed_ || it == inbound_.end()) {
      done(Status::error("fairring: no connection from " + layout_.describe(peer) + " (closed)"));
      return;
    }
    pipe = it->second;
  }
  tensorpipe::Allocation allocation;
  if (bytes > 0) {
    allocation.tensors.push_back({tensorpipe::CpuBuffer{data}});
  }
  std::weak_ptr<tensorpipe::Pipe> weak = pipe;
  pipe->read(std::move(allocation), [this, peer, lane, weak, done](const tensorpipe::Error& error) {
    if (error) {
      done(failure("receiving from", peer, error));
      return;
    }
    done(Status());
    if (auto pipe = weak.lock()) {
      readNext(peer, lane, pipe);
    }
  });
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
  for (Endpoint& ep : endpoints_) {
    if (ep.context) {
      ep.context->close();
      ep.context->join();
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  outbound_.clear();
  inbound_.clear();
  unidentified_.clear();
  for (Endpoint& ep : endpoints_) {
    ep.listener.reset();
  }
}

} // namespace fairring
