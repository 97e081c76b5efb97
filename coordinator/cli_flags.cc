// The flags of the `interlock` CLI and of interlock-coordinator: their
// definitions and --help, parsing the command line, and the flags every
// training command shares turned into TrainOptions.
#include "coordinator/cli_flags.h"

#include <unistd.h>

#include <cmath>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "plan/topology.h"
#include "rpc/grpc_logging.h"
#include "services/device.h"
#include "services/logging.h"

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
ABSL_FLAG(std::string, out, "",
          "folder for metrics.jsonl, eval.jsonl and "
          "summary.json; partition: keeps the profiling run in DIR/units");
ABSL_FLAG(bool, dump_params, false, "print every parameter as JSON at the end");
ABSL_FLAG(bool, quiet, false, "no progress output");
ABSL_FLAG(bool, replace, false,
          "train, compare: write over a finished run's files in --out (a run "
          "there otherwise resumes from its checkpoint, or refuses)");
#ifdef INTERLOCK_COORDINATOR_BINARY
constexpr char kDefaultEngine[] = "cluster";
#else
constexpr char kDefaultEngine[] = "inprocess";
#endif
ABSL_FLAG(std::string, engine, kDefaultEngine,
          "inprocess (one process) or cluster (worker services over gRPC)");
ABSL_FLAG(std::string, workers, "",
          "cluster: worker addresses, blocks in order separated by ',', the "
          "replicas of a block by '+' (a:1+a:2,b:1); empty starts a local "
          "cluster on loopback");
ABSL_FLAG(std::string, replicas, "",
          "replicas per block, e.g. 2,1,1,1 (empty: one each). A local "
          "cluster starts that many workers per block, which reduce their "
          "gradients as training.reduction says; in process it only informs "
          "the virtual clock (the run is the single chain, which ORDERED "
          "replicas equal bitwise); simulate: predict with these replicas");
ABSL_FLAG(int, coordinator_port, -1,
          "cluster: serve the membership service on this port (0: any free "
          "one; -1: off), so that workers started with --coordinator "
          "HOST:PORT --block K join a block's replicas and leave on SIGTERM");
ABSL_FLAG(std::string, coordinator_host, "127.0.0.1",
          "cluster: the address the membership service listens on (0.0.0.0: "
          "every IPv4 interface); beyond loopback it needs --token-file or "
          "mutual TLS, or --insecure");
ABSL_FLAG(std::string, coordinator_port_file, "",
          "cluster: write the membership service's port to this file once "
          "it listens");
ABSL_FLAG(std::string, collective_host, "",
          "cluster with replicas: the address of this machine the workers "
          "reach the reduction rendezvous store at, with the run's token "
          "(empty: 127.0.0.1 when every worker is on loopback, else the "
          "host name)");
ABSL_FLAG(int, collective_port, 0,
          "cluster with replicas: the port of the reduction rendezvous store "
          "(0: any free one; fix it where a firewall or a Kubernetes Service "
          "names it)");
ABSL_FLAG(std::string, device, "",
          "where the blocks run: cpu, cuda (= cuda:0) or cuda:N, for every "
          "block or one per block (cpu,cpu,cuda:0,cuda:1); in process and a "
          "local cluster's workers (empty: cpu)");
ABSL_FLAG(std::string, worker_binary, "",
          "local cluster: the interlock-worker executable");
ABSL_FLAG(absl::Duration, connect_timeout, absl::Seconds(30),
          "cluster: how long to wait for each worker to be reachable");
ABSL_FLAG(int, metrics_port, -1,
          "serve the coordinator's /metrics on this port (-1: off)");
ABSL_FLAG(std::string, metrics_host, "127.0.0.1",
          "the address the coordinator's /metrics listens on (0.0.0.0: every "
          "IPv4 interface, e.g. for Prometheus in Kubernetes); beyond "
          "loopback it needs --token-file or mutual TLS, or --insecure");
ABSL_FLAG(bool, insecure, false,
          "allow --coordinator-host or --metrics-host beyond loopback without "
          "--token-file or mutual TLS: anyone who reaches the port can join "
          "the run (or read /metrics); only on a network you trust. Recorded "
          "in summary.json");
