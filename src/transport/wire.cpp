#include "transport/wire.h"

#include <cstring>

namespace fairring {

namespace {
constexpr uint32_t kDataMagic = 0x46524433; // "FRD3": with the kind and piece
constexpr uint32_t kAbortMagic = 0x46524131; // "FRA1"
constexpr size_t kMaxReasonBytes = 4096;

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

template <typename T>
bool take(const std::string& in, size_t& pos, T& v) {
  if (pos + sizeof(T) > in.size()) {
    return false;
  }
  std::memcpy(&v, in.data() + pos, sizeof(T));
  pos += sizeof(T);
  return true;
}
} // namespace

std::string encode(const DataHeader& h) {
  std::string out;
  put(out, kDataMagic);
  put(out, h.opSeq);
  put(out, h.slice);
  put(out, h.segment);
  put(out, static_cast<uint8_t>(h.route));
  put(out, h.numel);
  put(out, h.dtype);
  put(out, h.op);
  put(out, h.kind);
  put(out, h.piece);
  put(out, h.call);
  put(out, h.root);
  return out;
}

std::optional<DataHeader> decodeData(const std::string& in) {
  size_t pos = 0;
  uint32_t magic = 0;
  uint8_t route = 0;
  DataHeader h;
  if (!take(in, pos, magic) || magic != kDataMagic || !take(in, pos, h.opSeq) ||
      !take(in, pos, h.slice) || !take(in, pos, h.segment) || !take(in, pos, route) || !take(in, pos, h.numel) ||
      !take(in, pos, h.dtype) || !take(in, pos, h.op) || !take(in, pos, h.kind) ||
      !take(in, pos, h.piece) || !take(in, pos, h.call) || !take(in, pos, h.root) || pos != in.size() || route > 3) {
    return std::nullopt;
  }
  h.route = static_cast<Route>(route);
  return h;
}

std::string encode(const Abort& a) {
  std::string out;
  put(out, kAbortMagic);
  put(out, a.fromSeq);
  out.append(a.reason.substr(0, kMaxReasonBytes));
  return out;
}

std::optional<Abort> decodeAbort(const std::string& in) {
  size_t pos = 0;
  uint32_t magic = 0;
  uint64_t fromSeq = 0;
  if (!take(in, pos, magic) || magic != kAbortMagic || !take(in, pos, fromSeq) ||
      in.size() - pos > kMaxReasonBytes) {
    return std::nullopt;
  }
  return Abort{in.substr(pos), fromSeq};
}

} // namespace fairring
