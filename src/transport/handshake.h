#pragma once

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "transport/wire.h"

namespace fairring {

// The first bytes on every connection, sent by the connecting rank: who it
// is, which track the connection carries, and the job token that proves it
// belongs to this job. Fixed size, so that the accepting side reads exactly
// this much from a stranger, checks it, and parses nothing else first.
struct Hello {
  static constexpr size_t kBytes = 64;
  static constexpr size_t kTokenBytes = 32;

  int32_t rank{0};
  Track track{Track::kReduce};
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

// The accepting side's answer to a hello that carries our magic: taken, or
// refused and why, so that the connecting rank can say why and not retry.
// Anything else gets no answer, and neither does a connection the gate had
// no room for: closed, which a rank takes as "try again".
struct HelloReply {
  static constexpr size_t kBytes = 8;
  enum class Verdict : uint8_t {
    kAccepted = 0,
    kWrongVersion = 1,
    kWrongToken = 2,
    kNotAPeer = 3,
    kWrongListener = 4,
    kAlreadyConnected = 5,
    kClosing = 6,
  };
  Verdict verdict{Verdict::kAccepted};
  bool readsMemory{false}; // bodies are read straight out of the sender's memory
  uint16_t version{0}; // the answering side's wire version
};

std::array<uint8_t, HelloReply::kBytes> encode(const HelloReply& r);
std::optional<HelloReply> decodeHelloReply(const uint8_t* bytes);
// Why a hello was refused, in words both sides can print.
std::string describe(HelloReply::Verdict verdict);
// "it speaks fairring wire version 2, this rank version 1 (...)".
std::string describeVersions(uint16_t theirs, uint16_t ours);

// Token comparison that takes the same time wherever the first difference is.
bool sameToken(const std::string& a, const std::string& b);

} // namespace fairring