ABSL_FLAG(absl::Duration, budget, absl::ZeroDuration(),
          "stop at this much training wall time, then evaluate (e.g. 10m)");
ABSL_FLAG(absl::Duration, budget_virtual, absl::ZeroDuration(),
          "stop at this much time on the virtual clock (one accelerator per "
          "block), then evaluate");
ABSL_FLAG(int, window, 0,
          "micro-batches in flight (0: 2 x blocks x micro-batches per step)");
ABSL_FLAG(absl::Duration, link_latency, absl::Microseconds(100),
          "virtual clock: latency of every message between processes");
ABSL_FLAG(double, link_bandwidth, 4.4e8,
          "virtual clock: bytes per second of every link");
ABSL_FLAG(std::string, modes, "",
          "compare: modes to run, e.g. e2e,1,2,2sum (N: N-way FURTHEST, Nsum: "
          "N-way SUM)");
ABSL_FLAG(std::string, seeds, "",
          "compare: run every mode once per seed, e.g. 1,2,3; the report "
          "gives each mode's mean and standard deviation over them");
ABSL_FLAG(std::string, wire, "",
          "wire codecs (the config's wire): train: one of fp32, bf16, fp16, "
          "int8, or ACTIVATIONS:GRADIENTS such as bf16:int8; compare: a "
          "list of them, each run with every mode of --modes");
ABSL_FLAG(std::string, profile, "",
          "simulate: a run's --out folder (its profile.json) or the file; "
          "partition: a unit profile (DIR/units of an earlier `interlock "
          "partition --out DIR`) to cut from instead of measuring");
ABSL_FLAG(int, blocks, 0,
          "simulate: blocks K to predict for (0: the profile's); another K "
          "than measured cuts the model into K blocks of equal cost (a unit "
          "profile: the balanced cut); partition: K, the blocks to cut into");
ABSL_FLAG(std::string, partition, "",
          "simulate: a cut such as 2,2,1,rest of a unit profile's units to "
          "predict for");
ABSL_FLAG(int, microbatches, 0,
          "simulate: micro-batches per step (0: the profile's)");
ABSL_FLAG(std::string, reduction, "",
          "the replicas' reduction, ordered or ring; train: sets "
          "training.reduction (empty: the config's); simulate: predict with "
          "it (empty: the profile's run's)");
ABSL_FLAG(bool, sweep, false,
          "simulate: also print step time against K = 2, 4, 8, 16 for e2e, "
          "1-, 2- and 3-way");
ABSL_FLAG(std::string, token_file, "",
          "cluster: file holding the shared bearer token sent on every call "
          "to the workers (a local cluster's workers require it; without it "
          "or TLS they require a token generated for the run)");
ABSL_FLAG(std::string, tls_cert, "",
          "cluster: PEM client certificate for mutual TLS (a local cluster's "
          "workers serve with it)");
ABSL_FLAG(std::string, tls_key, "", "cluster: PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_ca, "",
          "cluster: PEM CA the workers' certificates are checked against "
          "(turns TLS on)");
ABSL_FLAG(int64_t, checkpoint_every, 0,
          "take a checkpoint every N steps (0: only on SIGTERM/SIGINT)");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "folder of the run's checkpoints (default OUT/checkpoints); a run "
          "resumes from the newest complete one found there");
ABSL_FLAG(int, keep_checkpoints, 3, "keep the newest N checkpoints");
ABSL_FLAG(std::string, resume, "",
          "resume from this checkpoint (or the newest complete one in this "
          "folder)");
ABSL_FLAG(absl::Duration, recover_timeout, absl::Seconds(120),
          "cluster: how long to wait for failed workers to come back before "
          "restoring the last checkpoint (0: a failure ends the run)");
ABSL_FLAG(std::string, run, "",
          "export: the run's --out folder (its newest checkpoint is exported)");
ABSL_FLAG(std::string, to, "",
          "export: the folder to write the trained network to");
ABSL_FLAG(std::string, checkpoint, "",
          "export: this checkpoint folder (OUT/checkpoints/step-N) instead "
          "of the run's newest");
