#include "analysis/timeline.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "analysis/checked_write.h"
#include "analysis/run_files.h"
#include "plan/status_macros.h"

namespace interlock {
namespace {

// Colours of the phases in the picture (and their order in its legend).
constexpr struct {
  SpanKind kind;
  const char* colour;
} kPhases[] = {
    {SpanKind::kForward, "#4e79a7"},   {SpanKind::kHead, "#f28e2b"},
    {SpanKind::kBackward, "#e15759"},  {SpanKind::kOptimizer, "#59a14f"},
    {SpanKind::kInputGrad, "#b07aa1"}, {SpanKind::kReduce, "#9c755f"}};

const char* Colour(SpanKind kind) {
  for (const auto& p : kPhases) {
    if (p.kind == kind) return p.colour;
  }
  return "#000000";
}

// Spans of each track (a block, or a replica of one) in time order.
std::map<int, std::vector<Span>> ByTrack(const PipelineShape& shape,
                                         const std::vector<Span>& spans) {
  std::map<int, std::vector<Span>> out;
  for (const auto& s : spans) out[shape.Track(s.block, s.replica)].push_back(s);
  for (auto& [k, v] : out) {
    std::sort(v.begin(), v.end(),
              [](const Span& a, const Span& b) { return a.start < b.start; });
  }
  return out;
}

}  // namespace

std::string GnuplotQuote(const std::string& s) {
  return "'" + absl::StrReplaceAll(s, {{"'", "''"}}) + "'";
}

absl::Status RunGnuplot(const std::string& script_path) {
  const std::string cmd =
      absl::StrCat("gnuplot ", GnuplotQuote(script_path), " 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return absl::UnavailableError("cannot start gnuplot");
  std::string output;
  char buf[512];
  while (fgets(buf, sizeof(buf), p) != nullptr) output += buf;
  const int status = pclose(p);
  if (status != 0) {
    return absl::UnavailableError(
        absl::StrCat("gnuplot failed on ", script_path, " (status ", status,
                     "): ", output.empty() ? "is gnuplot installed?" : output));
  }
  return absl::OkStatus();
}

absl::Status WriteProfile(const PipelineSim& sim, const RunInfo& info,
                          const std::string& path) {
  const PipelineShape& sh = sim.shape();
  // Per-block costs leave the first step out, as the mean step times do:
  // its first allocations and cold caches would weigh on every prediction
  // from a short run.
  const bool after_first = info.steps > 1;
  const double steps = static_cast<double>(info.steps - (after_first ? 1 : 0));
  const double mbs = steps * sh.microbatches;
  v1::RunProfile p;
  p.set_name(info.name);
  p.set_blocks(sh.blocks);
  p.set_microbatches(sh.microbatches);
  p.set_batch_size(info.batch_size);
  p.set_mode(info.e2e ? "e2e" : "interlock");
  p.set_n(info.n);
  p.set_rule(info.sum_rule ? "sum" : "furthest");
  p.set_steps(static_cast<double>(info.steps));
  p.set_wire(info.wire);
  p.set_input_bytes(static_cast<double>(sh.input_bytes));
  for (int64_t b : sh.down_bytes) p.add_down_bytes(static_cast<double>(b));
  for (int64_t b : sh.up_bytes) p.add_up_bytes(static_cast<double>(b));
  p.mutable_link()->set_latency_seconds(sh.link.latency_seconds);
  p.mutable_link()->set_bytes_per_second(sh.link.bytes_per_second);
  for (int k = 0; k < sh.blocks; ++k) {
    v1::BlockCosts* b = p.add_per_block();
    b->set_forward(sim.BusyPhase(k, SpanKind::kForward, after_first) / mbs);
    b->set_head(sim.BusyPhase(k, SpanKind::kHead, after_first) / mbs);
    b->set_backward(sim.BusyPhase(k, SpanKind::kBackward, after_first) / mbs);
    b->set_input_grad(sim.BusyPhase(k, SpanKind::kInputGrad, after_first) /
                      mbs);
    // Every replica runs the optimizer step; the reduction is left out (the
    // clock derives it from the link model and the parameters).
    b->set_optimizer(sim.BusyPhase(k, SpanKind::kOptimizer, after_first) /
                     (steps * sh.Replicas(k)));
    if (sh.parameters[k] > 0) {
      b->set_parameters(static_cast<double>(sh.parameters[k]));
    }
    if (static_cast<size_t>(k) < info.shared_extra.size() &&
        info.shared_extra[k] >= 0) {
      b->set_shared_extra(info.shared_extra[k]);
    }
    if (static_cast<size_t>(k) < info.input_share.size() &&
        info.input_share[k] >= 0) {
      b->set_input_share(info.input_share[k]);
    }
  }
  if (sh.Tracks() > sh.blocks) {
    for (int r : sh.replicas) p.add_replicas(r);
  }
  p.set_reduction(sh.ring_reduction ? "ring" : "ordered");
  for (int c : info.partition) p.add_partition(c);
  p.mutable_step_seconds()->set_wall(info.mean_step_wall);
  p.mutable_step_seconds()->set_virtual_(info.mean_step_virtual);
  return WriteProfileFile(path, p);
}

absl::Status WriteTimeline(const PipelineSim& sim, const RunInfo& info,
                           const std::string& dir) {
  const PipelineShape& sh = sim.shape();
  const int k_blocks = sh.blocks;
  const int tracks = sh.Tracks();
  const auto by_track = ByTrack(sh, sim.spans());
  // Chrome trace events, microseconds, one track (tid) per block, or per
  // replica ("block k.r") where a block has replicas.
  std::vector<std::string> names;
  for (int k = 0; k < k_blocks; ++k) {
    for (int r = 0; r < sh.Replicas(k); ++r) {
      names.push_back(sh.Replicas(k) > 1 ? absl::StrCat("block ", k, ".", r)
                                         : absl::StrCat("block ", k));
    }
  }
  v1::Trace trace;
  trace.set_displaytimeunit("ms");
  auto& other = *trace.mutable_otherdata()->mutable_fields();
  other["clock"].set_string_value("virtual");
  other["run"].set_string_value(info.name);
  other["mode"].set_string_value(info.mode);
  for (int k = 0; k < tracks; ++k) {
    v1::TraceEvent* e = trace.add_traceevents();
    e->set_name("thread_name");
    e->set_ph("M");
    e->set_pid(1);
    e->set_tid(k);
    (*e->mutable_args()->mutable_fields())["name"].set_string_value(names[k]);
  }
  auto event = [&](const std::string& name, int k, double start, double end) {
    v1::TraceEvent* e = trace.add_traceevents();
    e->set_name(name);
    e->set_ph("X");
    e->set_pid(1);
    e->set_tid(k);
    e->set_ts(start * 1e6);
    e->set_dur((end - start) * 1e6);
    return e->mutable_args()->mutable_fields();
  };
  for (const auto& [k, spans] : by_track) {
    double t = 0.0;
    for (const auto& s : spans) {
      if (s.start > t + 1e-9) event("waiting", k, t, s.start);
      auto* args = event(SpanKindName(s.kind), k, s.start, s.end);
      (*args)["step"].set_number_value(static_cast<double>(s.step));
      (*args)["micro_batch"].set_number_value(s.mb);
      t = std::max(t, s.end);
    }
  }
  RETURN_IF_ERROR(
      WriteFileChecked(dir + "/timeline.json", JsonLine(trace) + "\n"));

  // The picture: a few steps after the first (which carries start-up).
  int64_t kept = 0;
  for (const auto& s : sim.spans()) kept = std::max(kept, s.step + 1);
  const int64_t first = kept > 2 ? 1 : 0;
  const int64_t last = std::min(kept, first + 3);
  std::string data;
  double x0 = -1, x1 = 0;
  for (const auto& s : sim.spans()) {
    if (s.step < first || s.step >= last) continue;
    if (x0 < 0 || s.start < x0) x0 = s.start;
    x1 = std::max(x1, s.end);
  }
  if (x0 < 0) return absl::OkStatus();  // nothing to draw
  for (const auto& s : sim.spans()) {
    if (s.step < first || s.step >= last) continue;
    absl::StrAppendFormat(&data, "%.6f %.6f %d 0x%s\n", (s.start - x0) * 1e3,
                          (s.end - x0) * 1e3, sh.Track(s.block, s.replica),
                          Colour(s.kind) + 1);
  }
  std::vector<std::string> ytics;
  for (int k = 0; k < tracks; ++k) {
    ytics.push_back(absl::StrCat("\"", names[k], "\" ", k));
  }
  std::string legend;
  for (const auto& p : kPhases) {
    if (p.kind == SpanKind::kReduce && tracks == k_blocks) continue;
    absl::StrAppend(&legend, ", NaN with boxes lc rgb '", p.colour, "' title '",
                    SpanKindName(p.kind), "'");
  }
  const std::string script = absl::StrCat(
      "set terminal pngcairo size 1200,", 140 + 60 * tracks,
      " font ',10' noenhanced\nset output ",
      GnuplotQuote(dir + "/timeline.png"), "\nset title ",
      GnuplotQuote(absl::StrCat(info.name, ", ", info.mode,
                                ": virtual timeline of steps ", first, "-",
                                last - 1, " (blank = waiting)")),
      "\nset xlabel 'virtual time (ms)'\nset ytics (",
      absl::StrJoin(ytics, ", "), ")\nset yrange [", tracks - 0.5,
      ":-0.5]\nset xrange [0:", (x1 - x0) * 1e3,
      "]\nset style fill solid 1.0 noborder\n",
      "set key outside right top\nset grid xtics\n$spans << EOD\n", data,
      "EOD\nplot $spans using (($1+$2)/2):3:(($2-$1)/2):(0.35):4 "
      "with boxxyerror lc rgb variable notitle",
      legend, "\n");
  const std::string script_path = dir + "/timeline.gp";
  if (auto st = WriteFileChecked(script_path, script); !st.ok()) return st;
  return RunGnuplot(script_path);
}

}  // namespace interlock
