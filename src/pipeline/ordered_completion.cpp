#include "pipeline/ordered_completion.h"

#include <pthread.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace fairring {

namespace {

constexpr uint64_t kNone = UINT64_MAX;
// A worker that finds this many idle ones exits: a burst of blocked
// callbacks, or of markings that overlapped, leaves no threads behind (a
// quiet job keeps one; the soak test checks that threads do not grow).
constexpr int kMaxIdleWorkers = 1;

thread_local bool tlWorker = false;
// The future this worker is marking: its gate only acts on that one.
thread_local uint64_t tlMarking = kNone;

std::mutex gRegistryMu;
std::set<OrderedCompletion*>& registry() {
  static auto* all = new std::set<OrderedCompletion*>(); // never destroyed: used at exit
  return *all;
}

} // namespace

struct OrderedCompletion::State : std::enable_shared_from_this<State> {
  explicit State(std::chrono::milliseconds patience) : patience(patience) {}

  struct Entry {
    c10::intrusive_ptr<Future> user;
    bool ready{false};
    c10::IValue value;
    std::exception_ptr error;
  };

  std::mutex mu;
  std::condition_variable jobCv; // idle workers
  std::condition_variable turnCv; // gates, and stop() waiting for the drain
  uint64_t issued{0};
  // The next future to mark, and whether a worker has taken it and not yet
  // marked it (one marking at a time keeps markings in issue order).
  uint64_t nextMark{0};
  bool markTaken{false};
  // Callbacks of futures before `turn` have returned, and those of `returned`
  // too (ones let through out of order, see gate()).
  uint64_t turn{0};
  std::set<uint64_t> returned;
  std::chrono::milliseconds patience;
  bool warnedPatience{false};
  std::map<uint64_t, Entry> entries; // chained, not yet taken by a worker
  std::deque<uint64_t> jobs;
  int idle{0};
  int busy{0};
  int live{0}; // workers that have not returned from work()
  bool closing{false};
  int nextWorkerId{0};
  std::map<int, std::thread> workers;
  std::vector<int> exited; // workers that returned and can be joined
  bool warnedCallbackError{false};

  void readyLocked(uint64_t idx, Future& source) {
    auto it = entries.find(idx);
    if (it == entries.end()) {
      return;
    }
    it->second.ready = true;
    if (source.hasError()) {
      it->second.error = source.exception_ptr();
    } else {
      it->second.value = source.value();
    }
    dispatchLocked();
  }

  // Hands the next future to a worker once it is ready and the one before it
  // is marked.
  void dispatchLocked() {
    if (markTaken || closing) {
      return;
    }
    auto it = entries.find(nextMark);
    if (it == entries.end() || !it->second.ready) {
      return;
    }
    markTaken = true;
    jobs.push_back(nextMark);
    if (idle > 0) {
      jobCv.notify_one();
      return;
    }
    reapLocked();
    const int id = nextWorkerId++;
    ++live;
    workers.emplace(id, std::thread([self = shared_from_this(), id] { self->work(id); }));
  }

  void markedLocked(uint64_t idx) {
    if (nextMark == idx) {
      nextMark = idx + 1;
      markTaken = false;
      dispatchLocked();
    }
  }

  void reapLocked() {
    for (int id : exited) {
      auto it = workers.find(id);
      if (it != workers.end()) {
        it->second.join(); // it has returned from work(): at most its teardown is left
        workers.erase(it);
      }
    }
    exited.clear();
  }

