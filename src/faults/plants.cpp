#include "faults/plants.h"

#include <stdexcept>

namespace fairring::plants {

namespace detail {
std::atomic<uint64_t> gPlanted{0};
} // namespace detail

const std::vector<std::string>& names() {
  static const std::vector<std::string> all{
      "future_on_caller_stream",
      "lane_skips_caller_wait",
      "lanes_not_joined",
      "keep_alive_off",
      "byte_ranges_off",
      "delegated_not_after_allreduce",
      "allreduce_not_after_delegated",
      "barrier_not_waiting",
      "rail_skips_reduce_scatter",
      "delegated_hold_released_at_issue",
      "direct_through_our_streams",
      "step_waits_on_host",
      "measured_own_times",
      "measured_fastest_rank",
      "trial_times_no_work",
      "point_to_point_marks_delegate",
      "eventless_work_unordered",
      "trials_on_one_way_calls",
      "agreement_by_order",
      "announcement_parked",
      "callbacks_start_ignores_loss",
      "timeout_names_next_peer",
      "ring_left_to_process",
      "callbacks_failure_stays_there",
      "close_waits_reduce_abort",
      "reduce_close_not_held",
      "delegated_unannounced",
      "barrier_before_hand_over",
      "wait_note_by_rank",
      "timer_on_pool_stream",
      "mesh_connects_in_order",
      "send_failure_waits_briefly",
      "held_close_ignores_late_gather",
  };
  static_assert(static_cast<int>(Plant::kCount) == 33, "a name for every plant");
  static_assert(static_cast<int>(Plant::kCount) <= 64, "gPlanted has one bit per plant: widen it first");
  return all;
}

void arm(const std::string& name) {
  const auto& all = names();
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i] == name) {
      detail::gPlanted.fetch_or(1ULL << i, std::memory_order_relaxed);
      return;
    }
  }
  std::string known;
  for (const auto& n : all) {
    known += (known.empty() ? "" : ", ") + n;
  }
  throw std::invalid_argument("no plant is called '" + name + "'; the plants are " + known);
}

void disarmAll() {
  detail::gPlanted.store(0, std::memory_order_relaxed);
}

} // namespace fairring::plants
