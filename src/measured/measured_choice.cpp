#include "measured/measured_choice.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

#include "common/without_gil.h"
#include "faults/fault_points.h"
#include "faults/plants.h"
#include "faults/trial_clock.h"

namespace fairring {

namespace {

std::string jsonEscaped(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out;
}

double median(std::vector<double> values) {
  if (values.empty()) {
    return 0.0;
  }
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

} // namespace

MeasuredChoice::MeasuredChoice(MeasuredOptions options)
    : options_(std::move(options)),
      agreement_(options_.store, options_.rank, options_.size, options_.device) {
  const auto& rows = options_.rows;
  classOfRow_.assign(rows.size(), -1);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!rows[i].second) {
      continue;
    }
    Class c;
    c.fromBytes = rows[i].first;
    c.toBytes = i + 1 < rows.size() ? rows[i + 1].first : 0;
    for (const MeasuredDecision& known : options_.known) {
      if (known.fromBytes == c.fromBytes) {
        c.decision = known;
        c.decision.toBytes = c.toBytes;
        c.decision.fromFile = true;
        c.state = State::kDecided;
      }
    }
    classOfRow_[i] = static_cast<int>(classes_.size());
    classes_.push_back(std::move(c));
  }
  TORCH_CHECK(
      classes_.empty() || options_.store, "fairring: the measured choice of ", options_.device,
      " allreduces needs the job's store");
}

bool MeasuredChoice::measures(size_t row) const {
  return row < classOfRow_.size() && classOfRow_[row] >= 0;
}

MeasuredChoice::Turn MeasuredChoice::next(size_t row, size_t bytes) {
  TORCH_CHECK(measures(row), "fairring: row ", row, " of the ", options_.device, " plan is not measured");
  std::unique_lock<std::mutex> lock(mu_);
  Class& c = classes_[static_cast<size_t>(classOfRow_[row])];
  // Another thread's call is deciding this class: its calls after it wait.
  decided_.wait(lock, [&] { return c.state != State::kDeciding; });
  Turn turn{row, c.calls++, 0, false, bytes};
  switch (c.state) {
    case State::kDecided:
      turn.way = c.decision.winner;
      return turn;
    case State::kFailed:
      throw c10::DistBackendError(c.failure);
    case State::kDeciding:
    case State::kTrying:
      break;
  }
  if (turn.call < kDecisionCall) {
    const TrialCall trial = trialCall(turn.call);
    turn.way = trial.way;
    turn.timed = trial.timed;
    return turn;
  }
  c.state = State::kDeciding;
  const std::vector<Timed> timed = std::move(c.timed);
  c.timed.clear();
  lock.unlock();
  Outcome outcome;
  try {
    outcome = decide(c.fromBytes, c.toBytes, timed);
  } catch (const std::exception& e) {
    outcome.failure = "fairring: the measured choice of " + options_.device + " allreduces of " +
        range(c.fromBytes, c.toBytes) + " failed on rank " + std::to_string(options_.rank) + ": " + e.what();
  }
  lock.lock();
  if (outcome.decision) {
    c.decision = *outcome.decision;
    c.state = State::kDecided;
  } else {
    c.failure = outcome.failure;
    c.state = State::kFailed;
  }
  decided_.notify_all();
  lock.unlock();
  if (!outcome.decision) {
    throw c10::DistBackendError(outcome.failure);
  }
  if (options_.onDecision) {
    try {
      options_.onDecision(options_.device, decisionJson(options_.device, options_.ways, *outcome.decision));
    } catch (const std::exception& e) {
      // Logging and saving are this rank's business: the calls go on alike.
      TORCH_WARN("fairring: recording the measured choice on rank ", options_.rank, " failed: ", e.what());
    }
  }
  turn.way = outcome.decision->winner;
  return turn;
}

void MeasuredChoice::keep(const Turn& turn, std::shared_ptr<TrialTimer> timer) {
  std::lock_guard<std::mutex> lock(mu_);
  classes_[static_cast<size_t>(classOfRow_[turn.row])].timed.push_back(Timed{turn.way, turn.bytes, std::move(timer)});
}

