#include "coordinator/export.h"

#include <torch/script.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/trained_model.h"
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
  ASSIGN_OR_RETURN(TrainedModel model,
                   LoadTrainedModel({o.run_dir, o.checkpoint, o.seal_key}));
  const Checkpoint& ckpt = model.checkpoint;
  const v1::RunConfig& config = model.config;
  const DataSplits& data = model.data;
  const int k_blocks = static_cast<int>(model.blocks.size());
  const auto& trainers = model.blocks;
  std::vector<BlockModules> modules;
  for (const auto& t : trainers) modules.push_back({t->block(), t->head()});
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
    NetworkInfo info;
    info.input_shape.assign(out.input_shape().begin(), out.input_shape().end());
    info.input_dtype = out.input_dtype();
    info.mean.assign(out.mean().begin(), out.mean().end());
    info.std.assign(out.std().begin(), out.std().end());
    info.class_names.assign(out.class_names().begin(), out.class_names().end());
    info.language_model = out.language_model();
    ASSIGN_OR_RETURN(auto written, WriteScriptedNetworks(modules, info, o.to));
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
