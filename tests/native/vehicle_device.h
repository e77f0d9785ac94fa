#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <string>
#include <vector>

#include "vehicle_ledger.h"

// The stream vehicle: a test-only accelerator, torch's PrivateUse1 device
// renamed "vehicle", on which the CUDA path's stream choreography runs in CI
// and a wrong order is observable without a GPU.
//
// Its memory is host memory and its kernels (ATen's CPU kernels, through a
// boxed fallback) run at once, on the issuing thread, so every value is what
// the host order computes; what the device *may* do is kept separately in the
// Ledger: each kernel is a launch on the current stream, events and waits
// order streams, the allocator knows which streams a block was used on
// (record_stream), and any two accesses to the same bytes that nothing orders
// are a race. A GPU could run the two in either order; the vehicle says so.
namespace vehicle {

c10::Device device();
bool onVehicle(const at::Tensor& t);
// The bytes `t` spans (first element to one past the last), for the ledger.
Touch touchOf(const at::Tensor& t, bool write);
// The current stream's id on this thread.
int64_t currentStream();
// A stream of its own (not from the pool), named for messages.
c10::Stream newStream(const std::string& name);
// A CPU tensor over the same memory as `t` (a vehicle tensor).
at::Tensor hostView(const at::Tensor& t);
// Records a kernel on the current stream touching `reads` and `writes`.
uint64_t recordLaunch(const std::string& op, const std::vector<at::Tensor>& reads, const std::vector<at::Tensor>& writes);
uint64_t recordLaunchOn(
    int64_t stream,
    const std::string& op,
    const std::vector<at::Tensor>& reads,
    const std::vector<at::Tensor>& writes);
// The allocator is told that `t`'s block is used on `stream` (what
// record_stream and c10's recordDataPtrOnStream do on CUDA).
void recordOnStream(const at::Tensor& t, const c10::Stream& stream);
// Registers the device, once.
void install();

} // namespace vehicle
