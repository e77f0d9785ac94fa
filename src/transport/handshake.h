#pragma once

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "transport/wire.h"

namespace fairring {

// The first bytes on every connection, sent by the connecting rank: who it
// is, which lane the connection carries, and the job token that proves it
// belongs to this job. Fixed size, so that the accepting side reads exactly
// this much from a stranger, checks it, and parses nothing else first.
struct Hello {
  static constexpr size_t kBytes = 64;
  static constexpr size_t kTokenBytes = 32;

  int32_t rank{0};
  Lane lane{Lane::kReduce};
  std::string token; // kTokenBytes characters
  // Same machine only: where the sender keeps `probeValue`. If the receiver
  // can read it out of the sender's memory, message bodies need not travel
  // through the socket at all (see memory_reader.h).
  int32_t pid{0};
  uint64_t probeAddress{0};
  uint64_t probeValue{0};
};

std::array<uint8_t, Hello::kBytes> encode(const Hello& h);
std::optional<Hello> decodeHello(const uint8_t* bytes);
// Whether the first `have` bytes received could still become a hello (so
// that an HTTP request or random bytes are turned away at once).
bool mayBeHello(const uint8_t* bytes, size_t have);
// The wire version of a full hello that has our magic (another fairring
// build, perhaps), to name in the refusal; nullopt for anything else.
std::optional<uint16_t> helloVersionOf(const uint8_t* bytes);
uint16_t helloVersion();

// The accepting side's answer to a hello it took. A refused hello gets no
// answer: the connection is closed.
struct HelloReply {
  static constexpr size_t kBytes = 8;
  bool readsMemory{false}; // bodies are read straight out of the sender's memory
};

std::array<uint8_t, HelloReply::kBytes> encode(const HelloReply& r);
std::optional<HelloReply> decodeHelloReply(const uint8_t* bytes);

// Token comparison that takes the same time wherever the first difference is.
bool sameToken(const std::string& a, const std::string& b);

} // namespace fairring
