// The flags of the `interlock` CLI and of interlock-coordinator (defined in
// cli_flags.cc, which both executables compile: --help lists that file's
// flags), parsing the command line, and the flags every training command
// shares turned into TrainOptions. main.cc runs the commands.
#ifndef INTERLOCK_COORDINATOR_CLI_FLAGS_H_
#define INTERLOCK_COORDINATOR_CLI_FLAGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "coordinator/train_options.h"

// The flags the commands in main.cc read themselves.
ABSL_DECLARE_FLAG(std::string, config);
ABSL_DECLARE_FLAG(std::string, mode);
ABSL_DECLARE_FLAG(int, n);
ABSL_DECLARE_FLAG(std::string, rule);
ABSL_DECLARE_FLAG(int64_t, steps);
ABSL_DECLARE_FLAG(int, epochs);
ABSL_DECLARE_FLAG(int64_t, seed);
ABSL_DECLARE_FLAG(int, threads_per_block);
ABSL_DECLARE_FLAG(std::string, out);
ABSL_DECLARE_FLAG(absl::Duration, link_latency);
ABSL_DECLARE_FLAG(double, link_bandwidth);
ABSL_DECLARE_FLAG(std::string, modes);
ABSL_DECLARE_FLAG(std::string, wire);
ABSL_DECLARE_FLAG(std::string, seeds);
ABSL_DECLARE_FLAG(std::string, profile);
ABSL_DECLARE_FLAG(int, blocks);
ABSL_DECLARE_FLAG(std::string, partition);
ABSL_DECLARE_FLAG(int, microbatches);
ABSL_DECLARE_FLAG(bool, sweep);
ABSL_DECLARE_FLAG(std::string, replicas);
ABSL_DECLARE_FLAG(std::string, reduction);
ABSL_DECLARE_FLAG(int64_t, checkpoint_every);
ABSL_DECLARE_FLAG(std::string, checkpoint_dir);
ABSL_DECLARE_FLAG(int, keep_checkpoints);
ABSL_DECLARE_FLAG(std::string, resume);
ABSL_DECLARE_FLAG(absl::Duration, recover_timeout);
ABSL_DECLARE_FLAG(std::string, profile_ops);
ABSL_DECLARE_FLAG(std::string, run);
ABSL_DECLARE_FLAG(std::string, token_file);
ABSL_DECLARE_FLAG(std::string, to);
ABSL_DECLARE_FLAG(std::string, checkpoint);
ABSL_DECLARE_FLAG(int, exit);
ABSL_DECLARE_FLAG(std::string, prompt);
ABSL_DECLARE_FLAG(int, tokens);
ABSL_DECLARE_FLAG(double, temperature);
ABSL_DECLARE_FLAG(int, top_k);
ABSL_DECLARE_FLAG(int64_t, first);
ABSL_DECLARE_FLAG(int64_t, count);
ABSL_DECLARE_FLAG(std::string, input);
ABSL_DECLARE_FLAG(std::string, prompt_ids);
ABSL_DECLARE_FLAG(bool, fit_schedule);

namespace interlock {
namespace cli {

// Every command's usage, for --help and errors.
extern const char kUsage[];

// Prints the error and returns `code`, the exit code.
int Fail(const std::string& message, int code = 1);

// Whether the flag was typed (the defaults of --steps, --seed, ... stand for
// "unset", so a typed one that equals them must not be silently ignored).
// This absl keeps IsSpecifiedOnCommandLine private: ParseFlags records the
// names.
bool Given(absl::string_view name);
template <typename T>
bool Given(const absl::Flag<T>& flag) {
  return Given(absl::GetFlagReflectionHandle(flag).Name());
}

struct CommandLine {
  // As typed, quoted for a shell, for reports.
  std::string typed;
  // The arguments that are not flags, the program first.
  std::vector<std::string> args;
};

// Sets up --help and parses the flags, recording which were typed;
// --dump-params is --dump_params and `--n e2e` is --mode=e2e. Exits on
// --help or a bad flag.
CommandLine ParseFlags(int argc, char** argv);

// The numeric flags train and compare share: a value that would be ignored
// or make no sense is refused, naming the flag. Returns 0 or the exit code.
int CheckNumericFlags();

// The flags of every training command -> TrainOptions. Returns 0, or the
// exit code after printing what was wrong.
int TrainOptionsFromFlags(TrainOptions& options);

}  // namespace cli
}  // namespace interlock

#endif  // INTERLOCK_COORDINATOR_CLI_FLAGS_H_
