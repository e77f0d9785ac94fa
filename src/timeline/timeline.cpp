#include "timeline/timeline.h"

#include <stdexcept>

namespace fairring {

namespace {

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
    }
    out += c;
  }
  return out + "\"";
}

} // namespace

Timeline::Timeline(const std::string& path, int rank) : rank_(rank) {
  if (path.empty()) {
    return;
  }
  file_ = std::fopen(path.c_str(), "w");
  if (file_ == nullptr) {
    throw std::runtime_error("fairring: cannot open the timeline file " + path + " for writing");
  }
  // The JSON array format tolerates a missing "]", so a trace cut short by a
  // crash still loads.
  buffer_ = "[\n" + std::string("{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":") + std::to_string(rank_) +
      ",\"args\":{\"name\":\"rank " + std::to_string(rank_) + "\"}}";
  first_ = false;
}

Timeline::~Timeline() {
  close();
}

void Timeline::close() {
  if (!enabled()) {
    return;
  }
  flush();
  std::lock_guard<std::mutex> lock(fileMu_);
  if (file_ == nullptr) {
    return;
  }
  std::FILE* file = file_.exchange(nullptr);
  std::fputs("\n]\n", file);
  std::fclose(file);
}

int64_t Timeline::now() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void Timeline::append(const std::string& event) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!first_) {
    buffer_ += ",\n";
  }
  first_ = false;
  buffer_ += event;
}

void Timeline::span(const std::string& track, const std::string& name, int64_t beginUs, int64_t endUs,
                    const std::string& argsJson) {
  if (!enabled()) {
    return;
  }
  append(
      "{\"name\":" + quoted(name) + ",\"cat\":" + quoted(track) + ",\"ph\":\"X\",\"pid\":" + std::to_string(rank_) +
      ",\"tid\":" + quoted(track) + ",\"ts\":" + std::to_string(beginUs) +
      ",\"dur\":" + std::to_string(endUs - beginUs) + ",\"args\":" + argsJson + "}");
}

void Timeline::sliceSpan(uint64_t sliceId, const std::string& name, int64_t beginUs, int64_t endUs,
                         const std::string& argsJson) {
  if (!enabled()) {
    return;
  }
  const std::string common = ",\"cat\":\"slice\",\"pid\":" + std::to_string(rank_) +
      ",\"tid\":\"slices\",\"id\":" + std::to_string(sliceId);
  append(
      "{\"name\":" + quoted(name) + common + ",\"ph\":\"b\",\"ts\":" + std::to_string(beginUs) +
      ",\"args\":" + argsJson + "}");
  append("{\"name\":" + quoted(name) + common + ",\"ph\":\"e\",\"ts\":" + std::to_string(endUs) + "}");
}

void Timeline::flush() {
  if (!enabled()) {
    return;
  }
  std::string out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out.swap(buffer_);
  }
  std::lock_guard<std::mutex> lock(fileMu_);
  std::FILE* file = file_.load();
  if (!out.empty() && file != nullptr) {
    std::fwrite(out.data(), 1, out.size(), file);
    std::fflush(file);
  }
}

} // namespace fairring
