#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "transport/peer_mesh.h"

namespace fairring {

// A rank whose start fails says why under this key of the core's store (the
// first to fail writes it: fairring_pg/startup.py, FAILURE_KEY). A rank still
// connecting then stops at once naming that rank's reason, where it would wait
// out the timeout for a peer that left because of it and name only that peer.
inline constexpr const char* kStartupFailedKey = "startup_failed";

// The give-up of a mesh's start that reads that key. A store that fails to
// answer gives no reason here: the start's own waits report it.
inline PeerMesh::GiveUp publishedStartupFailure(c10::intrusive_ptr<c10d::Store> store) {
  return [store = std::move(store)]() -> std::optional<std::string> {
    try {
      if (!store->check({kStartupFailedKey})) {
        return std::nullopt;
      }
      const std::vector<uint8_t> raw = store->get(kStartupFailedKey);
      return "another rank failed to start this process group: " + std::string(raw.begin(), raw.end());
    } catch (const std::exception&) {
      return std::nullopt;
    }
  };
}

} // namespace fairring