ABSL_FLAG(int, exit, -1,
          "predict, generate: the early exit to use, block K's head (-1: "
          "the final output)");
ABSL_FLAG(std::string, prompt, "", "generate: the text to continue");
ABSL_FLAG(int, tokens, 200, "generate: bytes to sample");
ABSL_FLAG(double, temperature, 1.0,
          "generate: divides the logits before sampling (0: the most likely "
          "byte every time)");
ABSL_FLAG(int, top_k, 0,
          "generate: sample among the K most likely bytes only (0: all)");
ABSL_FLAG(bool, fit_schedule, true,
          "with --budget or --budget-virtual (compare: on unless =false; "
          "train: when given): a run does the steps its budget buys "
          "(predicted from a short calibration run), its learning-rate "
          "schedule spanning them, instead of the config's schedule cut at "
          "the budget; a resumed train run keeps the steps it was fitted to");
ABSL_FLAG(std::string, prompt_ids, "",
          "generate: token ids to continue, space- or comma-separated (a "
          "model of any vocabulary; prints ids)");
ABSL_FLAG(std::string, input, "",
          "predict: label the samples of this file instead of the test "
          "split: a .npy array (one sample or N), an image (.png, .jpg) or a "
          "folder of images, prepared as the run's data");
ABSL_FLAG(int64_t, first, 0, "predict: the first sample to label");
ABSL_FLAG(int64_t, count, 10, "predict: how many samples to label");
ABSL_FLAG(std::string, profile_ops, "",
          "train, in process, sequential schedule: write the time per LibTorch "
          "operation of ten steady steps (after calibration) to this file "
          "(Markdown)");

ABSL_FLAG(int, verbosity, 0,
          "log detail: 0 what an operator needs (INFO and above), 1 every "
          "worker configured and stream opened or ended");

