// interlock: the command-line front end. Flags only here; everything else is
// in the RunConfig file (configs/*.pbtxt).
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/train.h"
#include "services/config.h"

ABSL_FLAG(std::string, config, "", "RunConfig file (protobuf text format)");
ABSL_FLAG(std::string, mode, "", "e2e or interlock (overrides the config)");
ABSL_FLAG(int, n, 0, "interlocking width n (1 = local learning, K = E2E)");
ABSL_FLAG(std::string, rule, "", "furthest or sum");
ABSL_FLAG(int64_t, steps, -1, "optimizer steps to run (overrides epochs)");
ABSL_FLAG(int, epochs, -1, "epochs to run when steps is not set");
ABSL_FLAG(int64_t, seed, -1, "seed of initialisation and data order");
ABSL_FLAG(int, threads_per_block, 0, "LibTorch intra-op threads per block");
ABSL_FLAG(std::string, schedule, "sequential",
          "in-process schedule: sequential (one thread) or threaded (one "
          "thread per block)");
ABSL_FLAG(std::string, out, "", "folder for metrics.jsonl, eval.jsonl and "
                                "summary.json");
ABSL_FLAG(bool, dump_params, false, "print every parameter as JSON at the end");
ABSL_FLAG(bool, quiet, false, "no progress output");

namespace {

using interlock::v1::RunConfig;
using interlock::v1::TrainingSpec;

constexpr char kUsage[] =
    "interlock train --config FILE [--mode e2e|interlock] [--n N] "
    "[--rule furthest|sum] [--steps N] [--epochs N] [--seed S] "
    "[--threads-per-block T] [--schedule sequential|threaded] [--out DIR] "
    "[--dump-params]";

int Fail(const std::string& message, int code = 1) {
  std::cerr << "interlock: error: " << message << "\n";
  return code;
}

int RunTrain() {
  const std::string path = absl::GetFlag(FLAGS_config);
  if (path.empty()) return Fail("--config is required", 2);
  auto loaded = interlock::LoadRunConfig(path);
  if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
  RunConfig config = *loaded;
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
  if (absl::GetFlag(FLAGS_n) != 0) {
    if (absl::GetFlag(FLAGS_n) < 0) return Fail("--n: must be >= 1", 2);
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
  if (absl::GetFlag(FLAGS_steps) >= 0) t->set_steps(absl::GetFlag(FLAGS_steps));
  if (absl::GetFlag(FLAGS_epochs) >= 0) {
    t->set_epochs(absl::GetFlag(FLAGS_epochs));
    if (absl::GetFlag(FLAGS_steps) < 0) t->set_steps(0);
  }
  if (absl::GetFlag(FLAGS_seed) >= 0) t->set_seed(absl::GetFlag(FLAGS_seed));
  if (absl::GetFlag(FLAGS_threads_per_block) > 0) {
    t->set_threads_per_block(absl::GetFlag(FLAGS_threads_per_block));
  }
  interlock::TrainOptions options;
  const std::string schedule = absl::GetFlag(FLAGS_schedule);
  if (schedule == "sequential") {
    options.schedule = interlock::Schedule::kSequential;
  } else if (schedule == "threaded") {
    options.schedule = interlock::Schedule::kThreaded;
  } else {
    return Fail(absl::StrCat("--schedule: '", schedule,
                             "', expected sequential or threaded"),
                2);
  }
  options.out_dir = absl::GetFlag(FLAGS_out);
  options.dump_params = absl::GetFlag(FLAGS_dump_params);
  options.quiet = absl::GetFlag(FLAGS_quiet);
  options.progress_bar = isatty(STDERR_FILENO) != 0;

  auto result = interlock::Train(config, options);
  if (!result.ok()) return Fail(std::string(result.status().message()));
  std::cout << absl::StrFormat("Test metrics after %d steps (%.1f s):\n",
                               result->steps, result->wall_seconds);
  for (const auto& h : result->eval) {
    std::string line = absl::StrFormat(
        "  block %d %-5s head: accuracy %6.2f%%  loss %.4f", h.block,
        h.final ? "final" : "aux", 100.0 * h.accuracy, h.loss);
    if (h.perplexity > 0) absl::StrAppendFormat(&line, "  perplexity %.3f", h.perplexity);
    std::cout << line << "\n";
  }
  std::cout << "digest " << result->digest << "\n";
  if (options.dump_params) std::cout << result->params_json;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  // Accept --dump-params as well as --dump_params: hyphens are the usual CLI
  // spelling, Abseil flag names use underscores.
  std::vector<std::string> storage(argv, argv + argc);
  std::vector<char*> argv2;
  for (auto& a : storage) {
    if (a.rfind("--", 0) == 0) {
      for (size_t i = 2; i < a.size() && a[i] != '='; ++i) {
        if (a[i] == '-') a[i] = '_';
      }
    }
    argv2.push_back(a.data());
  }
  std::vector<char*> args =
      absl::ParseCommandLine(static_cast<int>(argv2.size()), argv2.data());
  if (args.size() < 2) return Fail(absl::StrCat("usage: ", kUsage), 2);
  const std::string command = args[1];
  if (args.size() > 2) {
    return Fail(absl::StrCat("unexpected argument '", args[2], "'"), 2);
  }
  if (command == "train") return RunTrain();
  return Fail(absl::StrCat("unknown command '", command, "'; usage: ", kUsage),
              2);
}
