#include "analysis/compare_report.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <filesystem>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "analysis/checked_write.h"
#include "analysis/run_files.h"
#include "analysis/timeline.h"
#include "plan/status_macros.h"

namespace interlock {
namespace {

using interlock::v1::EvalLine;
using interlock::v1::HeadMetrics;
using interlock::v1::RunSummary;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// Plots and their captions, in report order.
struct PlotFile {
  const char* file;
  const char* caption;
};
constexpr PlotFile kPlots[] = {
    {"metric_virtual_time.png", "test metric against virtual time"},
    {"metric_wall_time.png", "test metric against wall time"},
    {"metric_steps.png", "test metric against steps"},
    {"loss_steps.png", "training loss of every head against steps"},
};

// The test metric plotted: accuracy (%) or perplexity (text).
double Metric(const HeadMetrics& h, bool text) {
  return text ? h.perplexity() : 100.0 * h.accuracy();
}

// Per-step losses of one run (metrics.jsonl): one vector per block, NaN where
// a head reported nothing.
struct LossSeries {
  std::vector<int64_t> steps;
  std::vector<std::vector<double>> loss;  // [step][block]
};

absl::StatusOr<LossSeries> ReadLosses(const std::string& path, int blocks) {
  ASSIGN_OR_RETURN(const std::vector<v1::MetricsLine> lines, ReadMetrics(path));
  LossSeries out;
  for (const v1::MetricsLine& line : lines) {
    std::vector<double> row(blocks, kNaN);
    for (int k = 0; k < blocks && k < line.loss_size(); ++k) {
      row[k] = line.loss(k);
    }
    out.steps.push_back(static_cast<int64_t>(line.step()));
    out.loss.push_back(std::move(row));
  }
  return out;
}

// Writes plots/<mode>.eval.dat, plots/<mode>.loss.dat (losses as a moving
// mean) and DIR/plots.gp, which draws kPlots (absolute paths, so it runs
// from anywhere); returns the script's path.
absl::StatusOr<std::string> WritePlotScript(const std::string& dir,
                                            const std::string& config_name,
                                            const std::vector<ModeReport>& runs,
                                            int blocks, bool text) {
  std::error_code ec;
  std::filesystem::create_directories(dir + "/plots", ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create ", dir, "/plots: ", ec.message()));
  }
  const std::string abs = std::filesystem::absolute(dir, ec).string();
  auto at = [&abs](const std::string& file) {
    return GnuplotQuote(abs + "/" + file);
  };
  std::vector<std::string> eval_lines, wall_lines, step_lines;
  std::vector<std::vector<std::string>> loss_lines(blocks);
  // One colour per mode in every picture; with --seeds, the seeds of a mode
  // share its colour, each with its own dash, and one title.
  std::vector<std::string> groups;
  std::vector<int> seen;  // plotted runs per group
  for (size_t i = 0; i < runs.size(); ++i) {
    const ModeReport& r = runs[i];
    size_t g = 0;
    while (g < groups.size() && groups[g] != r.GroupLabel()) ++g;
    if (g == groups.size()) {
      groups.push_back(r.GroupLabel());
      seen.push_back(0);
    }
    if (!r.status.ok()) continue;
    const std::string name = r.Dir();
    std::string style;
    if (r.seed < 0) {
      style = absl::StrFormat("lt %d title %s", g + 1, GnuplotQuote(r.Label()));
    } else {
      style = absl::StrFormat(
          "lt %d dt %d %s", g + 1, seen[g] + 1,
          seen[g] == 0 ? "title " + GnuplotQuote(r.GroupLabel() + " (seeds)")
                       : std::string("notitle"));
    }
    ++seen[g];
    const std::string eval_file = absl::StrCat("plots/", name, ".eval.dat");
    std::string ev = absl::StrCat("# step wall_seconds virtual_seconds ",
                                  text ? "perplexity" : "accuracy_percent",
                                  " (final head)\n");
    for (const EvalLine& p : r.evals) {
      if (p.head() != "final") continue;
      HeadMetrics h;
      h.set_accuracy(p.accuracy());
      h.set_perplexity(p.perplexity());
      absl::StrAppendFormat(&ev, "%d %.6f %.6f %.6f\n",
                            static_cast<int64_t>(p.step()), p.wall_seconds(),
                            p.virtual_seconds(), Metric(h, text));
    }
    RETURN_IF_ERROR(WriteFileChecked(dir + "/" + eval_file, ev));
    auto plot = [&](int x) {
      return absl::StrFormat("%s using %d:4 with linespoints %s", at(eval_file),
                             x, style);
    };
    eval_lines.push_back(plot(3));
    wall_lines.push_back(plot(2));
    step_lines.push_back(plot(1));

    ASSIGN_OR_RETURN(LossSeries ls,
                     ReadLosses(r.dir + "/metrics.jsonl", blocks));
    const int64_t window =
        std::max<int64_t>(1, static_cast<int64_t>(ls.steps.size()) / 50);
    const std::string loss_file = absl::StrCat("plots/", name, ".loss.dat");
    std::string lf = absl::StrCat(
        "# step, then per block the training loss of its head (mean of the "
        "last ",
        window, " steps; NaN: no head)\n");
    std::vector<std::deque<double>> recent(blocks);
    std::vector<double> sums(blocks, 0.0);
    std::vector<bool> has(blocks, false);
    for (size_t i = 0; i < ls.steps.size(); ++i) {
      absl::StrAppend(&lf, ls.steps[i]);
      for (int k = 0; k < blocks; ++k) {
        const double v = ls.loss[i][k];
        if (std::isfinite(v)) {
          recent[k].push_back(v);
          sums[k] += v;
          if (static_cast<int64_t>(recent[k].size()) > window) {
            sums[k] -= recent[k].front();
            recent[k].pop_front();
          }
          has[k] = true;
        }
        if (std::isfinite(v) && !recent[k].empty()) {
          absl::StrAppendFormat(&lf, " %.6f", sums[k] / recent[k].size());
        } else {
          absl::StrAppend(&lf, " NaN");
        }
      }
      absl::StrAppend(&lf, "\n");
    }
    RETURN_IF_ERROR(WriteFileChecked(dir + "/" + loss_file, lf));
    for (int k = 0; k < blocks; ++k) {
      if (!has[k]) continue;
      loss_lines[k].push_back(absl::StrFormat("%s using 1:%d with lines %s",
                                              at(loss_file), k + 2, style));
    }
  }
  if (eval_lines.empty()) {
    return absl::FailedPreconditionError("no mode finished: nothing to plot");
  }
  const std::string metric =
      text ? "test perplexity of the final head (lower is better)"
           : "test accuracy of the final head (%)";
  const std::string key = text ? "top right" : "bottom right";
  std::string gp = absl::StrCat(
      "# Drawn by `interlock compare`; redraw with `gnuplot plots.gp`.\n",
      "term = strstrt(GPVAL_TERMINALS, \"pngcairo\") > 0 ? \"pngcairo\" : "
      "\"png\"\n",
      "set terminal @term size 960,600 noenhanced\n", "set grid\n", "set key ",
      key, "\n", "set ylabel \"", metric, "\"\n");
  const std::string name = config_name + ": ";
  auto metric_plot = [&](const char* file, const std::string& xlabel,
                         const std::string& what,
                         const std::vector<std::string>& lines) {
    absl::StrAppend(&gp, "set output ", at(file), "\n", "set title ",
                    GnuplotQuote(name + what), "\n", "set xlabel \"", xlabel,
                    "\"\n", "plot ", absl::StrJoin(lines, ", \\\n     "), "\n");
  };
  metric_plot(kPlots[0].file, "virtual time (s), one accelerator per block",
              "test metric against virtual time", eval_lines);
  metric_plot(kPlots[1].file, "wall time (s), training only",
              "test metric against wall time", wall_lines);
  metric_plot(kPlots[2].file, "steps", "test metric against steps", step_lines);
  int panels = 0;
  for (const auto& l : loss_lines) panels += l.empty() ? 0 : 1;
  absl::StrAppend(&gp, "set terminal @term size 960,", 40 + 260 * panels,
                  " noenhanced\n", "set output ", at(kPlots[3].file), "\n",
                  "set key top right\nset xlabel \"steps\"\n",
                  "set ylabel \"training loss (moving mean)\"\n",
                  "set multiplot layout ", panels, ",1 title ",
                  GnuplotQuote(name + "training loss of every head"), "\n");
  for (int k = 0; k < blocks; ++k) {
    if (loss_lines[k].empty()) continue;
    absl::StrAppend(&gp, "set title \"block ", k, " ",
                    k + 1 == blocks ? "final" : "auxiliary", " head\"\n",
                    "plot ", absl::StrJoin(loss_lines[k], ", \\\n     "), "\n");
  }
  absl::StrAppend(&gp, "unset multiplot\nset output\n");
  const std::string script = abs + "/plots.gp";
  RETURN_IF_ERROR(WriteFileChecked(script, gp));
  return script;
}

// Draws the plots; an error says why (gnuplot missing, a script error, or a
// picture it did not write).
absl::Status DrawPlots(const std::string& dir, const std::string& script) {
  RETURN_IF_ERROR(RunGnuplot(script));
  for (const PlotFile& p : kPlots) {
    std::error_code ec;
    if (std::filesystem::file_size(dir + "/" + p.file, ec) == 0 || ec) {
      return absl::InternalError(
          absl::StrCat("gnuplot wrote no ", dir, "/", p.file));
    }
  }
  return absl::OkStatus();
}

std::string Seconds(double s) { return absl::StrFormat("%.2f", s); }

}  // namespace

std::string ModeReport::GroupLabel() const {
  return wire.empty() ? mode.Label() : absl::StrCat(mode.Label(), "/", wire);
}

std::string ModeReport::Label() const {
  return seed < 0 ? GroupLabel() : absl::StrCat(GroupLabel(), " seed ", seed);
}

std::string ModeReport::Dir() const {
  std::string dir = wire.empty()
                        ? mode.Dir()
                        : absl::StrCat(mode.Dir(), "-",
                                       absl::StrReplaceAll(wire, {{":", "_"}}));
  if (seed >= 0) absl::StrAppend(&dir, "-seed", seed);
  return dir;
}

MeanSd MeanAndSd(const std::vector<double>& values) {
  MeanSd out;
  double sum = 0;
  for (double v : values) {
    if (!std::isfinite(v)) continue;
    sum += v;
    ++out.n;
  }
  if (out.n == 0) return MeanSd{kNaN, kNaN, 0};
  out.mean = sum / out.n;
  if (out.n < 2) {
    out.sd = kNaN;
    return out;
  }
  double squares = 0;
  for (double v : values) {
    if (std::isfinite(v)) squares += (v - out.mean) * (v - out.mean);
  }
  out.sd = std::sqrt(squares / (out.n - 1));
  return out;
}

std::vector<SeedAggregate> AggregateSeeds(const std::vector<ModeReport>& runs,
                                          int blocks, bool text) {
  struct Values {
    std::vector<double> steps, wall, virt, util;
    std::vector<std::vector<double>> metric;
  };
  std::vector<SeedAggregate> out;
  std::vector<Values> values;
  for (const ModeReport& r : runs) {
    size_t g = 0;
    while (g < out.size() && out[g].label != r.GroupLabel()) ++g;
    if (g == out.size()) {
      out.emplace_back().label = r.GroupLabel();
      values.emplace_back().metric.resize(blocks);
    }
    if (!r.status.ok()) continue;
    const RunSummary& s = r.summary;
    Values& v = values[g];
    ++out[g].runs;
    v.steps.push_back(s.steps());
    v.wall.push_back(s.mean_step_seconds().wall());
    v.virt.push_back(s.mean_step_seconds().virtual_());
    v.util.push_back(100.0 * s.utilisation());
    for (const HeadMetrics& h : s.eval()) {
      if (h.block() >= 0 && h.block() < blocks) {
        v.metric[h.block()].push_back(Metric(h, text));
      }
    }
  }
  for (size_t g = 0; g < out.size(); ++g) {
    out[g].steps = MeanAndSd(values[g].steps);
    out[g].step_wall = MeanAndSd(values[g].wall);
    out[g].step_virtual = MeanAndSd(values[g].virt);
    out[g].utilisation = MeanAndSd(values[g].util);
    for (const auto& m : values[g].metric) {
      out[g].metric.push_back(MeanAndSd(m));
    }
  }
  return out;
}

std::string FormatMeanSd(const MeanSd& m, bool percent, int decimals) {
  if (m.n == 0) return "-";
  const char* unit = percent ? "%" : "";
  const std::string sd =
      m.n < 2 ? "-" : absl::StrFormat("%.*f", decimals, m.sd);
  return absl::StrFormat("%.*f%s ± %s", decimals, m.mean, unit, sd);
}

absl::Status ReadModeFiles(ModeReport& report) {
  auto summary = ReadSummary(report.dir + "/summary.json");
  if (!summary.ok()) return summary.status();
  auto evals = ReadEval(report.dir + "/eval.jsonl");
  if (!evals.ok()) return evals.status();
  report.summary = *std::move(summary);
  report.evals = *std::move(evals);
  return absl::OkStatus();
}

bool IsText(const std::vector<ModeReport>& runs) {
  for (const ModeReport& r : runs) {
    if (!r.status.ok()) continue;
    for (const HeadMetrics& h : r.summary.eval()) {
      if (std::isfinite(h.perplexity())) return true;
    }
  }
  return false;
}

const HeadMetrics* FinalHead(const RunSummary& summary) {
  for (const HeadMetrics& h : summary.eval()) {
    if (h.head() == "final") return &h;
  }
  return nullptr;
}

std::string FormatMetric(const HeadMetrics& h, bool text) {
  return text ? absl::StrFormat("%.3f", h.perplexity())
              : absl::StrFormat("%.2f%%", 100.0 * h.accuracy());
}

absl::Status WritePlots(const std::string& dir, const std::string& name,
                        const std::vector<ModeReport>& runs, int blocks) {
  ASSIGN_OR_RETURN(const std::string script,
                   WritePlotScript(dir, name, runs, blocks, IsText(runs)));
  return DrawPlots(dir, script);
}

absl::Status WriteReport(const std::string& dir, const ReportHeader& header,
                         const std::vector<ModeReport>& runs,
                         const absl::Status& plots) {
  const bool text = IsText(runs);
  const int blocks = header.blocks;
  std::string md = absl::StrCat("# Compare: ", header.name, "\n\n");
  absl::StrAppend(
      &md, "* Date: ",
      absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::Now(),
                       absl::UTCTimeZone()),
      "\n", "* Command: `", header.command_line, "`\n", "* Config: `",
      header.config_path, "` (", header.name, ": K = ", blocks,
      " blocks, batch ", header.batch_size,
      ", micro-batches per step M = ", header.microbatches,
      header.seeds.empty()
          ? absl::StrCat(", seed ", header.seed,
                         "; every mode sees the same data order)")
          : absl::StrCat(", seeds ", absl::StrJoin(header.seeds, ", "),
                         ": every mode runs once per seed; the "
                         "runs of a seed see the same data "
                         "order)"),
      "\n");
  if (!header.partition.empty()) {
    absl::StrAppend(&md, "* Partition (units per block): ", header.partition,
                    "\n");
  }
  absl::StrAppend(&md, "* Engine: ", header.engine, "\n");
  if (!header.wire.empty()) {
    absl::StrAppend(&md, "* Wire codecs: ", header.wire, "\n");
  }
  absl::StrAppend(
      &md, "* Limit: ", header.limit, "\n",
      "* Evaluation on the test split: ", header.cadence, "\n",
      absl::StrFormat(
          "* Virtual clock: the measured operation times replayed as if every "
          "block had an accelerator of its own, messages costing %.0f us + "
          "bytes / %.3g B/s\n",
          header.link.latency_seconds * 1e6, header.link.bytes_per_second),
      "* Utilisation: busy / (K x elapsed) on the virtual clock\n\n");

