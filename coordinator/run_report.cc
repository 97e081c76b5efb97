#include "coordinator/run_report.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "analysis/run_files.h"
#include "analysis/timeline.h"
#include "plan/status_macros.h"
#include "services/digest.h"
#include "services/logging.h"
#include "services/models.h"
#include "services/wire_codec.h"

namespace interlock {
namespace {

using interlock::v1::EvalLine;
using interlock::v1::HeadMetrics;
using interlock::v1::RunSummary;

const char* HeadName(const HeadResult& h) { return h.final ? "final" : "aux"; }

// int64 counts as report.proto's doubles (JSON numbers, exact below 2^53).
double Count(int64_t n) { return static_cast<double>(n); }

}  // namespace

RunSummary SummaryOf(const v1::RunConfig& config, const std::string& mode,
                     int blocks, const TrainResult& r) {
  const auto& t = config.training();
  RunSummary s;
  s.set_name(config.name());
  s.set_mode(mode);
  s.set_blocks(blocks);
  s.set_n(t.n());
  s.set_microbatches(t.microbatches());
  s.set_batch_size(t.batch_size());
  s.set_seed(static_cast<double>(t.seed()));
  s.set_steps(Count(r.steps));
  for (int64_t n : r.skipped_steps) s.add_skipped_steps(Count(n));
  s.set_wall_seconds(r.wall_seconds);
  s.set_virtual_seconds(r.virtual_seconds);
  s.mutable_mean_step_seconds()->set_wall(r.mean_step_wall);
  s.mutable_mean_step_seconds()->set_virtual_(r.mean_step_virtual);
  s.set_utilisation(r.utilisation);
  for (double b : r.busy_ratio) s.add_busy_ratio(b);
  for (int n : r.replicas) s.add_replicas(n);
  s.set_reduction(t.reduction() == v1::TrainingSpec::RING ? "ring" : "ordered");
  for (size_t k = 0; k < r.replica_busy_ratio.size(); ++k) {
    const auto& replicas = r.replica_busy_ratio[k];
    if (replicas.size() < 2) continue;
    for (size_t i = 0; i < replicas.size(); ++i) {
      v1::ReplicaBusy* b = s.add_replica_busy_ratio();
      b->set_block(static_cast<int>(k));
      b->set_replica(static_cast<int>(i));
      b->set_ratio(replicas[i]);
    }
  }
  for (const HeadResult& h : r.eval) {
    HeadMetrics* m = s.add_eval();
    m->set_block(h.block);
    m->set_head(HeadName(h));
    m->set_loss(h.loss);
    m->set_accuracy(h.accuracy);
    m->set_perplexity(h.perplexity);
  }
  for (size_t k = 0; k < r.block_digests.size(); ++k) {
    v1::BlockDigest* d = s.add_digests();
    d->set_block(static_cast<int>(k));
    d->set_params(r.block_digests[k]);
    d->set_head(r.head_digests[k]);
  }
  s.set_digest(r.digest);
  s.set_wire(WireName(config.wire()));
  s.set_insecure(r.insecure);
  const Accounting& a = r.accounting;
  v1::RunAccounting* out = s.mutable_accounting();
  out->set_microbatches_per_step(Count(a.microbatches_per_step));
  out->set_microbatches_applied(Count(a.microbatches_applied));
  out->set_block_steps(Count(a.block_steps));
  for (int64_t step : a.steps_not_exactly_once) {
    out->add_steps_not_exactly_once(Count(step));
  }
  out->set_recoveries(Count(a.recoveries));
  out->set_microbatches_replayed(Count(a.microbatches_replayed));
  out->set_duplicates_acknowledged(Count(a.duplicates_acknowledged));
  out->set_resumed_from_step(Count(a.resumed_from_step));
  out->set_checkpoints(Count(a.checkpoints));
  out->set_failovers(Count(a.failovers));
  out->set_adoptions(Count(a.adoptions));
  for (const TopologyEvent& e : r.topology) {
    v1::TopologyChange* c = s.add_topology();
    c->set_step(Count(e.step));
    c->set_generation(Count(e.generation));
    for (const MemberChange& m : e.changes) {
      auto* o = c->add_changes();
      o->set_kind(MemberChangeName(m.kind));
      o->set_block(m.block);
      o->set_address(m.address);
    }
    for (int n : e.replicas) c->add_replicas(n);
    c->set_state_bytes(Count(e.state_bytes));
  }
  return s;
}

std::vector<EvalLine> EvalLinesOf(const std::vector<EvalPoint>& evals) {
  std::vector<EvalLine> out;
  for (const EvalPoint& e : evals) {
    for (const HeadResult& h : e.heads) {
      EvalLine& l = out.emplace_back();
      l.set_step(Count(e.step));
      l.set_wall_seconds(e.wall_seconds);
      l.set_virtual_seconds(e.virtual_seconds);
      l.set_block(h.block);
      l.set_head(HeadName(h));
      l.set_loss(h.loss);
      l.set_accuracy(h.accuracy);
      l.set_perplexity(h.perplexity);
    }
  }
  return out;
}

void AppendParamDump(const std::string& name, const torch::Tensor& tensor,
                     std::string* out) {
  v1::ParamDump dump;
  dump.set_name(name);
  for (int64_t d : tensor.sizes()) dump.add_shape(static_cast<int32_t>(d));
  const auto flat = tensor.detach().to(torch::kFloat64).contiguous().view({-1});
  const double* values = flat.data_ptr<double>();
  dump.mutable_values()->Add(values, values + flat.numel());
  absl::StrAppend(out, JsonLine(dump), "\n");
}

std::string ModeName(const v1::RunConfig& c) {
  const auto& t = c.training();
  if (t.mode() == v1::TrainingSpec::E2E) return "e2e";
  return absl::StrCat(t.n(), "-way ",
                      t.rule() == v1::TrainingSpec::SUM ? "sum" : "furthest");
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
    if (!dump_params) continue;
    for (const auto* part : {&states[k].block, &states[k].head}) {
      for (const auto& [name, t] : *part) {
        AppendParamDump(absl::StrCat("block", k, ".", name), t,
                        &result.params_json);
      }
    }
  }
  const std::string joined = absl::StrJoin(all, "/");
  result.digest = Sha256Hex(joined.data(), joined.size());
  return absl::OkStatus();
}