  void work(int id) {
    tlWorker = true;
    pthread_setname_np(pthread_self(), "fairring-cb");
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      // Checked before every wait, not only after a job: a worker started for a
      // job that another one took meanwhile would otherwise stay idle for good.
      if (jobs.empty() && !closing && idle >= kMaxIdleWorkers) {
        break;
      }
      ++idle;
      jobCv.wait(lock, [&] { return !jobs.empty() || closing; });
      --idle;
      if (closing) {
        break;
      }
      const uint64_t idx = jobs.front();
      jobs.pop_front();
      auto node = entries.extract(idx);
      ++busy;
      lock.unlock();
      complete(idx, node.mapped());
      // Dropping the value may release Python-owned tensors: not under the lock.
      node.mapped() = Entry{};
      lock.lock();
      --busy;
      markedLocked(idx); // in case the gate never ran (see complete())
      returned.insert(idx);
      while (!returned.empty() && *returned.begin() == turn) {
        returned.erase(returned.begin());
        ++turn;
      }
      turnCv.notify_all();
    }
    exited.push_back(id);
    --live;
    turnCv.notify_all();
  }

  void complete(uint64_t idx, Entry& entry) {
    tlMarking = idx;
    try {
      if (entry.error) {
        entry.user->setError(entry.error);
      } else {
        entry.user->markCompleted(std::move(entry.value));
      }
    } catch (const std::exception& e) {
      // A callback threw (the rest of that future's callbacks are skipped, as
      // wherever a future completes), or the user completed it already.
      std::lock_guard<std::mutex> lock(mu);
      if (!warnedCallbackError) {
        warnedCallbackError = true;
        std::cerr << "fairring: completing an allreduce future raised (shown once): " << e.what() << std::endl;
      }
    }
    tlMarking = kNone;
  }

  // Added by chain() before any of the user's callbacks.
  void gate(uint64_t idx) {
    if (tlMarking != idx) {
      return; // completed by someone else than its worker: nothing to order
    }
    std::unique_lock<std::mutex> lock(mu);
    markedLocked(idx);
    if (turnCv.wait_for(lock, patience, [&] { return turn == idx || closing; })) {
      return;
    }
    // Only a program that would deadlock otherwise gets here: a callback that
    // waits for what a later future's callbacks compute. Nothing may hang
    // forever, so after the group's timeout order gives way.
    if (!warnedPatience) {
      warnedPatience = true;
      std::cerr << "fairring: the callbacks of allreduce #" << idx << " waited " << patience.count()
                << " ms (the process group's timeout) for those of allreduce #" << turn
                << " to return; running them out of issue order (does a callback wait for the result of a "
                   "later allreduce's callbacks?)"
                << std::endl;
    }
  }
};

OrderedCompletion::OrderedCompletion(std::chrono::milliseconds patience)
    : state_(std::make_shared<State>(patience)) {
  std::lock_guard<std::mutex> lock(gRegistryMu);
  registry().insert(this);
}

OrderedCompletion::~OrderedCompletion() {
  {
    std::lock_guard<std::mutex> lock(gRegistryMu);
    registry().erase(this);
  }
  stop(std::chrono::milliseconds(0));
}

bool OrderedCompletion::onWorkerThread() {
  return tlWorker;
}

void OrderedCompletion::awaitMarkedCallbacks() {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  const uint64_t target = s.nextMark;
  if (s.turnCv.wait_for(lock, s.patience, [&] { return s.turn >= target || s.closing; })) {
    return;
  }
  if (!s.warnedPatience) {
    s.warnedPatience = true;
    std::cerr << "fairring: a callback run outside fairring's completion threads waited " << s.patience.count()
              << " ms (the process group's timeout) for the callbacks of allreduce #" << s.turn
              << " to return; issuing its allreduce out of order" << std::endl;
  }
}

void OrderedCompletion::chain(const c10::intrusive_ptr<Future>& source, const c10::intrusive_ptr<Future>& user) {
  uint64_t idx = 0;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->closing) {
      idx = kNone;
    } else {
      idx = state_->issued++;
      state_->entries[idx].user = user;
    }
  }
  if (idx == kNone) {
    // Stopped (the process group is gone): no order left to keep.
    source->addCallback([user](Future& f) {
      if (f.hasError()) {
        user->setError(f.exception_ptr());
      } else {
        user->markCompleted(f.value());
      }
    });
    return;
  }
  user->addCallback([state = state_, idx](Future&) { state->gate(idx); });
  source->addCallback([state = state_, idx](Future& f) {
    std::lock_guard<std::mutex> lock(state->mu);
    state->readyLocked(idx, f);
  });
}

void OrderedCompletion::stop(std::chrono::milliseconds grace) {
  std::vector<c10::intrusive_ptr<Future>> abandoned;
  {
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->turnCv.wait_for(lock, grace, [&] {
      return state_->entries.empty() && state_->jobs.empty() && state_->busy == 0;
    });
    state_->closing = true;
    state_->jobCv.notify_all();
    state_->turnCv.notify_all();
    for (auto& [idx, entry] : state_->entries) {
      abandoned.push_back(std::move(entry.user));
    }
    state_->entries.clear();
    state_->jobs.clear();
    // Idle workers exit at once and are joined; one still inside a callback
    // (this very thread, if a callback stops the group) finishes on its own,
    // holding the state alive.
    state_->turnCv.wait_for(lock, std::chrono::milliseconds(200), [&] {
      return state_->live == state_->busy;
    });
    state_->reapLocked();
    for (auto& [id, thread] : state_->workers) {
      thread.detach();
    }
    state_->workers.clear();
  }
  for (auto& user : abandoned) {
    if (!user->completed()) {
      user->setError(std::make_exception_ptr(
          c10::DistBackendError("fairring: the process group was shut down before this allreduce completed")));
    }
  }
}

void OrderedCompletion::stopAll(std::chrono::milliseconds grace) {
  std::lock_guard<std::mutex> lock(gRegistryMu);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  for (OrderedCompletion* completion : registry()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    completion->stop(std::max(left, std::chrono::milliseconds(0)));
  }
}

} // namespace fairring