  std::vector<std::string> columns = {"mode",          "steps",
                                      "wall (s)",      "virtual (s)",
                                      "step wall (s)", "step virtual (s)",
                                      "utilisation",   "busy per block"};
  for (int k = 0; k < blocks; ++k) {
    columns.push_back(absl::StrCat("block ", k, " ",
                                   k + 1 == blocks ? "final" : "aux", " ",
                                   text ? "perplexity" : "accuracy"));
  }
  absl::StrAppend(&md, "| ", absl::StrJoin(columns, " | "), " |\n|");
  for (size_t i = 0; i < columns.size(); ++i) {
    absl::StrAppend(&md, i == 0 ? "---|" : "---:|");
  }
  absl::StrAppend(&md, "\n");
  std::vector<std::string> failures;
  for (const ModeReport& r : runs) {
    std::vector<std::string> row = {r.Label()};
    if (!r.status.ok()) {
      row.push_back(r.tried ? "failed" : "not run");
      row.resize(columns.size(), "-");
      if (r.tried) {
        failures.push_back(
            absl::StrCat("* ", r.Label(), ": ", r.status.message()));
      }
    } else {
      const RunSummary& res = r.summary;
      std::vector<std::string> busy;
      for (double b : res.busy_ratio()) {
        busy.push_back(absl::StrFormat("%.0f%%", 100.0 * b));
      }
      row.push_back(absl::StrCat(static_cast<int64_t>(res.steps())));
      row.push_back(Seconds(res.wall_seconds()));
      row.push_back(Seconds(res.virtual_seconds()));
      row.push_back(absl::StrFormat("%.4g", res.mean_step_seconds().wall()));
      row.push_back(
          absl::StrFormat("%.4g", res.mean_step_seconds().virtual_()));
      row.push_back(absl::StrFormat("%.1f%%", 100.0 * res.utilisation()));
      row.push_back(absl::StrJoin(busy, " "));
      for (int k = 0; k < blocks; ++k) {
        std::string cell = "-";
        for (const HeadMetrics& h : res.eval()) {
          if (h.block() == k) cell = FormatMetric(h, text);
        }
        row.push_back(cell);
      }
    }
    absl::StrAppend(&md, "| ", absl::StrJoin(row, " | "), " |\n");
  }
  absl::StrAppend(&md,
                  "\nStep times are means after the first step. E2E has no "
                  "auxiliary heads (-).\n");
  if (!header.seeds.empty()) {
    absl::StrAppend(
        &md,
        "\n## Over seeds\n\nMean ± sample standard deviation over the "
        "seeds ",
        absl::StrJoin(header.seeds, ", "),
        " of each mode's finished runs (runs: how many finished; one run "
        "has no deviation, -).\n\n");
    std::vector<std::string> agg_columns = {
        "mode",       "runs", "steps", "step wall (s)", "step virtual (s)",
        "utilisation"};
    for (int k = 0; k < blocks; ++k) {
      agg_columns.push_back(columns[columns.size() - blocks + k]);
    }
    absl::StrAppend(&md, "| ", absl::StrJoin(agg_columns, " | "), " |\n|");
    for (size_t i = 0; i < agg_columns.size(); ++i) {
      absl::StrAppend(&md, i == 0 ? "---|" : "---:|");
    }
    absl::StrAppend(&md, "\n");
    for (const SeedAggregate& a : AggregateSeeds(runs, blocks, text)) {
      std::vector<std::string> row = {a.label,
                                      absl::StrCat(a.runs),
                                      FormatMeanSd(a.steps, false, 1),
                                      FormatMeanSd(a.step_wall, false, 4),
                                      FormatMeanSd(a.step_virtual, false, 4),
                                      FormatMeanSd(a.utilisation, true, 1)};
      for (const MeanSd& m : a.metric) {
        row.push_back(FormatMeanSd(m, !text, text ? 3 : 2));
      }
      absl::StrAppend(&md, "| ", absl::StrJoin(row, " | "), " |\n");
    }
  }
  if (!failures.empty()) {
    absl::StrAppend(&md, "\n## Failures\n\n", absl::StrJoin(failures, "\n"),
                    "\n");
  }
  absl::StrAppend(&md, "\n## Plots\n\n");
  if (plots.ok()) {
    for (const PlotFile& p : kPlots) {
      absl::StrAppend(&md, "![", p.caption, "](", p.file, ")\n\n");
    }
    absl::StrAppend(&md,
                    "Plot data: `plots/*.dat`; redraw with `gnuplot "
                    "plots.gp`.\n");
  } else {
    absl::StrAppend(&md, "No plots: ", plots.message(), "\n");
  }
  absl::StrAppend(&md,
                  "\nEvery mode's run files (metrics.jsonl, eval.jsonl, "
                  "summary.json, profile.json, timeline) are in its folder: ");
  std::vector<std::string> dirs;
  for (const ModeReport& r : runs) dirs.push_back("`" + r.Dir() + "/`");
  absl::StrAppend(&md, absl::StrJoin(dirs, ", "), ".\n");

  return WriteFileReplacing(dir + "/report.md", md);
}

}  // namespace interlock
