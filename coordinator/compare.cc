#include "coordinator/compare.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "coordinator/run_files.h"
#include "coordinator/simulate.h"
#include "coordinator/timeline.h"
#include "services/config.h"
#include "services/data.h"
#include "services/models.h"
#include "services/status_macros.h"

namespace interlock {
namespace {

using interlock::v1::RunConfig;
using interlock::v1::TrainingSpec;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// Evaluations per mode when the config sets no cadence.
constexpr int64_t kEvalPoints = 10;
// Steps of the run that predicts each mode's step count under a budget.
constexpr int64_t kCalibrationSteps = 6;
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

struct ModeRun {
  ModeSpec mode;
  std::string dir;
  int64_t eval_every = 0;
  bool tried = false;
  absl::StatusOr<TrainResult> result = absl::UnknownError("not run");
};

RunConfig ConfigFor(const RunConfig& base, const ModeSpec& mode,
                    const CompareOptions& o, int64_t eval_every) {
  RunConfig c = base;
  auto* t = c.mutable_training();
  t->set_mode(mode.e2e ? TrainingSpec::E2E : TrainingSpec::INTERLOCK);
  if (!mode.e2e) {
    t->set_n(mode.n);
    t->set_rule(mode.sum ? TrainingSpec::SUM : TrainingSpec::FURTHEST);
  }
  if (o.steps >= 0) t->set_steps(o.steps);
  if (o.seed >= 0) t->set_seed(o.seed);
  if (o.threads_per_block > 0) t->set_threads_per_block(o.threads_per_block);
  t->set_eval_every_steps(eval_every);
  return c;
}

// Steps a run of the config asks for (epochs need the training set's size).
absl::StatusOr<int64_t> TotalSteps(const RunConfig& c) {
  const auto& t = c.training();
  if (t.steps() > 0) return t.steps();
  const int64_t context =
      c.model().has_transformer() ? c.model().transformer().context() : 1;
  ASSIGN_OR_RETURN(DataSplits data, LoadData(c.data(), context));
  return std::max<int64_t>(
      1, t.epochs() * (data.train->size() / std::max(1, t.batch_size())));
}

bool HasBudget(const TrainOptions& t) {
  return t.budget.wall > absl::ZeroDuration() ||
         t.budget.virtual_time > absl::ZeroDuration();
}

// Predicts how many steps each mode does within the budgets, from a short
// run of the first mode and the simulator. Empty when that fails; `note`
// says what was done.
std::vector<int64_t> PredictSteps(const RunConfig& config,
                                  const std::vector<ModeSpec>& modes,
                                  const CompareOptions& o, int64_t total,
                                  std::string* note) {
  TrainOptions t = o.train;
  t.output.out_dir = o.out_dir + "/calibration";
  t.output.quiet = true;
  t.budget.wall = t.budget.virtual_time = absl::ZeroDuration();
  t.output.metrics_port = -1;
  RunConfig c = ConfigFor(config, modes[0], o, 0);
  c.mutable_training()->set_steps(std::min(kCalibrationSteps, total));
  *o.train.output.log
      << "calibrating: " << c.training().steps() << " steps of "
      << modes[0].Label()
      << " to predict every mode's steps for the evaluation cadence\n";
  auto run = Train(c, t);
  auto profile = run.ok() ? LoadProfile(t.output.out_dir) : run.status();
  std::error_code ec;
  std::filesystem::remove_all(t.output.out_dir, ec);
  if (!profile.ok()) {
    *note =
        absl::StrCat("the calibration run failed (", profile.status().message(),
                     "), so every mode evaluates every ",
                     std::max<int64_t>(1, total / kEvalPoints), " steps");
    return {};
  }
  const bool serial = o.train.engine.kind == EngineKind::kInProcess &&
                      o.train.engine.schedule == Schedule::kSequential;
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  // Predicted virtual and wall step time of a mode.
  auto predict = [&](const ModeSpec& m) {
    const SimResult s = PredictMode(*profile, profile->blocks,
                                    profile->microbatches, o.train.link, m);
    const double busy = s.utilisation * profile->blocks * s.step_seconds;
    return std::make_pair(
        s.step_seconds, serial ? busy : std::max(s.step_seconds, busy / cores));
  };
  // The profile's means include the first step's start-up; the run's means
  // after it put the predictions back on scale.
  const auto [first_virtual, first_wall] = predict(modes[0]);
  const double scale_virtual = first_virtual > 0 && run->mean_step_virtual > 0
                                   ? run->mean_step_virtual / first_virtual
                                   : 1.0;
  const double scale_wall = first_wall > 0 && run->mean_step_wall > 0
                                ? run->mean_step_wall / first_wall
                                : 1.0;
  const double bv = absl::ToDoubleSeconds(o.train.budget.virtual_time);
  const double bw = absl::ToDoubleSeconds(o.train.budget.wall);
  std::vector<int64_t> out;
  for (const ModeSpec& m : modes) {
    const auto [step_virtual, step_wall] = predict(m);
    int64_t expected = total;
    if (bv > 0 && step_virtual > 0) {
      expected = std::min<int64_t>(
          expected, std::ceil(bv / (step_virtual * scale_virtual)));
    }
    if (bw > 0 && step_wall > 0) {
      expected =
          std::min<int64_t>(expected, std::ceil(bw / (step_wall * scale_wall)));
    }
    out.push_back(std::max<int64_t>(1, expected));
  }
  *note = absl::StrCat(
      "about ", kEvalPoints,
      " evaluations per mode, at a cadence set from each mode's step count "
      "predicted by `interlock simulate` on a ",
      kCalibrationSteps, "-step calibration run of ", modes[0].Label());
  return out;
}

bool IsText(const std::vector<ModeRun>& runs) {
  for (const ModeRun& r : runs) {
    if (!r.result.ok()) continue;
    for (const HeadResult& h : r.result->eval) {
      if (std::isfinite(h.perplexity)) return true;
    }
  }
  return false;
}

// The test metric plotted and tabulated: accuracy (%) or perplexity (text).
double Metric(const HeadResult& h, bool text) {
  return text ? h.perplexity : 100.0 * h.accuracy;
}

std::string FormatMetric(const HeadResult& h, bool text) {
  return text ? absl::StrFormat("%.3f", h.perplexity)
              : absl::StrFormat("%.2f%%", 100.0 * h.accuracy);
}

const HeadResult* FinalHead(const std::vector<HeadResult>& heads) {
  for (const HeadResult& h : heads) {
    if (h.final) return &h;
  }
  return nullptr;
}

// Per-step losses of one run (metrics.jsonl): one vector per block, NaN where
// a head reported nothing.
struct LossSeries {
  std::vector<int64_t> steps;
  std::vector<std::vector<double>> loss;  // [step][block]
};

absl::StatusOr<LossSeries> ReadLosses(const std::string& path, int blocks) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  LossSeries out;
  std::string line;
  int64_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty()) continue;
    google::protobuf::Struct s;
    const auto& f = s.fields();
    auto st = google::protobuf::util::JsonStringToMessage(line, &s);
    auto step = f.find("step");
    auto loss = f.find("loss");
    if (!st.ok() || step == f.end() || loss == f.end() ||
        !step->second.has_number_value() || !loss->second.has_list_value()) {
      return absl::DataLossError(absl::StrCat(
          path, ":", number, ": expected {\"step\": N, \"loss\": [...]}"));
    }
    std::vector<double> row(blocks, kNaN);
    const auto& values = loss->second.list_value().values();
    for (int k = 0; k < blocks && k < values.size(); ++k) {
      if (values[k].has_number_value()) row[k] = values[k].number_value();
    }
    out.steps.push_back(static_cast<int64_t>(step->second.number_value()));
    out.loss.push_back(std::move(row));
  }
  return out;
}

