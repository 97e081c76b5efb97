#include "coordinator/compare.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "analysis/checked_write.h"
#include "analysis/compare_report.h"
#include "analysis/simulate.h"
#include "coordinator/partition.h"
#include "coordinator/step_budget.h"
#include "plan/status_macros.h"
#include "services/config.h"
#include "services/data.h"
#include "services/models.h"
#include "services/wire_codec.h"

namespace interlock {
namespace {

using interlock::v1::RunConfig;
using interlock::v1::TrainingSpec;

// Evaluations per mode when the config sets no cadence.
constexpr int64_t kEvalPoints = 10;
// One run of the comparison: a mode with the wire codecs it uses.
struct Variant {
  ModeSpec mode;
  v1::WireSpec wire;
  std::string wire_name;  // as --wire named it; empty without --wire
  int64_t seed = -1;      // from --seeds; -1 without
};

RunConfig ConfigFor(const RunConfig& base, const Variant& v,
                    const CompareOptions& o, int64_t eval_every) {
  RunConfig c = base;
  *c.mutable_wire() = v.wire;
  ApplyDefaults(c);  // the codecs' canonical form
  const ModeSpec& mode = v.mode;
  auto* t = c.mutable_training();
  t->set_mode(mode.e2e ? TrainingSpec::E2E : TrainingSpec::INTERLOCK);
  if (!mode.e2e) {
    t->set_n(mode.n);
    t->set_rule(mode.sum ? TrainingSpec::SUM : TrainingSpec::FURTHEST);
  }
  if (o.steps >= 0) t->set_steps(o.steps);
  if (v.seed >= 0) {
    t->set_seed(v.seed);
  } else if (o.seed >= 0) {
    t->set_seed(o.seed);
  }
  if (o.threads_per_block > 0) t->set_threads_per_block(o.threads_per_block);
  t->set_eval_every_steps(eval_every);
  return c;
}

// Steps a run of the config asks for (epochs need the training set's size).
absl::StatusOr<int64_t> TotalSteps(const RunConfig& c) {
  const auto& t = c.training();
  if (t.steps() > 0) return t.steps();
  ASSIGN_OR_RETURN(DataSplits data, LoadData(c.data(), TextContext(c.model())));
  return std::max<int64_t>(
      1, t.epochs() * (data.train->size() / std::max(1, t.batch_size())));
}

bool HasBudget(const TrainOptions& t) {
  return t.budget.wall > absl::ZeroDuration() ||
         t.budget.virtual_time > absl::ZeroDuration();
}

// Predicts how many steps each run does within the budgets (at most
// `total`). Empty when the calibration fails; `note` says what was done.
std::vector<int64_t> PredictSteps(const RunConfig& config,
                                  const std::vector<Variant>& runs,
                                  const CompareOptions& o, int64_t total,
                                  std::string* note) {
  const bool fitting = total == std::numeric_limits<int32_t>::max();
  *o.train.output.console << "calibrating: " << kCalibrationSteps
                          << " steps of " << runs[0].mode.Label()
                          << " to predict every mode's steps "
                          << (fitting ? "within the budget (--fit-schedule)"
                                      : "for the evaluation cadence")
                          << "\n";
  std::vector<BudgetRun> budget_runs;
  for (const Variant& v : runs) budget_runs.push_back({v.mode, v.wire});
  auto steps = StepsInBudget(ConfigFor(config, runs[0], o, 0), budget_runs,
                             o.train, total, o.out_dir + "/calibration");
  if (!steps.ok()) {
    *note = absl::StrCat(steps.status().message(),
                         ", so every mode evaluates every ",
                         std::max<int64_t>(1, total / kEvalPoints), " steps");
    return {};
  }
  *note = absl::StrCat(
      "about ", kEvalPoints,
      " evaluations per mode, at a cadence set from each mode's step count "
      "predicted by `interlock simulate` on a ",
      kCalibrationSteps, "-step calibration run of ", runs[0].mode.Label());
  return *std::move(steps);
}

std::string Seconds(double s) { return absl::StrFormat("%.2f", s); }

std::string EngineText(const TrainOptions& t) {
  if (t.engine.kind != EngineKind::kInProcess) {
    return "cluster (one interlock-worker process per block)";
  }
  return t.engine.schedule == Schedule::kSequential
             ? "in-process, sequential schedule (one thread runs every block "
               "in turn, so each operation is timed without competition for "
               "the cores)"
             : "in-process, threaded schedule (one thread per block)";
}

std::string LimitText(const CompareOptions& o, const RunConfig& config,
                      const std::vector<Variant>& variants,
                      const std::vector<int64_t>& fitted) {
  if (!fitted.empty()) {
    std::vector<std::string> steps;
    for (size_t i = 0; i < variants.size(); ++i) {
      steps.push_back(absl::StrCat(variants[i].mode.Label(),
                                   variants[i].wire_name.empty() ? "" : "/",
                                   variants[i].wire_name, " ", fitted[i]));
    }
    std::vector<std::string> budgets;
    if (o.train.budget.virtual_time > absl::ZeroDuration()) {
      budgets.push_back(absl::StrCat(
          "virtual time ", absl::FormatDuration(o.train.budget.virtual_time)));
    }
    if (o.train.budget.wall > absl::ZeroDuration()) {
      budgets.push_back(absl::StrCat(
          "wall time ", absl::FormatDuration(o.train.budget.wall)));
    }
    return absl::StrCat(
        "the steps a budget of ", absl::StrJoin(budgets, " and "),
        " buys each mode, predicted from a calibration run; each mode's "
        "learning-rate schedule spans its own steps and it runs all of them "
        "(--fit-schedule): ",
        absl::StrJoin(steps, ", "));
  }
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

// The steps fitted to the budget when a comparison in `dir` started, one
// "LABEL STEPS" line per run (empty when none were written or the runs
// differ): an interrupted comparison resumes with them, so that its
// schedules do not change.
constexpr char kFittedFile[] = "fitted_steps.txt";

std::vector<int64_t> ReadFitted(const std::string& dir,
                                const std::vector<ModeReport>& runs) {
  std::ifstream in(dir + "/" + kFittedFile);
  std::map<std::string, int64_t> by_label;
  std::string line;
  while (std::getline(in, line)) {
    const size_t space = line.rfind(' ');
    int64_t steps = 0;
    if (space == std::string::npos ||
        !absl::SimpleAtoi(line.substr(space + 1), &steps) || steps < 1) {
      return {};
    }
    by_label[line.substr(0, space)] = steps;
  }
  std::vector<int64_t> out;
  for (const ModeReport& r : runs) {
    auto it = by_label.find(r.Label());
    if (it == by_label.end()) return {};
    out.push_back(it->second);
  }
  return by_label.size() == runs.size() ? out : std::vector<int64_t>();
}

absl::Status WriteFitted(const std::string& dir,
                         const std::vector<ModeReport>& runs,
                         const std::vector<int64_t>& steps) {
  std::string text;
  for (size_t i = 0; i < runs.size(); ++i) {
    absl::StrAppend(&text, runs[i].Label(), " ", steps[i], "\n");
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  return WriteFileReplacing(dir + "/" + kFittedFile, text);
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> ParseSeeds(absl::string_view list) {
  std::vector<int64_t> out;
  for (absl::string_view entry : absl::StrSplit(list, ',')) {
    int64_t seed = 0;
    if (!absl::SimpleAtoi(entry, &seed) || seed < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--seeds: '", entry, "' in '", list,
                       "' is not a seed (an integer >= 0), e.g. 1,2,3"));
    }
    if (std::find(out.begin(), out.end(), seed) != out.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--seeds: ", seed, " is listed twice"));
    }
    out.push_back(seed);
  }
  return out;
}

int CompareMain(const CompareOptions& o) {
  std::ostream& log = *o.train.output.console;
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
  // Every mode with each codec pair of --wire (mode-major, so a mode's
  // variants sit together in the table), or with the config's.
  std::vector<Variant> variants;
  std::vector<std::string> wire_names;
  if (!o.wire.empty()) {
    wire_names = absl::StrSplit(o.wire, ',');
  }
  std::vector<v1::WireSpec> wires;
  for (const std::string& name : wire_names) {
    v1::WireSpec w = config.wire();
    if (auto st = ParseWireName(name, &w); !st.ok()) {
      return fail(absl::StrCat("--wire: ", st.message()), 2);
    }
    for (const v1::WireSpec& seen : wires) {
      if (WireName(seen) == WireName(w)) {
        return fail(absl::StrCat("--wire: ", name, " is listed twice"), 2);
      }
    }
    wires.push_back(w);
  }
  std::vector<int64_t> seed_list;
  if (!o.seeds.empty()) {
    if (o.seed >= 0)
      return fail("--seeds: give --seed or --seeds, not both", 2);
    auto parsed = ParseSeeds(o.seeds);
    if (!parsed.ok()) return fail(parsed.status().message(), 2);
    seed_list = *std::move(parsed);
  }
  // Each of those once per seed of --seeds, the seeds of a variant together
  // (the report's order; the runs go seed by seed, below).
  const std::vector<int64_t> seeds =
      seed_list.empty() ? std::vector<int64_t>{-1} : seed_list;
  for (const ModeSpec& mode : *modes) {
    for (int64_t seed : seeds) {
      if (wires.empty()) variants.push_back({mode, config.wire(), "", seed});
    }
    for (size_t i = 0; i < wires.size(); ++i) {
      for (int64_t seed : seeds) {
        variants.push_back({mode, wires[i], WireName(wires[i]), seed});
      }
    }
  }
  // One compare per folder: its runs' folders are locked by Train, the
  // report and plots by this.
  auto lock = FolderLock::Acquire(o.out_dir, "--out");
  if (!lock.ok()) return fail(lock.status().message(), 1);
  // A balanced cut is chosen once, so that every mode trains the same blocks.
  const bool auto_partition = config.model().partition() == kAutoPartition;
  if (auto st =
          ResolveAutoPartition(config, o.out_dir + "/units", UnitsByTraining());
      !st.ok()) {
    return fail(st.message(), 1);
  }

  // Evaluation cadence: the config's, else about kEvalPoints per run.
  std::vector<int64_t> every(variants.size(),
                             config.training().eval_every_steps());
  std::string cadence =
      absl::StrCat("every ", config.training().eval_every_steps(),
                   " steps (the config's eval_every_steps) and at the end");
  std::vector<ModeReport> runs;
  for (const Variant& v : variants) {
    ModeReport r;
    r.mode = v.mode;
    r.wire = v.wire_name;
    r.seed = v.seed;
    r.dir = o.out_dir + "/" + r.Dir();
    runs.push_back(std::move(r));
  }
  // Budget-fitted schedules: the steps each mode's budget buys, with no
  // cap from the config's steps or epochs.
  // A comparison resumed on its --out keeps the steps fitted when it
  // started (its runs' checkpoints and schedules are made for them).
  std::vector<int64_t> fitted;
  if (o.fit_schedule && HasBudget(o.train)) {
    if (!o.train.output.replace) fitted = ReadFitted(o.out_dir, runs);
    if (!fitted.empty()) {
      log << "interlock: the steps fitted when this comparison started ("
          << o.out_dir << "/" << kFittedFile << ")\n";
    } else {
      std::string note;
      fitted = PredictSteps(config, variants, o,
                            std::numeric_limits<int32_t>::max(), &note);
      if (fitted.empty()) {
        log << "interlock: warning: " << note
            << "; every mode runs the config's schedule and stops at the "
               "budget\n";
      } else if (auto st = WriteFitted(o.out_dir, runs, fitted); !st.ok()) {
        return fail(st.message(), 1);
      }
    }
  }
  if (config.training().eval_every_steps() <= 0) {
    auto total = TotalSteps(ConfigFor(config, variants[0], o, 0));
    if (!total.ok()) return fail(total.status().message(), 1);
    std::vector<int64_t> expected = fitted;
    if (!expected.empty()) {
      cadence = absl::StrCat("about ", kEvalPoints,
                             " evaluations per mode over its fitted steps");
    } else if (HasBudget(o.train)) {
      expected = PredictSteps(config, variants, o, *total, &cadence);
    } else {
      cadence = absl::StrCat("about ", kEvalPoints, " evaluations per mode");
    }
    for (size_t i = 0; i < variants.size(); ++i) {
      const int64_t steps = expected.empty() ? *total : expected[i];
      every[i] = std::max<int64_t>(1, steps / kEvalPoints);
    }
  }

  // Runs go seed by seed (every variant of the first seed, then the next),
  // so that a machine whose speed drifts during a long compare does not
  // measure all of one mode's steps in one stretch and another's in the
  // next. The report keeps the variants' order.
  std::vector<size_t> order;
  for (int64_t seed : seeds) {
    for (size_t i = 0; i < variants.size(); ++i) {
      if (variants[i].seed == seed) order.push_back(i);
    }
  }
  bool failed = false;
  bool interrupted = false;
  for (size_t n = 0; n < order.size(); ++n) {
    const size_t i = order[n];
    ModeReport& r = runs[i];
    const std::string label = absl::StrFormat("[%d/%d]", n + 1, runs.size());
    TrainOptions t = o.train;
    t.output.out_dir = r.dir;
    t.output.progress_label = label;
    RunConfig c = ConfigFor(config, variants[i], o, every[i]);
    if (!fitted.empty()) {
      // The schedule spans the fitted steps and the run ends there: the
      // budget was spent choosing them.
      c.mutable_training()->set_steps(fitted[i]);
      t.budget.wall = t.budget.virtual_time = absl::ZeroDuration();
    }
    log << label << " " << r.Label() << " -> " << r.dir << " (evaluating every "
        << every[i] << " steps"
        << (fitted.empty() ? std::string()
                           : absl::StrCat(", ", fitted[i],
                                          " steps fitted to "
                                          "the budget"))
        << ")\n";
    r.tried = true;
    // A run an earlier, interrupted compare finished is read, not run
    // again (--replace runs it again); one it left with a checkpoint
    // resumes from it (Train does).
    if (!o.train.output.replace &&
        std::filesystem::exists(r.dir + "/summary.json")) {
      r.status = ReadModeFiles(r);
      if (r.status.ok() &&
          (r.summary.mode() != r.mode.Label() ||
           (!fitted.empty() && r.summary.steps() != fitted[i]))) {
        r.status = absl::FailedPreconditionError(absl::StrCat(
            r.dir, " holds another run (", r.summary.mode(), ", ",
            r.summary.steps(), " steps); give another --out or --replace"));
      }
      if (!r.status.ok()) {
        failed = true;
        log << label << " " << r.Label() << " failed: " << r.status.message()
            << "\n";
      } else {
        log << label << " " << r.Label() << ": done before, read from " << r.dir
            << "\n";
      }
      continue;
    }
    // The report is made from the files the run wrote.
    auto result = Train(c, t);
    r.status = result.ok() ? ReadModeFiles(r) : result.status();
    if (o.interrupted != nullptr && o.interrupted->load()) {
      interrupted = true;
      break;
    }
    if (!r.status.ok()) {
      failed = true;
      log << label << " " << r.Label() << " failed: " << r.status.message()
          << "\n";
      continue;
    }
    const v1::HeadMetrics* h = FinalHead(r.summary);
    log << label << " " << r.Label() << ": " << result->steps << " steps, "
        << Seconds(result->wall_seconds) << " s wall, "
        << Seconds(result->virtual_seconds) << " s virtual"
        << (h ? absl::StrCat("; final head ", FormatMetric(*h, IsText(runs)))
              : "")
        << "\n";
  }
  if (interrupted) return fail("interrupted", 130);

  const absl::Status plots =
      WritePlots(o.out_dir, config.name(), runs, *blocks);
  ReportHeader header;
  header.command_line = o.command_line;
  header.config_path = o.config_path;
  header.name = config.name();
  header.blocks = *blocks;
  header.batch_size = config.training().batch_size();
  header.microbatches = config.training().microbatches();
  header.seed =
      o.seed >= 0 ? static_cast<uint64_t>(o.seed) : config.training().seed();
  header.seeds = seed_list;
  header.engine = EngineText(o.train);
  if (!config.model().partition().empty()) {
    header.partition = absl::StrCat(
        "\"", config.model().partition(), "\"",
        auto_partition ? " (\"auto\": balanced on the unit costs in units/)"
                       : "");
  }
  header.wire =
      wires.empty()
          ? absl::StrCat(WireName(config.wire()), " (the config's)")
          : absl::StrCat(
                absl::StrJoin(wire_names, ", "),
                " (--wire: every mode with each; a:b is activations a, "
                "gradients b), rows named mode/codecs");
  header.limit = LimitText(o, config, variants, fitted);
  header.cadence = cadence;
  header.link = o.train.link;
  const absl::Status report = WriteReport(o.out_dir, header, runs, plots);
  if (!report.ok()) return fail(report.message(), 1);
  log << "report: " << o.out_dir << "/report.md\n";
  if (!plots.ok()) return fail(absl::StrCat("plots: ", plots.message()), 1);
  if (failed) return fail("at least one mode failed (see report.md)", 1);
  return 0;
}

}  // namespace interlock
