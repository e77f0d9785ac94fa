#include "transport/handshake.h"

#include <algorithm>
#include <cstring>

namespace fairring {

namespace {
constexpr uint32_t kHelloMagic = 0x46524832; // "FRH2"
constexpr uint32_t kReplyMagic = 0x46525231; // "FRR1"
// 2: data headers name the segment of a slice.
constexpr uint16_t kVersion = 3; // 3: headers carry the operation's kind and the piece

template <typename T>
void put(uint8_t* out, size_t at, T v) {
  std::memcpy(out + at, &v, sizeof(T));
}

template <typename T>
T get(const uint8_t* in, size_t at) {
  T v;
  std::memcpy(&v, in + at, sizeof(T));
  return v;
}
} // namespace

std::array<uint8_t, Hello::kBytes> encode(const Hello& h) {
  std::array<uint8_t, Hello::kBytes> out{};
  put(out.data(), 0, kHelloMagic);
  put(out.data(), 4, kVersion);
  put(out.data(), 6, static_cast<uint8_t>(h.track));
  put(out.data(), 8, h.rank);
  put(out.data(), 12, h.pid);
  std::memcpy(out.data() + 16, h.token.data(), std::min(h.token.size(), Hello::kTokenBytes));
  put(out.data(), 48, h.probeAddress);
  put(out.data(), 56, h.probeValue);
  return out;
}

std::optional<Hello> decodeHello(const uint8_t* in) {
  const auto track = get<uint8_t>(in, 6);
  if (get<uint32_t>(in, 0) != kHelloMagic || get<uint16_t>(in, 4) != kVersion || track >= kNumTracks ||
      get<uint8_t>(in, 7) != 0) {
    return std::nullopt;
  }
  Hello h;
  h.track = static_cast<Track>(track);
  h.rank = get<int32_t>(in, 8);
  h.pid = get<int32_t>(in, 12);
  h.token.assign(reinterpret_cast<const char*>(in + 16), Hello::kTokenBytes);
  h.probeAddress = get<uint64_t>(in, 48);
  h.probeValue = get<uint64_t>(in, 56);
  return h;
}

bool mayBeHello(const uint8_t* in, size_t have) {
  uint8_t magic[sizeof(kHelloMagic)];
  std::memcpy(magic, &kHelloMagic, sizeof(magic));
  return std::memcmp(in, magic, std::min(have, sizeof(magic))) == 0;
}

std::optional<uint16_t> helloVersionOf(const uint8_t* in) {
  if (get<uint32_t>(in, 0) != kHelloMagic) {
    return std::nullopt;
  }
  return get<uint16_t>(in, 4);
}

uint16_t helloVersion() {
  return kVersion;
}

std::array<uint8_t, HelloReply::kBytes> encode(const HelloReply& r) {
  std::array<uint8_t, HelloReply::kBytes> out{};
  put(out.data(), 0, kReplyMagic);
  put(out.data(), 4, static_cast<uint8_t>(r.verdict));
  put(out.data(), 5, static_cast<uint8_t>(r.readsMemory ? 1 : 0));
  put(out.data(), 6, r.version);
  return out;
}

std::optional<HelloReply> decodeHelloReply(const uint8_t* in) {
  const auto verdict = get<uint8_t>(in, 4);
  const auto mode = get<uint8_t>(in, 5);
  if (get<uint32_t>(in, 0) != kReplyMagic || verdict > static_cast<uint8_t>(HelloReply::Verdict::kClosing) ||
      mode > 1) {
    return std::nullopt;
  }
  return HelloReply{static_cast<HelloReply::Verdict>(verdict), mode == 1, get<uint16_t>(in, 6)};
}

std::string describe(HelloReply::Verdict verdict) {
  switch (verdict) {
    case HelloReply::Verdict::kAccepted: return "accepted";
    case HelloReply::Verdict::kWrongVersion: return "the fairring wire versions differ";
    case HelloReply::Verdict::kWrongToken: return "the job tokens differ (another job's rank or listener?)";
    case HelloReply::Verdict::kNotAPeer: return "the claimed rank is not a peer of the listening rank";
    case HelloReply::Verdict::kWrongListener:
      return "it came to the listener for the other kind of peer (same machine vs other machines)";
    case HelloReply::Verdict::kAlreadyConnected: return "that rank and track are connected already";
    case HelloReply::Verdict::kClosing: return "the listening rank's process group is closing";
  }
  return "unknown";
}

std::string describeVersions(uint16_t theirs, uint16_t ours) {
  return "it speaks fairring wire version " + std::to_string(theirs) + ", this rank version " +
      std::to_string(ours) + " (do all machines run the same fairring_pg?)";
}

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

} // namespace fairring