// A gnuplot string literal.
std::string GpQuote(const std::string& s) {
  return "'" + absl::StrReplaceAll(s, {{"'", "''"}}) + "'";
}

// Writes plots/<mode>.eval.dat, plots/<mode>.loss.dat (losses as a moving
// mean) and DIR/plots.gp, which draws kPlots (absolute paths, so it runs
// from anywhere); returns the script's path.
absl::StatusOr<std::string> WritePlotScript(const std::string& dir,
                                            const RunConfig& config,
                                            const std::vector<ModeRun>& runs,
                                            int blocks, bool text) {
  std::error_code ec;
  std::filesystem::create_directories(dir + "/plots", ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create ", dir, "/plots: ", ec.message()));
  }
  const std::string abs = std::filesystem::absolute(dir, ec).string();
  auto at = [&abs](const std::string& file) {
    return GpQuote(abs + "/" + file);
  };
  std::vector<std::string> eval_lines, wall_lines, step_lines;
  std::vector<std::vector<std::string>> loss_lines(blocks);
  for (size_t i = 0; i < runs.size(); ++i) {
    const ModeRun& r = runs[i];
    if (!r.result.ok()) continue;
    const std::string name = r.mode.Dir();
    // One colour per mode in every picture.
    const std::string style =
        absl::StrFormat("lt %d title %s", i + 1, GpQuote(r.mode.Label()));
    const std::string eval_file = absl::StrCat("plots/", name, ".eval.dat");
    std::string ev = absl::StrCat("# step wall_seconds virtual_seconds ",
                                  text ? "perplexity" : "accuracy_percent",
                                  " (final head)\n");
    for (const EvalPoint& p : r.result->evals) {
      const HeadResult* h = FinalHead(p.heads);
      if (h == nullptr) continue;
      absl::StrAppendFormat(&ev, "%d %.6f %.6f %.6f\n", p.step, p.wall_seconds,
                            p.virtual_seconds, Metric(*h, text));
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
  const std::string name = config.name() + ": ";
  auto metric_plot = [&](const char* file, const std::string& xlabel,
                         const std::string& what,
                         const std::vector<std::string>& lines) {
    absl::StrAppend(&gp, "set output ", at(file), "\n", "set title ",
                    GpQuote(name + what), "\n", "set xlabel \"", xlabel, "\"\n",
                    "plot ", absl::StrJoin(lines, ", \\\n     "), "\n");
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
                  GpQuote(name + "training loss of every head"), "\n");
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

std::string LimitText(const CompareOptions& o, const RunConfig& config) {
  std::vector<std::string> parts;
  if (o.train.budget.virtual_time > absl::ZeroDuration()) {
    parts.push_back(
        absl::StrCat("virtual-time budget ",
                     absl::FormatDuration(o.train.budget.virtual_time)));
  }
  if (o.train.budget.wall > absl::ZeroDuration()) {
    parts.push_back(absl::StrCat("wall-time budget ",
                                 absl::FormatDuration(o.train.budget.wall)));
  }
  const auto& t = config.training();
  const std::string steps =
      o.steps > 0     ? absl::StrCat(o.steps, " steps (--steps)")
      : t.steps() > 0 ? absl::StrCat(t.steps(), " steps (config)")
                      : absl::StrCat(t.epochs(), " epoch(s) (config)");
  if (parts.empty()) return steps + " per mode";
  return absl::StrCat(absl::StrJoin(parts, " and "),
                      " per mode (a run stops submitting steps there, finishes "
                      "the steps in flight and evaluates), at most ",
                      steps);
}

absl::Status WriteReport(const CompareOptions& o, const RunConfig& config,
                         int blocks, const std::vector<ModeRun>& runs,
                         const std::string& cadence,
                         const absl::Status& plots) {
  const bool text = IsText(runs);
  const auto& t = config.training();
  std::string md = absl::StrCat("# Compare: ", config.name(), "\n\n");
  absl::StrAppend(&md, "* Date: ",
                  absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::Now(),
                                   absl::UTCTimeZone()),
                  "\n", "* Command: `", o.command_line, "`\n", "* Config: `",
                  o.config_path, "` (", config.name(), ": K = ", blocks,
                  " blocks, batch ", t.batch_size(),
                  ", micro-batches per step M = ", t.microbatches(), ", seed ",
                  o.seed >= 0 ? static_cast<uint64_t>(o.seed) : t.seed(),
                  "; every mode sees the same data order)\n");
  const bool inprocess = o.train.engine.kind == EngineKind::kInProcess;
  absl::StrAppend(
      &md, "* Engine: ",
      inprocess ? (o.train.engine.schedule == Schedule::kSequential
                       ? "in-process, sequential schedule (one thread runs "
                         "every block in turn, so each operation is timed "
                         "without competition for the cores)"
                       : "in-process, threaded schedule (one thread per block)")
                : "cluster (one interlock-worker process per block)",
      "\n");
  absl::StrAppend(
      &md, "* Limit: ", LimitText(o, config), "\n",
      "* Evaluation on the test split: ", cadence, "\n",
      absl::StrFormat(
          "* Virtual clock: the measured operation times replayed as if every "
          "block had an accelerator of its own, messages costing %.0f us + "
          "bytes / %.3g B/s\n",
          o.train.link.latency_seconds * 1e6, o.train.link.bytes_per_second),
      "* Utilisation: busy / (K x elapsed) on the virtual clock\n\n");

  std::vector<std::string> header = {"mode",          "steps",
                                     "wall (s)",      "virtual (s)",
                                     "step wall (s)", "step virtual (s)",
                                     "utilisation",   "busy per block"};
  for (int k = 0; k < blocks; ++k) {
    header.push_back(absl::StrCat("block ", k, " ",
                                  k + 1 == blocks ? "final" : "aux", " ",
                                  text ? "perplexity" : "accuracy"));
  }
  absl::StrAppend(&md, "| ", absl::StrJoin(header, " | "), " |\n|");
  for (size_t i = 0; i < header.size(); ++i) {
    absl::StrAppend(&md, i == 0 ? "---|" : "---:|");
  }
  absl::StrAppend(&md, "\n");
  std::vector<std::string> failures;
  for (const ModeRun& r : runs) {
    std::vector<std::string> row = {r.mode.Label()};
    if (!r.result.ok()) {
      row.push_back(r.tried ? "failed" : "not run");
      row.resize(header.size(), "-");
      if (r.tried) {
        failures.push_back(absl::StrCat("* ", r.mode.Label(), ": ",
                                        r.result.status().message()));
      }
    } else {
      const TrainResult& res = *r.result;
      std::vector<std::string> busy;
      for (double b : res.busy_ratio) {
        busy.push_back(absl::StrFormat("%.0f%%", 100.0 * b));
      }
      row.push_back(absl::StrCat(res.steps));
      row.push_back(Seconds(res.wall_seconds));
      row.push_back(Seconds(res.virtual_seconds));
      row.push_back(absl::StrFormat("%.4g", res.mean_step_wall));
      row.push_back(absl::StrFormat("%.4g", res.mean_step_virtual));
      row.push_back(absl::StrFormat("%.1f%%", 100.0 * res.utilisation));
      row.push_back(absl::StrJoin(busy, " "));
      for (int k = 0; k < blocks; ++k) {
        std::string cell = "-";
        for (const HeadResult& h : res.eval) {
          if (h.block == k) cell = FormatMetric(h, text);
        }
        row.push_back(cell);
      }
    }
    absl::StrAppend(&md, "| ", absl::StrJoin(row, " | "), " |\n");
  }
  absl::StrAppend(&md,
                  "\nStep times are means after the first step. E2E has no "
                  "auxiliary heads (-).\n");
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
  for (const ModeRun& r : runs) dirs.push_back("`" + r.mode.Dir() + "/`");
  absl::StrAppend(&md, absl::StrJoin(dirs, ", "), ".\n");

  const std::string path = o.out_dir + "/report.md";
  RETURN_IF_ERROR(WriteFileChecked(path + ".tmp", md));
  std::error_code ec;
  std::filesystem::rename(path + ".tmp", path, ec);
  if (ec) return absl::DataLossError(absl::StrCat(path, ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace

int CompareMain(const CompareOptions& o) {
  std::ostream& log = *o.train.output.log;
  auto fail = [&log](absl::string_view message, int code) {
    log << "interlock: error: " << message << "\n";
    return code;
  };
  if (o.config_path.empty()) return fail("--config is required", 2);
  if (o.out_dir.empty()) return fail("--out is required", 2);
  if (o.modes.empty()) return fail("--modes is required (e.g. e2e,1,2)", 2);
  auto loaded = LoadRunConfig(o.config_path);
  if (!loaded.ok()) return fail(loaded.status().message(), 1);
  RunConfig config = *loaded;
  ApplyDefaults(config);
  if (auto st = ValidateRunConfig(config); !st.ok()) {
    return fail(st.message(), 1);
  }
  auto blocks = NumBlocks(config.model());
  if (!blocks.ok()) return fail(blocks.status().message(), 1);
  auto modes = ParseModes(o.modes, *blocks);
  if (!modes.ok()) return fail(modes.status().message(), 2);
  // One compare per folder: its runs' folders are locked by Train, the
  // report and plots by this.
  auto lock = FolderLock::Acquire(o.out_dir, "--out");
  if (!lock.ok()) return fail(lock.status().message(), 1);

  // Evaluation cadence: the config's, else about kEvalPoints per mode.
  std::vector<int64_t> every(modes->size(),
                             config.training().eval_every_steps());
  std::string cadence =
      absl::StrCat("every ", config.training().eval_every_steps(),
                   " steps (the config's eval_every_steps) and at the end");
  if (config.training().eval_every_steps() <= 0) {
    auto total = TotalSteps(ConfigFor(config, (*modes)[0], o, 0));
    if (!total.ok()) return fail(total.status().message(), 1);
    std::vector<int64_t> expected;
    if (HasBudget(o.train)) {
      expected = PredictSteps(config, *modes, o, *total, &cadence);
    } else {
      cadence = absl::StrCat("about ", kEvalPoints, " evaluations per mode");
    }
    for (size_t i = 0; i < modes->size(); ++i) {
      const int64_t steps = expected.empty() ? *total : expected[i];
      every[i] = std::max<int64_t>(1, steps / kEvalPoints);
    }
  }

  std::vector<ModeRun> runs;
  for (size_t i = 0; i < modes->size(); ++i) {
    ModeRun r;
    r.mode = (*modes)[i];
    r.dir = o.out_dir + "/" + r.mode.Dir();
    r.eval_every = every[i];
    runs.push_back(std::move(r));
  }
  bool failed = false;
  bool interrupted = false;
  for (size_t i = 0; i < runs.size(); ++i) {
    ModeRun& r = runs[i];
    const std::string label = absl::StrFormat("[%d/%d]", i + 1, runs.size());
    TrainOptions t = o.train;
    t.output.out_dir = r.dir;
    t.output.progress_label = label;
    log << label << " " << r.mode.Label() << " -> " << r.dir
        << " (evaluating every " << r.eval_every << " steps)\n";
    r.tried = true;
    r.result = Train(ConfigFor(config, r.mode, o, r.eval_every), t);
    if (o.interrupted != nullptr && o.interrupted->load()) {
      interrupted = true;
      break;
    }
    if (!r.result.ok()) {
      failed = true;
      log << label << " " << r.mode.Label()
          << " failed: " << r.result.status().message() << "\n";
      continue;
    }
    const HeadResult* h = FinalHead(r.result->eval);
    log << label << " " << r.mode.Label() << ": " << r.result->steps
        << " steps, " << Seconds(r.result->wall_seconds) << " s wall, "
        << Seconds(r.result->virtual_seconds) << " s virtual"
        << (h ? absl::StrCat("; final head ", FormatMetric(*h, IsText(runs)))
              : "")
        << "\n";
  }
  if (interrupted) return fail("interrupted", 130);

  auto script = WritePlotScript(o.out_dir, config, runs, *blocks, IsText(runs));
  const absl::Status plots =
      script.ok() ? DrawPlots(o.out_dir, *script) : script.status();
  const absl::Status report =
      WriteReport(o, config, *blocks, runs, cadence, plots);
  if (!report.ok()) return fail(report.message(), 1);
  log << "report: " << o.out_dir << "/report.md\n";
  if (!plots.ok()) return fail(absl::StrCat("plots: ", plots.message()), 1);
  if (failed) return fail("at least one mode failed (see report.md)", 1);
  return 0;
}

}  // namespace interlock
