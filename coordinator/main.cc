// interlock: the command-line front end, the commands train, compare,
// simulate, partition, export, eval, predict and generate
// (interlock-coordinator: train only). The flags
// are in cli_flags.cc; everything else is in the RunConfig file
// (configs/*.pbtxt).
#include <signal.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "analysis/simulate.h"
#include "coordinator/cli_flags.h"
#include "coordinator/compare.h"
#include "coordinator/export.h"
#include "coordinator/inference.h"
#include "coordinator/local_cluster.h"
#include "coordinator/partition.h"
#include "coordinator/step_budget.h"
#include "coordinator/train.h"
#include "coordinator/trained_model.h"
#include "plan/replica_routes.h"
#include "rpc/security.h"
#include "services/config.h"
#include "services/runtime.h"
#include "services/wire_codec.h"

namespace {

using interlock::v1::RunConfig;
using interlock::v1::TrainingSpec;

using interlock::cli::CheckNumericFlags;
using interlock::cli::Fail;
using interlock::cli::Given;
using interlock::cli::kUsage;

// The command line as typed, for reports.
std::string g_command_line;

// One line per head of an evaluation ("Test metrics"), as train and eval
// print them.
void PrintHeads(const std::vector<interlock::HeadResult>& heads) {
  for (const auto& h : heads) {
    std::string line = absl::StrFormat(
        "  block %d %-5s head: accuracy %6.2f%%  loss %.4f", h.block,
        h.final ? "final" : "aux", 100.0 * h.accuracy, h.loss);
    if (h.perplexity > 0)
      absl::StrAppendFormat(&line, "  perplexity %.3f", h.perplexity);
    std::cout << line << "\n";
  }
}

std::atomic<bool> g_interrupted{false};
// Set on the first signal when the run can checkpoint: it stops at the next
// step boundary after writing one. A second signal stops at once.
std::atomic<bool> g_stop_requested{false};
std::atomic<bool> g_can_checkpoint{false};
std::mutex g_cluster_mu;
interlock::LocalCluster* g_cluster = nullptr;

// Ctrl-C / SIGTERM: when the run can checkpoint, the first signal asks it to
// take a checkpoint at the next step boundary and stop. Otherwise (or on a
// second signal) stop the local cluster's workers (the run then ends with an
// error) or, in process, leave at once. Either way no worker is orphaned.
void WatchSignals(sigset_t signals) {
  std::thread([signals] {
    int sig = 0;
    sigwait(&signals, &sig);
    if (g_can_checkpoint) {
      g_stop_requested = true;
      std::cerr << "\ninterlock: signal " << sig
                << ": stopping after a checkpoint at the next step boundary "
                   "(again to stop at once)\n";
      sigwait(&signals, &sig);
    }
    g_interrupted = true;
    std::cerr << "\ninterlock: interrupted by signal " << sig << "\n";
    std::lock_guard<std::mutex> l(g_cluster_mu);
    if (g_cluster != nullptr) {
      g_cluster->Stop(absl::Seconds(3));
    } else {
      std::_Exit(130);
    }
  }).detach();
}

// The flags of every training command -> TrainOptions, and the local
// cluster made known to the signal watcher, which stops its workers.
int TrainOptionsForRun(interlock::TrainOptions& options) {
  if (int code = interlock::cli::TrainOptionsFromFlags(options); code != 0) {
    return code;
  }
  options.engine.on_cluster = [](interlock::LocalCluster* c) {
    std::lock_guard<std::mutex> l(g_cluster_mu);
    g_cluster = c;
  };
  return 0;
}

// `train --fit-schedule`: the run's steps become those its budget buys,
// so that its learning-rate schedule spans the budget; the run then runs
// them all. A run resumed from --out keeps the steps it was fitted to
// (its checkpoint holds them), so its rates do not change.
int FitScheduleToBudget(RunConfig& config, interlock::TrainOptions& options) {
  if (options.budget.wall <= absl::ZeroDuration() &&
      options.budget.virtual_time <= absl::ZeroDuration()) {
    return Fail("--fit-schedule needs --budget or --budget-virtual", 2);
  }
  int64_t steps = 0;
  if (!options.output.out_dir.empty() && options.checkpoints.dir.empty() &&
      options.checkpoints.resume.empty()) {
    interlock::RunSource source;
    source.run_dir = options.output.out_dir;
    auto resumed = interlock::FindRunCheckpoint(source);
    if (resumed.ok()) {
      steps = resumed->manifest.total_steps();
      *options.output.console << "interlock: --fit-schedule: " << steps
                              << " steps, as fitted when the run started ("
                              << resumed->dir << ")\n";
    }
  }
  if (steps == 0) {
    const std::string scratch =
        (options.output.out_dir.empty() ? std::string("/tmp")
                                        : options.output.out_dir) +
        "/calibration";
    *options.output.console << "interlock: calibrating "
                            << interlock::kCalibrationSteps
                            << " steps to fit the schedule to the budget\n";
    auto fitted = interlock::StepsInBudget(
        config, {{interlock::ModeOf(config), config.wire()}}, options,
        std::numeric_limits<int32_t>::max(), scratch);
    if (!fitted.ok()) {
      return Fail(absl::StrCat("--fit-schedule: ", fitted.status().message()));
    }
    steps = (*fitted)[0];
    *options.output.console << "interlock: --fit-schedule: the budget buys "
                            << steps
                            << " steps; the schedule spans them and the run "
                               "runs them all\n";
  }
  config.mutable_training()->set_steps(steps);
  options.budget.wall = options.budget.virtual_time = absl::ZeroDuration();
  return 0;
}

int RunTrain() {
  const std::string path = absl::GetFlag(FLAGS_config);
  if (path.empty()) return Fail("--config is required", 2);
  auto loaded = interlock::LoadRunConfig(path);
  if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
  RunConfig config = *loaded;
  if (int code = CheckNumericFlags(); code != 0) return code;
  auto* t = config.mutable_training();
  const std::string mode = absl::AsciiStrToLower(absl::GetFlag(FLAGS_mode));
  if (mode == "e2e") {
    t->set_mode(TrainingSpec::E2E);
  } else if (mode == "interlock") {
    t->set_mode(TrainingSpec::INTERLOCK);
  } else if (!mode.empty()) {
    return Fail(absl::StrCat("--mode: '", mode, "', expected e2e or interlock"),
                2);
  }
  if (Given(FLAGS_n)) {
    t->set_n(absl::GetFlag(FLAGS_n));
    if (mode.empty()) t->set_mode(TrainingSpec::INTERLOCK);
  }
  const std::string rule = absl::AsciiStrToLower(absl::GetFlag(FLAGS_rule));
  if (rule == "furthest") {
    t->set_rule(TrainingSpec::FURTHEST);
  } else if (rule == "sum") {
    t->set_rule(TrainingSpec::SUM);
  } else if (!rule.empty()) {
    return Fail(absl::StrCat("--rule: '", rule, "', expected furthest or sum"),
                2);
  }
  if (Given(FLAGS_steps)) t->set_steps(absl::GetFlag(FLAGS_steps));
  if (Given(FLAGS_epochs)) {
    t->set_epochs(absl::GetFlag(FLAGS_epochs));
    if (!Given(FLAGS_steps)) t->set_steps(0);
  }
  if (Given(FLAGS_seed)) t->set_seed(absl::GetFlag(FLAGS_seed));
  if (Given(FLAGS_threads_per_block)) {
    t->set_threads_per_block(absl::GetFlag(FLAGS_threads_per_block));
  }
  if (const std::string wire = absl::GetFlag(FLAGS_wire); !wire.empty()) {
    if (auto s = interlock::ParseWireName(wire, config.mutable_wire());
        !s.ok()) {
      return Fail(absl::StrCat("--wire: ", s.message()), 2);
    }
  }
  const std::string reduction =
      absl::AsciiStrToLower(absl::GetFlag(FLAGS_reduction));
  if (reduction == "ordered") {
    t->set_reduction(TrainingSpec::ORDERED);
  } else if (reduction == "ring") {
    t->set_reduction(TrainingSpec::RING);
  } else if (!reduction.empty()) {
    return Fail(absl::StrCat("--reduction: '", reduction,
                             "', expected ordered or ring"),
                2);
  }
  interlock::TrainOptions options;
  if (int code = TrainOptionsForRun(options); code != 0) return code;
  options.checkpoints.every = absl::GetFlag(FLAGS_checkpoint_every);
  if (options.checkpoints.every < 0) {
    return Fail(absl::StrCat("--checkpoint-every: ", options.checkpoints.every,
                             ", must be >= 0 (0: only on SIGTERM/SIGINT)"),
                2);
  }
  options.checkpoints.dir = absl::GetFlag(FLAGS_checkpoint_dir);
  options.checkpoints.keep = absl::GetFlag(FLAGS_keep_checkpoints);
  if (options.checkpoints.keep < 1) {
    return Fail(absl::StrCat("--keep-checkpoints: ", options.checkpoints.keep,
                             ", must be >= 1"),
                2);
  }
  options.checkpoints.resume = absl::GetFlag(FLAGS_resume);
  options.checkpoints.recover_timeout = absl::GetFlag(FLAGS_recover_timeout);
  if (options.checkpoints.recover_timeout < absl::ZeroDuration()) {
    return Fail("--recover-timeout: must not be negative", 2);
  }
  options.output.profile_ops = absl::GetFlag(FLAGS_profile_ops);
  if (!options.output.profile_ops.empty() &&
      (options.engine.kind != interlock::EngineKind::kInProcess ||
       options.engine.schedule != interlock::Schedule::kSequential)) {
    // The profiler sees the thread that starts it, and only the sequential
    // schedule runs every block on it.
    return Fail(
        "--profile-ops needs --engine inprocess and --schedule sequential", 2);
  }
  // Off unless asked for (compare fits by default).
  if (Given(FLAGS_fit_schedule) && absl::GetFlag(FLAGS_fit_schedule)) {
    if (int code = FitScheduleToBudget(config, options); code != 0) {
      return code;
    }
  }
  options.checkpoints.stop_requested = &g_stop_requested;
  g_can_checkpoint =
      !options.output.out_dir.empty() || !options.checkpoints.dir.empty();

  auto result = interlock::Train(config, options);
  if (g_interrupted) return Fail("interrupted", 130);
  if (g_stop_requested && !result.ok() &&
      result.status().code() == absl::StatusCode::kCancelled) {
    return Fail(std::string(result.status().message()), 130);
  }
  if (!result.ok()) return Fail(std::string(result.status().message()));
  std::cout << absl::StrFormat(
      "Test metrics after %d steps (%.1f s training; %.1f s on the virtual "
      "clock, utilisation %.0f%%):\n",
      result->steps, result->wall_seconds, result->virtual_seconds,
      100.0 * result->utilisation);
  PrintHeads(result->eval);
  std::cout << "digest " << result->digest << "\n";
  if (options.output.dump_params) std::cout << result->params_json;
  return 0;
}

#ifndef INTERLOCK_COORDINATOR_BINARY
// `interlock compare`: every mode of --modes on the same config and seed.
int RunCompare() {
  if (!absl::GetFlag(FLAGS_mode).empty() || absl::GetFlag(FLAGS_n) != 0 ||
      !absl::GetFlag(FLAGS_rule).empty()) {
    return Fail("compare: choose the modes with --modes, not --mode/--n/--rule",
                2);
  }
  if (Given(FLAGS_n)) {
    return Fail("compare: choose the modes with --modes, not --n", 2);
  }
  if (Given(FLAGS_profile_ops)) {
    return Fail("compare: --profile-ops profiles one run; use train", 2);
  }
  if (int code = CheckNumericFlags(); code != 0) return code;
  interlock::CompareOptions o;
  o.config_path = absl::GetFlag(FLAGS_config);
  o.modes = absl::GetFlag(FLAGS_modes);
  o.wire = absl::GetFlag(FLAGS_wire);
  o.out_dir = absl::GetFlag(FLAGS_out);
  o.steps = absl::GetFlag(FLAGS_steps);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.seeds = absl::GetFlag(FLAGS_seeds);
  if (Given(FLAGS_seeds) && o.seeds.empty()) {
    return Fail("--seeds: empty; give seeds such as 1,2,3", 2);
  }
  o.threads_per_block = absl::GetFlag(FLAGS_threads_per_block);
  o.fit_schedule = absl::GetFlag(FLAGS_fit_schedule);
  o.command_line = g_command_line;
  o.interrupted = &g_interrupted;
  if (int code = TrainOptionsForRun(o.train); code != 0) return code;
  return interlock::CompareMain(o);
}

// `interlock simulate`: predictions for every mode from a run's profile.
int RunSimulate() {
  interlock::SimulateOptions o;
  o.profile = absl::GetFlag(FLAGS_profile);
  o.blocks = absl::GetFlag(FLAGS_blocks);
  o.microbatches = absl::GetFlag(FLAGS_microbatches);
  if (o.blocks < 0 || o.microbatches < 0) {
    return Fail(
        absl::StrCat("--blocks ", o.blocks, " and --microbatches ",
                     o.microbatches, ": must be >= 0 (0: the profile's)"),
        2);
  }
  o.sweep = absl::GetFlag(FLAGS_sweep);
  const std::string rule = absl::AsciiStrToLower(absl::GetFlag(FLAGS_rule));
  if (!rule.empty() && rule != "furthest" && rule != "sum") {
    return Fail(absl::StrCat("--rule: '", rule, "', expected furthest or sum"),
                2);
  }
  o.sum_rule = rule == "sum";
  const std::string mode = absl::AsciiStrToLower(absl::GetFlag(FLAGS_mode));
  const int n = absl::GetFlag(FLAGS_n);
  if (mode == "e2e") {
    if (n != 0) return Fail("--n: give a width or e2e, not both", 2);
    o.has_mode = true;
    o.mode.e2e = true;
  } else if (!mode.empty() && mode != "interlock") {
    return Fail(absl::StrCat("--mode: '", mode, "', expected e2e or interlock"),
                2);
  } else if (n != 0 || Given(FLAGS_n)) {
    if (n < 1)
      return Fail(absl::StrCat("--n: ", n, ", must be >= 1 or e2e"), 2);
    o.has_mode = true;
    o.mode.n = n;
    o.mode.sum = o.sum_rule;
  }
  if (Given(FLAGS_link_bandwidth)) {
    o.bandwidth = absl::GetFlag(FLAGS_link_bandwidth);
    if (!(std::isfinite(o.bandwidth) && o.bandwidth > 0)) {
      return Fail(absl::StrCat("--link-bandwidth: ", o.bandwidth,
                               ", must be a finite number > 0"),
                  2);
    }
  }
  if (Given(FLAGS_link_latency)) {
    o.latency = absl::ToDoubleSeconds(absl::GetFlag(FLAGS_link_latency));
    if (!(std::isfinite(o.latency) && o.latency >= 0)) {
      return Fail("--link-latency: must be a finite time >= 0", 2);
    }
  }
  if (const std::string replicas = absl::GetFlag(FLAGS_replicas);
      !replicas.empty() || Given(FLAGS_replicas)) {
    auto counts = interlock::ParseReplicas(replicas);
    if (!counts.ok()) return Fail(std::string(counts.status().message()), 2);
    o.replicas = *std::move(counts);
  }
  o.reduction = absl::AsciiStrToLower(absl::GetFlag(FLAGS_reduction));
  o.partition = absl::GetFlag(FLAGS_partition);
  return interlock::SimulateMain(o, std::cout, std::cerr);
}

// `interlock partition`: the balanced cut into --blocks blocks.
int RunPartition() {
  interlock::PartitionCommand c;
  c.config_path = absl::GetFlag(FLAGS_config);
  c.blocks = absl::GetFlag(FLAGS_blocks);
  if (!Given(FLAGS_blocks)) {
    return Fail("partition: --blocks is required (K, the blocks to cut into)",
                2);
  }
  c.profile = absl::GetFlag(FLAGS_profile);
  c.out_dir = absl::GetFlag(FLAGS_out);
  c.link.latency_seconds =
      absl::ToDoubleSeconds(absl::GetFlag(FLAGS_link_latency));
  c.link.bytes_per_second = absl::GetFlag(FLAGS_link_bandwidth);
  if (!(std::isfinite(c.link.latency_seconds) && c.link.latency_seconds >= 0) ||
      !(std::isfinite(c.link.bytes_per_second) &&
        c.link.bytes_per_second > 0)) {
    return Fail(
        "--link-latency and --link-bandwidth: must be finite, the latency "
        ">= 0 and the bandwidth > 0",
        2);
  }
  return interlock::PartitionMain(c, interlock::UnitsByTraining(), std::cout,
                                  std::cerr);
}

// The trained state a command reads: --run or --checkpoint, and the
// run's token when its checkpoints are signed. False (with the exit code
// in `code`) on bad flags.
bool SourceFromFlags(const char* command, interlock::RunSource* s, int* code) {
  s->run_dir = absl::GetFlag(FLAGS_run);
  s->checkpoint = absl::GetFlag(FLAGS_checkpoint);
  if (s->run_dir.empty() == s->checkpoint.empty()) {
    *code = Fail(
        absl::StrCat(command, ": give one of --run OUT or --checkpoint DIR"),
        2);
    return false;
  }
  if (const std::string file = absl::GetFlag(FLAGS_token_file); !file.empty()) {
    auto token = interlock::LoadBearerToken("token-file", file);
    if (!token.ok()) {
      *code = Fail(std::string(token.status().message()), 2);
      return false;
    }
    s->seal_key = *std::move(token);
  }
  return true;
}

// `interlock export`: a run's trained network out (coordinator/export.h).
int RunExport() {
  interlock::RunSource s;
  int code = 0;
  if (!SourceFromFlags("export", &s, &code)) return code;
  interlock::ExportOptions o;
  o.run_dir = s.run_dir;
  o.checkpoint = s.checkpoint;
  o.seal_key = s.seal_key;
  o.to = absl::GetFlag(FLAGS_to);
  if (o.to.empty()) return Fail("export: give --to DIR", 2);
  if (auto st = interlock::ExportRun(o, std::cout); !st.ok()) {
    return Fail(std::string(st.message()), 1);
  }
  return 0;
}

// `interlock eval`: every exit on the test split, as the run evaluates.
int RunEval() {
  interlock::EvalOptions o;
  int code = 0;
  if (!SourceFromFlags("eval", &o.source, &code)) return code;
  o.data_config = absl::GetFlag(FLAGS_config);
  auto r = interlock::EvaluateRun(o);
  if (!r.ok()) return Fail(std::string(r.status().message()), 1);
  std::cout << absl::StrFormat("Test metrics of step %d (%d samples):\n",
                               r->step, r->samples);
  PrintHeads(r->heads);
  return 0;
}

// `interlock predict`: labels of test samples through an exit.
int RunPredict() {
  interlock::PredictOptions o;
  int code = 0;
  if (!SourceFromFlags("predict", &o.source, &code)) return code;
  o.data_config = absl::GetFlag(FLAGS_config);
  o.exit_block = absl::GetFlag(FLAGS_exit);
  o.first = absl::GetFlag(FLAGS_first);
  o.count = absl::GetFlag(FLAGS_count);
  o.input = absl::GetFlag(FLAGS_input);
  auto r = interlock::Predict(o);
  if (!r.ok()) return Fail(std::string(r.status().message()), 1);
  for (const auto& p : *r) {
    const std::string label =
        p.label_name.empty() ? absl::StrCat(p.label)
                             : absl::StrFormat("%d \"%s\"", p.label,
                                               absl::CEscape(p.label_name));
    if (p.name.empty()) {
      std::cout << absl::StrFormat("sample %d: class %s (p %.3f), target %d\n",
                                   p.index, label, p.probability, p.target);
    } else {
      std::cout << absl::StrFormat("%s: class %s (p %.3f)\n", p.name, label,
                                   p.probability);
    }
  }
  return 0;
}

// `interlock generate`: text from a language model through an exit.
int RunGenerate() {
  interlock::GenerateOptions o;
  int code = 0;
  if (!SourceFromFlags("generate", &o.source, &code)) return code;
  o.prompt = absl::GetFlag(FLAGS_prompt);
  for (absl::string_view id :
       absl::StrSplit(absl::GetFlag(FLAGS_prompt_ids), absl::ByAnyChar(" ,"),
                      absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(id, &v)) {
      return Fail(absl::StrCat("--prompt-ids: '", id, "' is not a number"), 2);
    }
    o.prompt_ids.push_back(v);
  }
  o.exit_block = absl::GetFlag(FLAGS_exit);
  o.tokens = absl::GetFlag(FLAGS_tokens);
  o.temperature = absl::GetFlag(FLAGS_temperature);
  o.top_k = absl::GetFlag(FLAGS_top_k);
  o.seed = static_cast<uint64_t>(absl::GetFlag(FLAGS_seed));
  auto r = interlock::Generate(o);
  if (!r.ok()) return Fail(std::string(r.status().message()), 1);
  std::cout << *r << "\n";
  return 0;
}
#endif  // INTERLOCK_COORDINATOR_BINARY

}  // namespace