namespace interlock {
namespace cli {
namespace {

// The flags the command line names (underscores for dashes).
std::set<std::string> g_given_flags;

}  // namespace

const char kUsage[] =
    "interlock train --config FILE [--mode e2e|interlock] [--n N] "
    "[--rule furthest|sum] [--steps N] [--epochs N] [--seed S] "
    "[--wire fp32|bf16|fp16|int8|A:G] [--threads-per-block T] [--schedule "
    "sequential|threaded] [--out DIR] "
    "[--dump-params] [--engine inprocess|cluster] [--workers A1+A2,B,...] "
    "[--replicas 2,1,...] [--reduction ordered|ring] "
    "[--device cpu|cuda[:N][,...]] [--metrics-port P [--metrics-host H]] "
    "[--coordinator-port P [--coordinator-host H]] [--insecure] [--budget T] "
    "[--budget-virtual T] "
    "[--link-latency T] [--link-bandwidth B] [--token-file F] "
    "[--tls-cert F --tls-key F] [--tls-ca F] [--checkpoint-every N] "
    "[--checkpoint-dir DIR] [--keep-checkpoints N] [--resume DIR] "
    "[--recover-timeout 120s] [--profile-ops FILE] [--verbosity 0|1] "
    "[--replace]\n"
    "  interlock compare --config FILE --modes e2e,1,2[,2sum,...] "
    "[--wire fp32,bf16,int8,...] [--budget-virtual T | --budget T "
    "[--fit-schedule=false] | --steps N] "
    "--out DIR "
    "[--engine inprocess|cluster] [--device D] [--seed S | --seeds 1,2,3] "
    "[--threads-per-block T] [--replicas 2,1,...]\n"
    "  interlock simulate --profile DIR [--blocks K] [--n N|e2e] "
    "[--rule furthest|sum] [--microbatches M] [--link-bandwidth B] "
    "[--link-latency T] [--replicas 2,1,...] [--reduction ordered|ring] "
    "[--partition 2,2,1,rest] [--sweep] (an input-gradient-only pass the "
    "profile did not measure costs the run's calibrated share of the "
    "parameter backward pass, 0.5 without one)\n"
    "  interlock partition --config FILE --blocks K [--profile DIR] "
    "[--out DIR] [--link-latency T] [--link-bandwidth B]\n"
    "  interlock export --run OUT | --checkpoint DIR --to DIR "
    "[--token-file F]\n"
    "  interlock eval --run OUT | --checkpoint DIR [--config FILE (its data)] "
    "[--token-file F]\n"
    "  interlock predict --run OUT | --checkpoint DIR [--config FILE | "
    "--input FILE|DIR] [--exit K] [--first I] [--count N]\n"
    "  interlock generate --run OUT | --checkpoint DIR --prompt TEXT | "
    "--prompt-ids 'I J ...' [--exit K] [--tokens N] [--temperature T] [--top-k "
    "K] [--seed S]";

int Fail(const std::string& message, int code) {
  std::cerr << "interlock: error: " << message << "\n";
  return code;
}

bool Given(absl::string_view name) {
  return g_given_flags.count(std::string(name)) > 0;
}

CommandLine ParseFlags(int argc, char** argv) {
  CommandLine parsed;
  // --help lists the flags of this file (absl's default looks for a file
  // named after the program and found none).
  absl::FlagsUsageConfig usage;
  // "Flags from interlock:", not the build machine's source path.
  usage.normalize_filename = [](absl::string_view file) {
    return absl::EndsWith(file, "cli_flags.cc") ? std::string("interlock")
                                                : std::string(file);
  };
  usage.contains_help_flags = [](absl::string_view file) {
    return file == "interlock" || absl::EndsWith(file, "cli_flags.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(kUsage);
  // Accept --dump-params as well as --dump_params.
  std::vector<std::string> storage(argv, argv + argc);
  std::vector<std::string> typed;
  for (const auto& a : storage) {
    const bool plain =
        !a.empty() && a.find_first_of(" '\"$`\\") == std::string::npos;
    typed.push_back(
        plain ? a : "'" + absl::StrReplaceAll(a, {{"'", "'\\''"}}) + "'");
  }
  parsed.typed = absl::StrJoin(typed, " ");
  // `--n e2e` (simulate's way to pick E2E) means --mode=e2e.
  for (size_t i = 1; i < storage.size(); ++i) {
    if (storage[i] == "--n=e2e" ||
        (storage[i] == "--n" && i + 1 < storage.size() &&
         storage[i + 1] == "e2e")) {
      if (storage[i] == "--n") storage.erase(storage.begin() + i + 1);
      storage[i] = "--mode=e2e";
    }
  }
  std::vector<char*> argv2;
  for (auto& a : storage) {
    if (a.rfind("--", 0) == 0) {
      for (size_t i = 2; i < a.size() && a[i] != '='; ++i) {
        if (a[i] == '-') a[i] = '_';
      }
      g_given_flags.insert(a.substr(2, a.find('=') - 2));
    } else if (a.size() > 1 && a[0] == '-' && absl::ascii_isalpha(a[1])) {
      // absl also takes -flag; a negative number is a value, not a flag.
      g_given_flags.insert(a.substr(1, a.find('=') - 1));
    }
    argv2.push_back(a.data());
  }
  std::vector<char*> args =
      absl::ParseCommandLine(static_cast<int>(argv2.size()), argv2.data());
  parsed.args.assign(args.begin(), args.end());
  const std::string program = storage.empty() ? "interlock" : storage[0];
  InitLogging(program.substr(program.rfind('/') + 1).c_str(),
              absl::GetFlag(FLAGS_verbosity));
  RouteGrpcLogs();
  return parsed;
}

int CheckNumericFlags() {
  if (Given(FLAGS_steps) && absl::GetFlag(FLAGS_steps) < 1) {
    return Fail(absl::StrCat("--steps: ", absl::GetFlag(FLAGS_steps),
                             ", must be >= 1 (leave it out to use the "
                             "config's steps or epochs)"),
                2);
  }
  if (Given(FLAGS_epochs) && absl::GetFlag(FLAGS_epochs) < 1) {
    return Fail(absl::StrCat("--epochs: ", absl::GetFlag(FLAGS_epochs),
                             ", must be >= 1"),
                2);
  }
  if (Given(FLAGS_seed) && absl::GetFlag(FLAGS_seed) < 0) {
    return Fail(absl::StrCat("--seed: ", absl::GetFlag(FLAGS_seed),
                             ", must be >= 0 (leave it out to use the "
                             "config's seed)"),
                2);
  }
  if (Given(FLAGS_n) && absl::GetFlag(FLAGS_n) < 1) {
    return Fail(absl::StrCat("--n: ", absl::GetFlag(FLAGS_n), ", must be >= 1"),
                2);
  }
  const int threads = absl::GetFlag(FLAGS_threads_per_block);
  if (Given(FLAGS_threads_per_block) && (threads < 1 || threads > 256)) {
    return Fail(
        absl::StrCat("--threads-per-block: ", threads, ", must be in 1..256"),
        2);
  }
  const int port = absl::GetFlag(FLAGS_metrics_port);
  if (port < -1 || port > 65535) {
    return Fail(absl::StrCat("--metrics-port: ", port,
                             ", must be a port in 0..65535 (0: any free "
                             "port) or -1 (off)"),
                2);
  }
  const absl::Duration connect = absl::GetFlag(FLAGS_connect_timeout);
  if (connect <= absl::ZeroDuration() || connect == absl::InfiniteDuration()) {
    return Fail(
        absl::StrCat("--connect-timeout: ", absl::FormatDuration(connect),
                     ", must be a finite time > 0"),
        2);
  }
  return 0;
}

int TrainOptionsFromFlags(interlock::TrainOptions& options) {
  const std::string schedule = absl::GetFlag(FLAGS_schedule);
  if (schedule == "sequential") {
    options.engine.schedule = interlock::Schedule::kSequential;
  } else if (schedule == "threaded") {
    options.engine.schedule = interlock::Schedule::kThreaded;
  } else {
    return Fail(absl::StrCat("--schedule: '", schedule,
                             "', expected sequential or threaded"),
                2);
  }
  options.output.out_dir = absl::GetFlag(FLAGS_out);
  options.output.dump_params = absl::GetFlag(FLAGS_dump_params);
  options.output.quiet = absl::GetFlag(FLAGS_quiet);
  options.output.replace = absl::GetFlag(FLAGS_replace);
  options.output.progress_bar = isatty(STDERR_FILENO) != 0;
  const std::string engine = absl::GetFlag(FLAGS_engine);
  if (engine == "cluster") {
    options.engine.kind = interlock::EngineKind::kCluster;
  } else if (engine != "inprocess") {
    return Fail(
        absl::StrCat("--engine: '", engine, "', expected inprocess or cluster"),
        2);
  }
  const std::string workers = absl::GetFlag(FLAGS_workers);
  if (!workers.empty()) {
    if (options.engine.kind != interlock::EngineKind::kCluster) {
      return Fail("--workers needs --engine cluster", 2);
    }
    auto topology = interlock::ParseWorkers(workers);
    if (!topology.ok()) {
      return Fail(std::string(topology.status().message()), 2);
    }
    options.engine.workers = *std::move(topology);
  }
  if (const std::string replicas = absl::GetFlag(FLAGS_replicas);
      !replicas.empty()) {
    if (!workers.empty()) {
      return Fail(
          "--replicas: with --workers, list each block's replicas there "
          "(A1+A2,B,...)",
          2);
    }
    auto counts = interlock::ParseReplicas(replicas);
    if (!counts.ok()) return Fail(std::string(counts.status().message()), 2);
    options.engine.replicas = *std::move(counts);
  }
  options.engine.collective_host = absl::GetFlag(FLAGS_collective_host);
  options.engine.collective_port = absl::GetFlag(FLAGS_collective_port);
  if (options.engine.collective_port < 0 ||
      options.engine.collective_port > 65535) {
    return Fail(
        absl::StrCat("--collective_port: ", options.engine.collective_port,
                     " is not in 0..65535"),
        2);
  }
  options.engine.coordinator_port = absl::GetFlag(FLAGS_coordinator_port);
  options.engine.coordinator_host = absl::GetFlag(FLAGS_coordinator_host);
  options.engine.coordinator_port_file =
      absl::GetFlag(FLAGS_coordinator_port_file);
  if (options.engine.coordinator_port < -1 ||
      options.engine.coordinator_port > 65535) {
    return Fail(
        absl::StrCat("--coordinator_port: ", options.engine.coordinator_port,
                     " is not in -1..65535"),
        2);
  }
  if (options.engine.coordinator_port >= 0 &&
      options.engine.kind != interlock::EngineKind::kCluster) {
    return Fail("--coordinator_port needs --engine cluster", 2);
  }
  options.engine.security.token_file = absl::GetFlag(FLAGS_token_file);
  options.engine.security.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  options.engine.security.tls_key = absl::GetFlag(FLAGS_tls_key);
  options.engine.security.tls_ca = absl::GetFlag(FLAGS_tls_ca);
  if (!options.engine.security.empty() &&
      options.engine.kind != interlock::EngineKind::kCluster) {
    return Fail("--token-file and --tls-* need --engine cluster", 2);
  }
  auto devices =
      interlock::ParseDeviceList("--device", absl::GetFlag(FLAGS_device));
  if (!devices.ok()) return Fail(std::string(devices.status().message()), 2);
  options.engine.devices = *std::move(devices);
  options.engine.worker_binary = absl::GetFlag(FLAGS_worker_binary);
  options.output.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  options.output.metrics_host = absl::GetFlag(FLAGS_metrics_host);
  // Secure by default: the membership service and /metrics listen beyond
  // loopback only with a token or mutual TLS, or when --insecure says so.
  options.engine.insecure = absl::GetFlag(FLAGS_insecure);
  const bool authenticated =
      interlock::AuthenticatesCallers(options.engine.security);
  for (const absl::Status& st :
       {options.engine.coordinator_port < 0
            ? absl::OkStatus()
            : interlock::CheckListener(
                  "coordinator-host", options.engine.coordinator_host,
                  authenticated, options.engine.insecure,
                  "the run has no --token-file or mutual TLS: anyone who "
                  "reaches the membership service could join the run",
                  "give it --token-file (or --tls-cert, --tls-key and "
                  "--tls-ca)"),
        options.output.metrics_port < 0
            ? absl::OkStatus()
            : interlock::CheckListener(
                  "metrics-host", options.output.metrics_host, authenticated,
                  options.engine.insecure,
                  "the run has no --token-file or mutual TLS: its /metrics "
                  "would be open to anyone",
                  options.engine.kind == interlock::EngineKind::kCluster
                      ? "give it --token-file (or --tls-cert, --tls-key and "
                        "--tls-ca)"
                      : "")}) {
    if (!st.ok()) return Fail(std::string(st.message()), 2);
  }
  options.engine.connect_timeout = absl::GetFlag(FLAGS_connect_timeout);
  options.budget.wall = absl::GetFlag(FLAGS_budget);
  if (absl::GetFlag(FLAGS_window) < 0) {
    return Fail(absl::StrCat("--window: ", absl::GetFlag(FLAGS_window),
                             ", must be >= 0 (0: 2 x blocks x micro-batches)"),
                2);
  }
  options.window = absl::GetFlag(FLAGS_window);
  options.budget.virtual_time = absl::GetFlag(FLAGS_budget_virtual);
  if (options.budget.wall < absl::ZeroDuration() ||
      options.budget.virtual_time < absl::ZeroDuration()) {
    return Fail("--budget and --budget-virtual must not be negative", 2);
  }
  options.link.latency_seconds =
      absl::ToDoubleSeconds(absl::GetFlag(FLAGS_link_latency));
  options.link.bytes_per_second = absl::GetFlag(FLAGS_link_bandwidth);
  // NaN fails every comparison: test for the good range, not the bad one.
  if (!(std::isfinite(options.link.latency_seconds) &&
        options.link.latency_seconds >= 0)) {
    return Fail(
        absl::StrCat("--link-latency: ",
                     absl::FormatDuration(absl::GetFlag(FLAGS_link_latency)),
                     ", must be a finite time >= 0"),
        2);
  }
  if (!(std::isfinite(options.link.bytes_per_second) &&
        options.link.bytes_per_second > 0)) {
    return Fail(
        absl::StrCat("--link-bandwidth: ", options.link.bytes_per_second,
                     ", must be a finite number of bytes per "
                     "second > 0"),
        2);
  }
  return 0;
}

}  // namespace cli
}  // namespace interlock
