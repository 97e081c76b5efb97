#include "coordinator/export.h"

#include <torch/script.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/checkpoint.h"
#include "google/protobuf/text_format.h"
#include "plan/partition.h"
#include "plan/status_macros.h"
#include "proto/export.pb.h"
#include "services/data.h"
#include "services/data_info.h"
#include "services/models.h"
#include "services/scripted.h"
#include "services/torch_guard.h"
#include "services/trainer.h"

namespace interlock {
namespace {

namespace fs = std::filesystem;

absl::StatusOr<Checkpoint> FindCheckpoint(const ExportOptions& o) {
  if (!o.checkpoint.empty()) return ReadCheckpoint(o.checkpoint, o.seal_key);
  if (o.run_dir.empty()) {
    return absl::InvalidArgumentError("export: give --run OUT or --checkpoint");
  }
  const std::string root = o.run_dir + "/checkpoints";
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    return absl::NotFoundError(absl::StrCat(
        "export: ", root,
        ": no checkpoints; train with --out and --checkpoint-every N (the "
        "last step is always kept then)"));
  }
  ASSIGN_OR_RETURN(
      CheckpointStore store,
      CheckpointStore::Open(root, /*keep=*/1 << 30, nullptr, o.seal_key));
  std::vector<std::string> refused;
  std::optional<Checkpoint> latest = store.Latest(&refused);
  if (!latest) {
    return absl::NotFoundError(absl::StrCat(
        "export: no complete checkpoint in ", root,
        refused.empty() ? "" : absl::StrCat(" (refused: ", refused[0], ")")));
  }
  return *std::move(latest);
}

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out)
    return absl::InternalError(absl::StrCat("export: cannot write ", path));
  return absl::OkStatus();
}

}  // namespace

absl::Status ExportRun(const ExportOptions& o, std::ostream& log) {
  if (o.to.empty()) return absl::InvalidArgumentError("export: --to is empty");
  ASSIGN_OR_RETURN(Checkpoint ckpt, FindCheckpoint(o));
  const v1::RunConfig& config = ckpt.manifest.config();
  ASSIGN_OR_RETURN(DataSplits data,
                   LoadData(config.data(), TextContext(config.model())));
  ASSIGN_OR_RETURN(const int k_blocks, NumBlocks(config.model()));
  if (static_cast<int>(ckpt.blocks.size()) != k_blocks) {
    return absl::DataLossError(
        absl::StrCat("export: ", ckpt.dir, " holds ", ckpt.blocks.size(),
                     " blocks but the run's model has ", k_blocks));
  }
  // The blocks as the run built them, then the checkpoint's state.
  std::vector<std::unique_ptr<BlockTrainer>> trainers;
  std::vector<BlockModules> modules;
  for (int k = 0; k < k_blocks; ++k) {
    ASSIGN_OR_RETURN(auto trainer, BlockTrainer::Create(config, data.shape, k));
    RETURN_IF_ERROR(
        trainer->LoadState(ckpt.blocks[k], ckpt.manifest.step()).status());
    modules.push_back({trainer->block(), trainer->head()});
    trainers.push_back(std::move(trainer));
  }
  std::error_code ec;
  fs::create_directories(o.to, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("export: cannot create ", o.to, ": ", ec.message()));
  }

  v1::ExportedModel out;
  *out.mutable_config() = config;
  out.set_step(ckpt.manifest.step());
  out.set_checkpoint(ckpt.dir);
  if (auto units = NumUnits(config.model()); units.ok()) {
    auto counts = ParsePartition(config.model().partition(), *units,
                                 config.model().blocks());
    if (counts.ok()) {
      for (int c : *counts) out.add_partition(c);
    }
  }
  for (int64_t d : SampleShape(data.shape)) out.add_input_shape(d);
  out.set_input_dtype(data.shape.is_text ? "int64" : "float32");
  const DataInfo info = DataInfoOf(config.data());
  for (double m : info.mean) out.add_mean(m);
  for (double s : info.std) out.add_std(s);
  out.set_classes(data.shape.classes);
  out.set_language_model(data.shape.is_text);
  std::vector<std::string> names = info.class_names;
  if (names.empty() && config.model().has_scripted()) {
    const auto& declared = config.model().scripted().model().class_names();
    names.assign(declared.begin(), declared.end());
  }
  for (const auto& n : names) out.add_class_names(n);

  // Every tensor by name, in a file torch.load reads.
  RETURN_IF_ERROR(TorchGuard("export weights", [&]() -> absl::Status {
    c10::Dict<std::string, at::Tensor> weights;
    for (int k = 0; k < k_blocks; ++k) {
      for (const auto& [name, t] : trainers[k]->NamedState()) {
        weights.insert(absl::StrCat(k, ".", name),
                       t.detach().to(torch::kCPU).contiguous().clone());
      }
    }
    const std::vector<char> bytes = torch::pickle_save(weights);
    return WriteText(o.to + "/weights.pt",
                     std::string(bytes.begin(), bytes.end()));
  }));
  out.set_weights("weights.pt");

  if (config.model().has_scripted()) {
    ASSIGN_OR_RETURN(auto written, WriteScriptedNetworks(modules, o.to));
    for (const auto& [file, exit_block] : written) {
      auto* n = out.add_networks();
      n->set_file(file);
      n->set_exit_block(exit_block);
    }
  }
  std::string text;
  google::protobuf::TextFormat::PrintToString(out, &text);
  RETURN_IF_ERROR(WriteText(
      o.to + "/export.pbtxt",
      absl::StrCat("# interlock.v1.ExportedModel (proto/export.proto)\n",
                   text)));
  log << "interlock: exported step " << ckpt.manifest.step() << " of "
      << ckpt.dir << " to " << o.to << " (weights.pt";
  for (const auto& n : out.networks()) log << ", " << n.file();
  log << ")\n";
  return absl::OkStatus();
}

}  // namespace interlock
