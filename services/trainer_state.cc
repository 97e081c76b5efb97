// The block trainer's state: its tensors by name, and its whole training
// state as an archive (services/state_archive.h) and back.
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "plan/status_macros.h"
#include "services/replication.h"
#include "services/state_archive.h"
#include "services/torch_guard.h"
#include "services/trainer.h"

namespace interlock {

absl::Status BlockTrainer::CheckBoundary(const char* what) const {
  if (!pending_.empty() || accumulated_ != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", options_.block, ": state ", what, " with ", pending_.size(),
        " micro-batches in flight and ", accumulated_,
        " gradients accumulated; only a step boundary can be saved"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> BlockTrainer::SaveState(int64_t step) const {
  RETURN_IF_ERROR(CheckBoundary("saved"));
  return TorchGuard("save state", [&]() -> absl::StatusOr<std::string> {
    BlockStateRecord record;
    record.block = options_.block;
    record.step = step;
    for (const auto& [name, t] : NamedState()) record.tensors[name] = t;
    record.optimizer = optimizer_->StateTensors();
    return EncodeBlockState(record);
  });
}

namespace {

// Makes `into` hold copies of `from`'s tensors on the CPU, reusing a tensor
// of the same name, dtype and shape.
void CopyTensors(const std::map<std::string, torch::Tensor>& from,
                 std::map<std::string, torch::Tensor>* into) {
  for (auto it = into->begin(); it != into->end();) {
    it = from.count(it->first) ? std::next(it) : into->erase(it);
  }
  for (const auto& [name, t] : from) {
    torch::Tensor& dst = (*into)[name];
    if (!dst.defined() || dst.scalar_type() != t.scalar_type() ||
        dst.sizes() != t.sizes()) {
      dst = torch::empty(t.sizes(), t.options().device(torch::kCPU));
    }
    dst.copy_(t);
  }
}

}  // namespace

absl::Status BlockTrainer::CopyState(int64_t step,
                                     BlockStateRecord* into) const {
  RETURN_IF_ERROR(CheckBoundary("copied"));
  return TorchGuard("copy state", [&]() -> absl::Status {
    torch::NoGradGuard no_grad;
    std::map<std::string, torch::Tensor> named;
    for (const auto& [name, t] : NamedState()) named[name] = t;
    into->block = options_.block;
    into->step = step;
    CopyTensors(named, &into->tensors);
    CopyTensors(optimizer_->StateTensors(), &into->optimizer);
    return absl::OkStatus();
  });
}

absl::StatusOr<int64_t> BlockTrainer::LoadState(const std::string& bytes,
                                                int64_t expected_step) {
  const std::string what = absl::StrCat("block ", options_.block, " state");
  return TorchGuard("load state", [&]() -> absl::StatusOr<int64_t> {
    ASSIGN_OR_RETURN(const BlockStateRecord record,
                     DecodeBlockState(bytes, what));
    return LoadRecord(record, expected_step);
  });
}

absl::StatusOr<int64_t> BlockTrainer::LoadRecord(const BlockStateRecord& record,
                                                 int64_t expected_step) {
  const std::string what = absl::StrCat("block ", options_.block, " state");
  if (!pending_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": cannot load with ", pending_.size(),
                     " micro-batches in flight"));
  }
  return TorchGuard("load state", [&]() -> absl::StatusOr<int64_t> {
    if (record.block != options_.block) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": the archive holds block ", record.block));
    }
    const int64_t step = record.step;
    if (expected_step >= 0 && step != expected_step) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": the archive is of step ", step, ", expected ",
                       expected_step));
    }
    const auto& tensors = record.tensors;
    const auto& optim = record.optimizer;
    // Read and check everything first; change nothing until all is known
    // to fit.
    const auto named = NamedState();
    std::vector<torch::Tensor> loaded;
    for (const auto& [name, t] : named) {
      auto it = tensors.find(name);
      if (it == tensors.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": tensor '", name, "' is missing"));
      }
      const torch::Tensor& v = it->second;
      if (v.scalar_type() != t.scalar_type() || v.sizes() != t.sizes()) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": tensor '", name, "' is ", c10::toString(v.scalar_type()),
            c10::str(v.sizes()), ", the block has ",
            c10::toString(t.scalar_type()), c10::str(t.sizes())));
      }
      loaded.push_back(v);
    }
    if (tensors.size() != named.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": archive has ", tensors.size(),
                       " tensors, the block ", named.size()));
    }
    ASSIGN_OR_RETURN(auto fresh,
                     Optimizer::Create(optimizer_spec_, TrainedParams()));
    RETURN_IF_ERROR(fresh->LoadStateTensors(optim, what));
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < named.size(); ++i) {
      named[i].second.copy_(loaded[i]);
    }
    optimizer_ = std::move(fresh);
    optimizer_->ZeroGrad();
    accumulated_ = 0;
    if (replication_) replication_->Reset();
    return step;
  });
}

std::vector<std::pair<std::string, torch::Tensor>> BlockTrainer::NamedState()
    const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  auto add = [&](const std::string& prefix, const torch::nn::Sequential& m) {
    if (!m) return;
    for (const auto& kv : m->named_parameters()) {
      out.emplace_back(prefix + kv.key(), kv.value());
    }
    for (const auto& kv : m->named_buffers()) {
      out.emplace_back(prefix + kv.key(), kv.value());
    }
  };
  add("block.", modules_.block);
  add("head.", modules_.head);
  return out;
}

}  // namespace interlock
