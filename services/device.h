// Where a block runs: the one place device names are read, checked against
// what this LibTorch and machine offer, and waited for. A block's modules,
// its head and every tensor it computes with live on its device; messages
// cross the wire (and archives are written) from CPU copies.
#ifndef INTERLOCK_SERVICES_DEVICE_H_
#define INTERLOCK_SERVICES_DEVICE_H_

#include <c10/core/Device.h>

#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace interlock {

// "cpu", "cuda" (= "cuda:0") or "cuda:N", case-insensitive; only the
// syntax is checked. INVALID_ARGUMENT naming `flag` and the value
// otherwise, e.g. "--device: 'gpu' is not cpu, cuda or cuda:N".
absl::StatusOr<c10::Device> ParseDeviceName(absl::string_view flag,
                                            absl::string_view value);

// OK when blocks can run on `device` here: always for the CPU; for CUDA
// only with a LibTorch built with CUDA and that GPU visible. Otherwise
// FAILED_PRECONDITION naming `flag` and saying which is missing.
absl::Status CheckDeviceUsable(absl::string_view flag,
                               const c10::Device& device);

// ParseDeviceName, then CheckDeviceUsable.
absl::StatusOr<c10::Device> ParseDevice(absl::string_view flag,
                                        absl::string_view value);

// A comma list of devices (ParseDevice each); empty: none.
absl::StatusOr<std::vector<c10::Device>> ParseDeviceList(
    absl::string_view flag, absl::string_view value);

// The device of each of `blocks` blocks from a list of none (all on the
// CPU), one (all there) or one per block; another count is
// INVALID_ARGUMENT naming `flag`.
absl::StatusOr<std::vector<c10::Device>> BlockDevices(
    absl::string_view flag, const std::vector<c10::Device>& devices,
    int blocks);

// Prepares this process to run a block on `device`: for CUDA, cuDNN is
// asked for deterministic algorithms (and no autotuning). Nothing for the
// CPU.
void PrepareDevice(const c10::Device& device);

// Waits until the work queued on `device` has run, so a clock read after it
// measures execution rather than launches. Nothing to wait for on the CPU.
void Synchronize(const c10::Device& device);

}  // namespace interlock

#endif  // INTERLOCK_SERVICES_DEVICE_H_
