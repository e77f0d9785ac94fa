#pragma once

#include <memory>

#include "device/device_path.h"
#include "measured/measured_choice.h"
#include "subgroups/subgroup_allreduce.h"

namespace fairring {

// A device whose plan composes some calls (FAIRRING_CUDA_ALLREDUCE, the plan of
// fairring_pg.model.cuda_plan): one path per call, chosen once, from the call
// itself and the job-wide plan, so alike on every rank. An allreduce composes
// where its row of the plan composes, the composition reduces its dtype and op
// and it is not being captured into a CUDA graph; every other allreduce, and
// every other collective, is the delegate's own Work, returned as it is (so
// NCCL's dtypes, ops and graph capture work, with NCCL's errors), ordered
// after the composed allreduces in flight on the same bytes, and they after
// it, as on NCCL's one stream. Under FAIRRING_CUDA_ALLREDUCE=auto a row may be
// measured: its calls that would compose take turns, composed or the
// delegate's, until the measured choice (src/measured/) says which is faster.
class ComposedPath : public DevicePath {
 public:
  // `measured`: where some row of the plan is measured, else null;
  // `ownStream`: makes the stream its trial timers record on (trial_timer.h).
  ComposedPath(
      std::unique_ptr<SubgroupAllreduce> composition,
      c10::intrusive_ptr<c10d::Backend> delegate,
      std::unique_ptr<MeasuredChoice> measured,
      StreamMaker ownStream = {});

  c10::intrusive_ptr<c10d::Work> delegated(
      const std::vector<at::Tensor>& tensors,
      const Issue& issue,
      Callers callers,
      const std::optional<Announced>& what) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts)
      override;
  c10::intrusive_ptr<c10d::Work> allreduceCoalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;
  void awaitIssued(const c10d::BarrierOptions& opts) override;
  void stop(bool drain) override;
  const MeasuredChoice* measured() const override {
    return measured_.get();
  }

  const SubgroupAllreduce& composition() const {
    return *composition_;
  }

 private:
  struct Route {
    bool compose{false};
    bool byPlan{false}; // the delegate's because the plan's row says so (a dtype and op the composition reduces)
    size_t row{0};
    std::optional<MeasuredChoice::Turn> turn; // a measured row's call that could compose
  };
  // Asks the measured choice for the turn of a call of a measured row: so it
  // is called once per call, by the call's issuing thread.
  Route routeOf(const std::vector<at::Tensor>& tensors, c10d::ReduceOp::RedOpType op);
  // Whether the delegate (NCCL) takes a call of these tensors of a dtype and
  // op the composition reduces.
  static bool delegateTakes(const std::vector<at::Tensor>& tensors);
  // `issue` runs the call the way `route` says (its Work), timed where its turn is.
  c10::intrusive_ptr<c10d::Work> timed(
      const Route& route,
      c10::Device device,
      const std::function<c10::intrusive_ptr<c10d::Work>()>& issue);

  const std::unique_ptr<SubgroupAllreduce> composition_;
  const c10::intrusive_ptr<c10d::Backend> delegate_;
  const std::unique_ptr<MeasuredChoice> measured_;
  TrialTimers timers_;
  DelegateBarrier barrier_;
};

} // namespace fairring
