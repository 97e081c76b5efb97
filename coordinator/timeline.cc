#include "coordinator/timeline.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "coordinator/json.h"
#include "coordinator/run_files.h"

namespace interlock {
namespace {

// Colours of the phases in the picture (and their order in its legend).
constexpr struct {
  SpanKind kind;
  const char* colour;
} kPhases[] = {{SpanKind::kForward, "#4e79a7"},
               {SpanKind::kHead, "#f28e2b"},
               {SpanKind::kBackward, "#e15759"},
               {SpanKind::kOptimizer, "#59a14f"},
               {SpanKind::kInputGrad, "#b07aa1"}};

const char* Colour(SpanKind kind) {
  for (const auto& p : kPhases) {
    if (p.kind == kind) return p.colour;
  }
  return "#000000";
}

std::string Quote(const std::string& s) {
  return "'" + absl::StrReplaceAll(s, {{"'", "''"}}) + "'";
}

// Spans of each block in time order.
std::map<int, std::vector<Span>> ByBlock(const std::vector<Span>& spans) {
  std::map<int, std::vector<Span>> out;
  for (const auto& s : spans) out[s.block].push_back(s);
  for (auto& [k, v] : out) {
    std::sort(v.begin(), v.end(),
              [](const Span& a, const Span& b) { return a.start < b.start; });
  }
  return out;
}

}  // namespace

absl::Status RunGnuplot(const std::string& script_path) {
  const std::string cmd = absl::StrCat("gnuplot ", Quote(script_path), " 2>&1");
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
  const double mbs = static_cast<double>(info.steps) * sh.microbatches;
  const double steps = static_cast<double>(info.steps);
  std::vector<std::string> blocks;
  for (int k = 0; k < sh.blocks; ++k) {
    blocks.push_back(absl::StrCat(
        "{\"forward\": ",
        JsonNumber(sim.BusyPhase(k, SpanKind::kForward) / mbs), ", \"head\": ",
        JsonNumber(sim.BusyPhase(k, SpanKind::kHead) / mbs), ", \"backward\": ",
        JsonNumber(sim.BusyPhase(k, SpanKind::kBackward) / mbs),
        ", \"input_grad\": ",
        JsonNumber(sim.BusyPhase(k, SpanKind::kInputGrad) / mbs),
        ", \"optimizer\": ",
        JsonNumber(sim.BusyPhase(k, SpanKind::kOptimizer) / steps), "}"));
  }
  const std::string text = absl::StrCat(
      "{\n  \"name\": ", JsonString(info.name), ",\n  \"blocks\": ", sh.blocks,
      ",\n  \"microbatches\": ", sh.microbatches,
      ",\n  \"batch_size\": ", info.batch_size,
      ",\n  \"mode\": ", JsonString(info.e2e ? "e2e" : "interlock"),
      ",\n  \"n\": ", info.n,
      ",\n  \"rule\": ", JsonString(info.sum_rule ? "sum" : "furthest"),
      ",\n  \"steps\": ", info.steps, ",\n  \"input_bytes\": ", sh.input_bytes,
      ",\n  \"down_bytes\": [", absl::StrJoin(sh.down_bytes, ", "),
      "],\n  \"up_bytes\": [", absl::StrJoin(sh.up_bytes, ", "),
      "],\n  \"link\": {\"latency_seconds\": ",
      JsonNumber(sh.link.latency_seconds),
      ", \"bytes_per_second\": ", JsonNumber(sh.link.bytes_per_second),
      "},\n  \"per_block\": [\n    ", absl::StrJoin(blocks, ",\n    "),
      "\n  ],\n  \"step_seconds\": {\"wall\": ",
      JsonNumber(info.mean_step_wall),
      ", \"virtual\": ", JsonNumber(info.mean_step_virtual), "}\n}\n");
  return WriteFileChecked(path, text);
}

absl::Status WriteTimeline(const PipelineSim& sim, const RunInfo& info,
                           const std::string& dir) {
  const int k_blocks = sim.shape().blocks;
  const auto blocks = ByBlock(sim.spans());
  // Chrome trace events, microseconds, one track (tid) per block.
  std::vector<std::string> ev;
  for (int k = 0; k < k_blocks; ++k) {
    ev.push_back(absl::StrCat(
        "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 1, \"tid\": ", k,
        ", \"args\": {\"name\": \"block ", k, "\"}}"));
  }
  auto event = [&](const std::string& name, int k, double start, double end,
                   const std::string& args) {
    ev.push_back(absl::StrCat("{\"name\": ", JsonString(name),
                              ", \"ph\": \"X\", \"pid\": 1, ", "\"tid\": ", k,
                              ", \"ts\": ", JsonNumber(start * 1e6),
                              ", \"dur\": ", JsonNumber((end - start) * 1e6),
                              ", \"args\": {", args, "}}"));
  };
  for (const auto& [k, spans] : blocks) {
    double t = 0.0;
    for (const auto& s : spans) {
      if (s.start > t + 1e-9) event("waiting", k, t, s.start, "");
      event(SpanKindName(s.kind), k, s.start, s.end,
            absl::StrCat("\"step\": ", s.step, ", \"micro_batch\": ", s.mb));
      t = std::max(t, s.end);
    }
  }
  const std::string json = absl::StrCat(
      "{\"displayTimeUnit\": \"ms\",\n \"otherData\": {\"clock\": \"virtual\", "
      "\"run\": ",
      JsonString(info.name), ", \"mode\": ", JsonString(info.mode),
      "},\n \"traceEvents\": [\n  ", absl::StrJoin(ev, ",\n  "), "\n ]}\n");
  const std::string json_path = dir + "/timeline.json";
  if (auto st = WriteFileChecked(json_path, json); !st.ok()) return st;

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
                          (s.end - x0) * 1e3, s.block, Colour(s.kind) + 1);
  }
  std::vector<std::string> ytics;
  for (int k = 0; k < k_blocks; ++k) {
    ytics.push_back(absl::StrCat("\"block ", k, "\" ", k));
  }
  std::string legend;
  for (const auto& p : kPhases) {
    absl::StrAppend(&legend, ", NaN with boxes lc rgb '", p.colour, "' title '",
                    SpanKindName(p.kind), "'");
  }
  const std::string script = absl::StrCat(
      "set terminal pngcairo size 1200,", 140 + 60 * k_blocks,
      " font ',10' noenhanced\nset output ", Quote(dir + "/timeline.png"),
      "\nset title ",
      Quote(absl::StrCat(info.name, ", ", info.mode,
                         ": virtual timeline of steps ", first, "-", last - 1,
                         " (blank = waiting)")),
      "\nset xlabel 'virtual time (ms)'\nset ytics (",
      absl::StrJoin(ytics, ", "), ")\nset yrange [", k_blocks - 0.5,
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