MeasuredChoice::Outcome MeasuredChoice::decide(size_t fromBytes, size_t toBytes, const std::vector<Timed>& timed) {
  // Every wait below may take long (a peer's trial calls, the other ranks'
  // arrival): a Python callback another thread runs must not wait for us.
  WithoutGil released;
  const auto deadline = TrialTimer::Clock::now() + options_.timeout;
  const auto stop = [this] { return stopped_.load(); };
  std::array<std::vector<double>, 2> perByte; // each timed call's seconds per byte
  std::array<double, 2> bytes{};
  std::array<int, 2> counted{};
  RankFigures mine;
  for (const Timed& t : timed) {
    const TrialTime time = t.timer->read(deadline, stop);
    std::optional<double> s = time.seconds;
    if (time.done) {
      if (auto injected = faults::trialSeconds(options_.ways[t.way], fromBytes)) {
        s = injected; // tests: what the test clock says this call took
      }
    }
    if (!s) {
      mine.cannotTime = time.error;
      break;
    }
    perByte[t.way].push_back(*s / static_cast<double>(std::max<size_t>(1, t.bytes)));
    bytes[t.way] += static_cast<double>(t.bytes);
    ++counted[t.way];
  }
  if (mine.cannotTime.empty() && (counted[0] != kTimedCalls || counted[1] != kTimedCalls)) {
    mine.cannotTime = "it timed " + std::to_string(counted[0]) + " and " + std::to_string(counted[1]) +
        " calls, not " + std::to_string(kTimedCalls) + " of each way";
  }
  for (int w = 0; w < 2 && mine.cannotTime.empty(); ++w) {
    // A call's time at this way's median speed: one slow spell of a shared host
    // moves a median of four calls less than their mean.
    mine.seconds[w] = median(perByte[w]) * bytes[w] / kTimedCalls;
  }
  const std::string what = "fairring: the measured choice of " + options_.device + " allreduces of " +
      range(fromBytes, toBytes) + " (" + options_.ways[0] + " or " + options_.ways[1] + ")";
  const Agreed agreed = agree(fromBytes, mine, deadline, stop);
  if (!agreed.failure.empty()) {
    return Outcome{std::nullopt, what + " failed on every rank: the ranks could not agree: " + agreed.failure};
  }
  MeasuredDecision d;
  d.fromBytes = fromBytes;
  d.toBytes = toBytes;
  const int kept = options_.kept;
  const int other = 1 - kept;
  if (agreed.cannotTimeRank >= 0) {
    // Every rank agreed, and the program's own way is what it had without us.
    d.winner = kept;
    d.keptBecause =
        "rank " + std::to_string(agreed.cannotTimeRank) + " could not time its trial calls (" + agreed.cannotTime + ")";
    return Outcome{d, ""};
  }
  for (int w = 0; w < 2; ++w) {
    d.seconds[w] = agreed.seconds[w];
    d.bytes[w] = bytes[w] / kTimedCalls;
  }
  // Per byte, where a class holds calls of several sizes (the same calls, so the same
  // bytes, on every rank); the program's own way unless beaten by the margin.
  const bool replaced = d.seconds[other] * bytes[kept] * (1 + kMeasuredMargin) < d.seconds[kept] * bytes[other];
  d.winner = replaced ? other : kept;
  return Outcome{d, ""};
}

Agreed MeasuredChoice::agree(
    size_t fromBytes,
    const RankFigures& mine,
    TrialTimer::Clock::time_point deadline,
    const Agreement::Stop& stop) {
  std::optional<RankFigures> figures = mine;
  std::string failure;
  try {
    // Tests: this rank reaches the agreement late, or cannot take part.
    faults::hit(faults::kMeasuredDecide, static_cast<int64_t>(fromBytes));
  } catch (const std::exception& e) {
    figures.reset();
    failure = e.what();
  }
  if (figures && plants::planted(plants::Plant::kMeasuredOwnTimes)) {
    Agreed own;
    own.seconds = figures->seconds;
    if (!figures->cannotTime.empty()) {
      own.cannotTimeRank = options_.rank;
      own.cannotTime = figures->cannotTime;
    }
    return own;
  }
  return agreement_.combine(fromBytes, figures, failure, deadline, stop);
}

std::vector<MeasuredDecision> MeasuredChoice::decisions() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<MeasuredDecision> out;
  for (const Class& c : classes_) {
    if (c.state == State::kDecided) {
      out.push_back(c.decision);
    }
  }
  return out;
}

void MeasuredChoice::stop() {
  stopped_.store(true);
}

std::string MeasuredChoice::range(size_t fromBytes, size_t toBytes) const {
  return toBytes == 0 ? std::to_string(fromBytes) + " bytes and more"
                      : std::to_string(fromBytes) + " to " + std::to_string(toBytes - 1) + " bytes";
}

std::string decisionJson(const std::string& device, const std::array<std::string, 2>& ways, const MeasuredDecision& d) {
  std::ostringstream out;
  out.precision(9);
  out << "{\"device\": \"" << device << "\", \"from_bytes\": " << d.fromBytes << ", \"to_bytes\": ";
  if (d.toBytes == 0) {
    out << "null";
  } else {
    out << d.toBytes;
  }
  out << ", \"ways\": [\"" << ways[0] << "\", \"" << ways[1] << "\"], \"seconds\": [" << d.seconds[0] << ", "
      << d.seconds[1] << "], \"bytes\": [" << d.bytes[0] << ", " << d.bytes[1] << "], \"winner\": \""
      << ways[d.winner] << "\", \"trial_calls\": " << (d.fromFile ? 0 : kDecisionCall)
      << ", \"timed_calls\": " << (d.fromFile ? 0 : kTimedCalls) << ", \"source\": \""
      << (d.fromFile ? "plan file" : d.keptBecause.empty() ? "measured" : "kept") << "\"";
  if (!d.keptBecause.empty()) {
    out << ", \"reason\": \"" << jsonEscaped(d.keptBecause) << "\"";
  }
  out << "}";
  return out.str();
}

} // namespace fairring
