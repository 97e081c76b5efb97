#include "coordinator/run_report.h"

#include <filesystem>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/json.h"
#include "coordinator/run_files.h"
#include "coordinator/timeline.h"
#include "services/digest.h"
#include "services/status_macros.h"

namespace interlock {

using interlock::v1::RunConfig;
using interlock::v1::TrainingSpec;

std::string ModeName(const RunConfig& c) {
  const auto& t = c.training();
  if (t.mode() == TrainingSpec::E2E) return "e2e";
  return absl::StrCat(t.n(), "-way ",
                      t.rule() == TrainingSpec::SUM ? "sum" : "furthest");
}

absl::Status DigestState(Engine& engine, bool dump_params,
                         TrainResult& result) {
  ASSIGN_OR_RETURN(auto states, engine.FetchState());
  std::vector<std::string> all;
  for (size_t k = 0; k < states.size(); ++k) {
    result.block_digests.push_back(DigestTensors(states[k].block));
    result.head_digests.push_back(
        states[k].head.empty() ? "" : DigestTensors(states[k].head));
    all.push_back(result.block_digests.back());
    all.push_back(result.head_digests.back());
    if (dump_params) {
      for (const auto* part : {&states[k].block, &states[k].head}) {
        for (const auto& [name, t] : *part) {
          auto flat = t.detach().to(torch::kFloat64).contiguous().view({-1});
          std::vector<std::string> vals;
          for (int64_t i = 0; i < flat.numel(); ++i) {
            vals.push_back(JsonNumber(flat[i].item<double>()));
          }
          std::vector<std::string> dims;
          for (int64_t d : t.sizes()) dims.push_back(absl::StrCat(d));
          absl::StrAppend(&result.params_json, "{\"name\":",
                          JsonString(absl::StrCat("block", k, ".", name)),
                          ",\"shape\":[", absl::StrJoin(dims, ","),
                          "],\"values\":[", absl::StrJoin(vals, ","), "]}\n");
        }
      }
    }
  }
  const std::string joined = absl::StrJoin(all, "/");
  result.digest = Sha256Hex(joined.data(), joined.size());
  return absl::OkStatus();
}

absl::Status WriteRunFiles(const RunConfig& config, const TrainResult& r,
                           const RunClock& clock, const std::string& out_dir) {
  std::ostringstream ev;
  for (const auto& e : r.evals) {
    for (const auto& h : e.heads) {
      ev << "{\"step\":" << e.step
         << ",\"wall_seconds\":" << JsonNumber(e.wall_seconds)
         << ",\"virtual_seconds\":" << JsonNumber(e.virtual_seconds)
         << ",\"block\":" << h.block
         << ",\"head\":" << (h.final ? "\"final\"" : "\"aux\"")
         << ",\"loss\":" << JsonNumber(h.loss)
         << ",\"accuracy\":" << JsonNumber(h.accuracy)
         << ",\"perplexity\":" << JsonNumber(h.perplexity) << "}\n";
    }
  }
  RETURN_IF_ERROR(WriteFileChecked(out_dir + "/eval.jsonl", ev.str()));
  std::ostringstream sm;
  const auto& t = config.training();
  sm << "{\n  \"name\": " << JsonString(config.name())
     << ",\n  \"mode\": " << JsonString(ModeName(config))
     << ",\n  \"blocks\": " << r.block_digests.size() << ",\n  \"n\": " << t.n()
     << ",\n  \"microbatches\": " << t.microbatches()
     << ",\n  \"batch_size\": " << t.batch_size()
     << ",\n  \"seed\": " << t.seed() << ",\n  \"steps\": " << r.steps
     << ",\n  \"skipped_steps\": [" << absl::StrJoin(r.skipped_steps, ", ")
     << "]"
     << ",\n  \"wall_seconds\": " << JsonNumber(r.wall_seconds)
     << ",\n  \"virtual_seconds\": " << JsonNumber(r.virtual_seconds)
     << ",\n  \"mean_step_seconds\": {\"wall\": "
     << JsonNumber(r.mean_step_wall)
     << ", \"virtual\": " << JsonNumber(r.mean_step_virtual) << "}"
     << ",\n  \"utilisation\": " << JsonNumber(r.utilisation)
     << ",\n  \"busy_ratio\": [";
  for (size_t k = 0; k < r.busy_ratio.size(); ++k) {
    sm << (k ? ", " : "") << JsonNumber(r.busy_ratio[k]);
  }
  sm << "],\n  \"eval\": [";
  for (size_t i = 0; i < r.eval.size(); ++i) {
    const auto& h = r.eval[i];
    sm << (i ? ", " : "") << "{\"block\": " << h.block
       << ", \"head\": " << (h.final ? "\"final\"" : "\"aux\"")
       << ", \"loss\": " << JsonNumber(h.loss)
       << ", \"accuracy\": " << JsonNumber(h.accuracy)
       << ", \"perplexity\": " << JsonNumber(h.perplexity) << "}";
  }
  sm << "],\n  \"digests\": [";
  for (size_t k = 0; k < r.block_digests.size(); ++k) {
    sm << (k ? ", " : "") << "{\"block\": " << k
       << ", \"params\": " << JsonString(r.block_digests[k])
       << ", \"head\": " << JsonString(r.head_digests[k]) << "}";
  }
  const Accounting& a = r.accounting;
  std::vector<std::string> bad;
  for (int64_t s : a.steps_not_exactly_once) bad.push_back(absl::StrCat(s));
  sm << "],\n  \"digest\": " << JsonString(r.digest)
     << ",\n  \"accounting\": {\"microbatches_per_step\": "
     << a.microbatches_per_step
     << ", \"microbatches_applied\": " << a.microbatches_applied
     << ", \"block_steps\": " << a.block_steps
     << ", \"steps_not_exactly_once\": [" << absl::StrJoin(bad, ", ")
     << "], \"recoveries\": " << a.recoveries
     << ", \"microbatches_replayed\": " << a.microbatches_replayed
     << ", \"duplicates_acknowledged\": " << a.duplicates_acknowledged
     << ", \"resumed_from_step\": " << a.resumed_from_step
     << ", \"checkpoints\": " << a.checkpoints << "}\n}\n";
  RETURN_IF_ERROR(WriteFileChecked(out_dir + "/summary.json.tmp", sm.str()));
  std::error_code ec;
  std::filesystem::rename(out_dir + "/summary.json.tmp",
                          out_dir + "/summary.json", ec);
  if (ec) return absl::DataLossError(ec.message());
  if (!clock.sim() || r.steps <= clock.base()) return absl::OkStatus();
  RunInfo info;
  info.name = config.name();
  info.mode = ModeName(config);
  info.e2e = t.mode() == TrainingSpec::E2E;
  info.n = t.n();
  info.sum_rule = t.rule() == TrainingSpec::SUM;
  info.batch_size = t.batch_size();
  info.steps = r.steps - clock.base();
  info.mean_step_wall = r.mean_step_wall;
  info.mean_step_virtual = r.mean_step_virtual;
  RETURN_IF_ERROR(WriteProfile(*clock.sim(), info, out_dir + "/profile.json"));
  return WriteTimeline(*clock.sim(), info, out_dir);
}

}  // namespace interlock
