#include "services/device.h"

#include <ATen/Context.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include <limits>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "plan/status_macros.h"

namespace interlock {

absl::StatusOr<c10::Device> ParseDeviceName(absl::string_view flag,
                                            absl::string_view value) {
  const std::string name = absl::AsciiStrToLower(value);
  if (name == "cpu") return c10::Device(c10::kCPU);
  if (name == "cuda") return c10::Device(c10::kCUDA, 0);
  constexpr absl::string_view kCuda = "cuda:";
  int index = -1;
  if (absl::StartsWith(name, kCuda)) {
    const std::string digits = name.substr(kCuda.size());
    if (!digits.empty() &&
        digits.find_first_not_of("0123456789") == std::string::npos &&
        absl::SimpleAtoi(digits, &index) &&
        index <= std::numeric_limits<c10::DeviceIndex>::max()) {
      return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      flag, ": '", value, "' is not cpu, cuda or cuda:N (N a GPU index, 0..",
      static_cast<int>(std::numeric_limits<c10::DeviceIndex>::max()), ")"));
}

absl::Status CheckDeviceUsable(absl::string_view flag,
                               const c10::Device& device) {
  if (device.is_cpu()) return absl::OkStatus();
  const std::string name = device.str();
  if (!device.is_cuda()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", name, "': blocks run on cpu or cuda only"));
  }
  // The CUDA device guard is registered by LibTorch's CUDA library alone.
  if (!c10::impl::hasDeviceGuardImpl(c10::kCUDA)) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": '", name,
                     "' needs CUDA, but this LibTorch was built without it "
                     "(use --device cpu, or a build with a CUDA LibTorch)"));
  }
  const size_t count = torch::cuda::device_count();
  if (count == 0 || !torch::cuda::is_available()) {
    return absl::FailedPreconditionError(absl::StrCat(
        flag, ": '", name, "' needs a CUDA GPU, but none is visible"));
  }
  if (static_cast<size_t>(device.index()) >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": '", name, "' is not a GPU of this machine (",
                     count, " visible: cuda:0..cuda:", count - 1, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<c10::Device> ParseDevice(absl::string_view flag,
                                        absl::string_view value) {
  ASSIGN_OR_RETURN(const c10::Device device, ParseDeviceName(flag, value));
  RETURN_IF_ERROR(CheckDeviceUsable(flag, device));
  return device;
}

absl::StatusOr<std::vector<c10::Device>> ParseDeviceList(
    absl::string_view flag, absl::string_view value) {
  std::vector<c10::Device> out;
  if (value.empty()) return out;
  for (absl::string_view name : absl::StrSplit(value, ',')) {
    if (name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, ": '", value, "' has an empty entry (device ", out.size() + 1,
          "); give one device, or one per block separated by commas"));
    }
    ASSIGN_OR_RETURN(const c10::Device device, ParseDevice(flag, name));
    out.push_back(device);
  }
  return out;
}

absl::StatusOr<std::vector<c10::Device>> BlockDevices(
    absl::string_view flag, const std::vector<c10::Device>& devices,
    int blocks) {
  if (devices.empty()) {
    return std::vector<c10::Device>(blocks, c10::Device(c10::kCPU));
  }
  if (devices.size() == 1) return std::vector<c10::Device>(blocks, devices[0]);
  if (static_cast<int>(devices.size()) != blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": ", devices.size(), " devices for a model of ", blocks,
        " blocks; give one device for all blocks or one per block"));
  }
  return devices;
}

void PrepareDevice(const c10::Device& device) {
  if (!device.is_cuda()) return;
  at::globalContext().setDeterministicCuDNN(true);
  at::globalContext().setBenchmarkCuDNN(false);
}

void Synchronize(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

}  // namespace interlock