int main(int argc, char** argv) {
  interlock::TuneAllocator();
  const interlock::cli::CommandLine parsed =
      interlock::cli::ParseFlags(argc, argv);
  g_command_line = parsed.typed;
  const std::vector<std::string>& args = parsed.args;
  // Signals are taken by one watcher thread; block them before any other
  // thread exists so none of those receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  WatchSignals(signals);
#ifdef INTERLOCK_COORDINATOR_BINARY
  if (args.size() > 1) {
    return Fail(absl::StrCat("unexpected argument '", args[1], "'"), 2);
  }
  return RunTrain();
#else
  if (args.size() < 2) return Fail(absl::StrCat("usage: ", kUsage), 2);
  const std::string command = args[1];
  if (args.size() > 2) {
    return Fail(absl::StrCat("unexpected argument '", args[2], "'"), 2);
  }
  if (command == "train") return RunTrain();
  if (command == "compare") return RunCompare();
  if (command == "simulate") return RunSimulate();
  if (command == "partition") return RunPartition();
  if (command == "export") return RunExport();
  if (command == "eval") return RunEval();
  if (command == "predict") return RunPredict();
  if (command == "generate") return RunGenerate();
#endif
#ifndef INTERLOCK_COORDINATOR_BINARY
  return Fail(absl::StrCat("unknown command '", command, "'; usage: ", kUsage),
              2);
#endif
}
