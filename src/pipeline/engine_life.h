#pragma once

#include <cstdint>

namespace fairring {

// The engine's life. Messages, sends coming back and the watchdog act only
// while it is open; what failed, and from which turn, is GroupFailure's.
enum class EngineLife : uint8_t {
  kOpen, // connecting or connected: messages are handled
  kClosed, // the group failed and the watchdog closed the connections
  kShutDown, // shutdown() began: nothing new starts, the threads are joined
};

inline bool allowedMove(EngineLife from, EngineLife to) {
  switch (from) {
    case EngineLife::kOpen: return to == EngineLife::kClosed || to == EngineLife::kShutDown;
    case EngineLife::kClosed: return to == EngineLife::kShutDown;
    case EngineLife::kShutDown: return false;
  }
  return false;
}

inline const char* stateName(EngineLife life) {
  switch (life) {
    case EngineLife::kOpen: return "engine open";
    case EngineLife::kClosed: return "engine closed";
    case EngineLife::kShutDown: return "engine shut down";
  }
  return "engine ?";
}

} // namespace fairring