absl::Status WriteRunFiles(const v1::RunConfig& config, const TrainResult& r,
                           const RunClock& clock, const std::string& out_dir) {
  RETURN_IF_ERROR(WriteEval(out_dir + "/eval.jsonl", EvalLinesOf(r.evals)));
  RETURN_IF_ERROR(
      WriteSummary(out_dir + "/summary.json",
                   SummaryOf(config, ModeName(config),
                             static_cast<int>(r.block_digests.size()), r)));
  if (!clock.sim() || r.steps <= clock.base()) return absl::OkStatus();
  const auto& t = config.training();
  RunInfo info;
  info.name = config.name();
  info.mode = ModeName(config);
  info.e2e = t.mode() == v1::TrainingSpec::E2E;
  info.n = t.n();
  info.sum_rule = t.rule() == v1::TrainingSpec::SUM;
  info.batch_size = t.batch_size();
  info.wire = WireName(config.wire());
  if (auto units = NumUnits(config.model()); units.ok()) {
    auto counts = ParsePartition(config.model().partition(), *units,
                                 config.model().blocks());
    if (counts.ok()) info.partition = *std::move(counts);
  }
  info.steps = r.steps - clock.base();
  info.mean_step_wall = r.mean_step_wall;
  info.mean_step_virtual = r.mean_step_virtual;
  info.shared_extra = clock.SharedExtra();
  info.input_share = clock.InputShare();
  RETURN_IF_ERROR(WriteProfile(*clock.sim(), info, out_dir + "/profile.json"));
  // The picture is a convenience: a machine without gnuplot (a slim
  // container) still gets the run, and the script to draw it elsewhere.
  if (auto st = WriteTimeline(*clock.sim(), info, out_dir); !st.ok()) {
    LOG(WARNING) << "timeline not drawn: " << st.message() << " (" << out_dir
                 << "/timeline.gp draws it)";
  }
  return absl::OkStatus();
}

}  // namespace interlock
