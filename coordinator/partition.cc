#include "coordinator/partition.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "plan/status_macros.h"
#include "services/config.h"
#include "services/logging.h"
#include "services/models.h"

namespace interlock {
namespace {

using interlock::v1::RunConfig;
using interlock::v1::TrainingSpec;

// Measures `config`'s units with `measure`: kProfileSteps steps with one
// unit per block into `dir`.
absl::StatusOr<Profile> MeasureUnits(const RunConfig& config, int units,
                                     const std::string& dir,
                                     const UnitMeasurer& measure) {
  RunConfig c = config;
  auto* m = c.mutable_model();
  m->clear_partition();
  m->clear_partition_profile();
  m->set_blocks(units);
  auto* t = c.mutable_training();
  // Without a head string no block can have one: E2E, heads cost nothing.
  if (m->head().empty()) {
    t->set_mode(TrainingSpec::E2E);
  } else {
    t->set_mode(TrainingSpec::INTERLOCK);
    t->set_n(1);
    t->set_rule(TrainingSpec::FURTHEST);
  }
  t->set_steps(kProfileSteps);
  t->set_epochs(0);
  t->set_eval_every_steps(0);
  LOG(INFO) << "partition: measuring unit costs: " << kProfileSteps
            << " steps of " << c.name() << " with each of its " << units
            << " units a block of its own, in process on one thread, into "
            << dir;
  if (!measure) {
    return absl::InternalError("partition: nothing to measure unit costs with");
  }
  auto profile = measure(c, dir);
  if (!profile.ok()) {
    return absl::Status(profile.status().code(),
                        absl::StrCat("partition: the profiling run failed: ",
                                     profile.status().message()));
  }
  return profile;
}

// A folder of its own for a profiling run nobody keeps.
std::string ScratchDir() {
  static std::atomic<int> next{0};
  return (std::filesystem::temp_directory_path() /
          absl::StrCat("interlock_units_", getpid(), "_", next++))
      .string();
}

std::string Millis(double seconds) {
  return absl::StrFormat("%.3f", 1e3 * seconds);
}

}  // namespace

absl::StatusOr<PartitionChoice> ChoosePartition(const RunConfig& config,
                                                int blocks,
                                                const std::string& profile,
                                                const std::string& dir,
                                                const UnitMeasurer& measure) {
  ASSIGN_OR_RETURN(const int units, NumUnits(config.model()));
  // Refused before anything is measured.
  if (blocks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition: K = ", blocks, " blocks; K must be >= 1"));
  }
  if (blocks > units) {
    return absl::InvalidArgumentError(absl::StrCat(
        "partition: K = ", blocks, " blocks but the model of ", config.name(),
        " has only ", units,
        " units (stem/embedding + residual blocks/layers + classifier)"));
  }
  PartitionChoice choice;
  std::error_code ec;
  if (!profile.empty()) {
    ASSIGN_OR_RETURN(choice.units, LoadProfile(profile));
    choice.source = choice.units.path;
  } else if (!dir.empty() &&
             std::filesystem::exists(dir + "/profile.json", ec)) {
    // An earlier attempt into the same folder (a resumed run, a rerun):
    // the same costs give the same cut.
    ASSIGN_OR_RETURN(choice.units, LoadProfile(dir));
    choice.source = absl::StrCat(choice.units.path,
                                 " (measured earlier; delete it to measure "
                                 "again)");
  } else {
    const std::string where = dir.empty() ? ScratchDir() : dir;
    auto measured = MeasureUnits(config, units, where, measure);
    if (dir.empty()) std::filesystem::remove_all(where, ec);
    if (!measured.ok()) return measured.status();
    choice.units = *std::move(measured);
    choice.source = absl::StrCat("a ", kProfileSteps, "-step profiling run",
                                 dir.empty() ? "" : " in ", dir);
  }
  ASSIGN_OR_RETURN(choice.unit_costs, UnitCostsOf(choice.units));
  if (static_cast<int>(choice.unit_costs.unit.size()) != units) {
    return absl::InvalidArgumentError(
        absl::StrCat(choice.units.path, ": a unit profile of ",
                     choice.unit_costs.unit.size(), " units, but the model of ",
                     config.name(), " has ", units, "; profile this model"));
  }
  ASSIGN_OR_RETURN(choice.counts, BalancedPartition(choice.unit_costs, blocks));
  choice.block_costs = BlockCosts(choice.unit_costs, choice.counts);
  return choice;
}

absl::Status ResolveAutoPartition(RunConfig& config, const std::string& dir,
                                  const UnitMeasurer& measure) {
  const auto& model = config.model();
  if (model.partition() != kAutoPartition) return absl::OkStatus();
  if (model.blocks() < 1) {
    return absl::InvalidArgumentError(
        "model.partition: 'auto' needs model.blocks, the number of blocks K "
        "to cut the model into");
  }
  ASSIGN_OR_RETURN(PartitionChoice choice,
                   ChoosePartition(config, model.blocks(),
                                   model.partition_profile(), dir, measure));
  std::vector<std::string> costs;
  for (double c : choice.block_costs) costs.push_back(Millis(c));
  LOG(INFO) << "partition auto: \"" << PartitionString(choice.counts)
            << "\" (blocks cost " << absl::StrJoin(costs, " / ")
            << " ms per micro-batch; unit costs from " << choice.source << ")";
  config.mutable_model()->set_partition(PartitionString(choice.counts));
  return absl::OkStatus();
}

int PartitionMain(const PartitionCommand& cmd, const UnitMeasurer& measure,
                  std::ostream& out, std::ostream& err) {
  auto fail = [&err](absl::string_view message, int code) {
    err << "interlock: error: " << message << "\n";
    return code;
  };
  if (cmd.config_path.empty()) return fail("--config is required", 2);
  if (cmd.blocks < 1) {
    return fail(absl::StrCat("--blocks: ", cmd.blocks,
                             "; give K >= 1, the number of blocks to cut the "
                             "model into"),
                2);
  }
  auto loaded = LoadRunConfig(cmd.config_path);
  if (!loaded.ok()) return fail(loaded.status().message(), 1);
  RunConfig config = *loaded;
  ApplyDefaults(config);
  // The config as a K-block run would check it (the head must fit every
  // unit's output; the run's own n does not matter here).
  RunConfig check = config;
  check.mutable_model()->clear_partition();
  check.mutable_model()->set_blocks(cmd.blocks);
  check.mutable_training()->set_n(1);
  if (auto st = ValidateRunConfig(check); !st.ok()) {
    return fail(st.message(), 1);
  }
  auto choice = ChoosePartition(
      config, cmd.blocks, cmd.profile,
      cmd.out_dir.empty() ? "" : cmd.out_dir + "/units", measure);
  if (!choice.ok()) return fail(choice.status().message(), 1);
  const PartitionChoice& c = *choice;
  const int k = cmd.blocks;
  const int m = config.training().microbatches();

  out << "partition: \"" << PartitionString(c.counts) << "\"\n\n";
  out << absl::StrFormat(
      "%s: %d units cut into K = %d blocks of least maximum cost; unit costs "
      "from %s.\nA block costs, per micro-batch, the forward, backward and "
      "optimizer share of its units plus the head on its output (the "
      "model's own loss for the last):\n",
      config.name(), c.unit_costs.unit.size(), k, c.source);
  double total = 0;
  for (double b : c.block_costs) total += b;
  out << absl::StrFormat("  %5s %8s %10s %10s %7s\n", "block", "units",
                         "cost (ms)", "head (ms)", "share");
  int first = 0;
  for (int b = 0; b < k; ++b) {
    const int last = first + c.counts[b] - 1;
    out << absl::StrFormat(
        "  %5d %8s %10s %10s %6.1f%%\n", b, absl::StrCat(first, "..", last),
        Millis(c.block_costs[b]), Millis(c.unit_costs.head[last]),
        total > 0 ? 100.0 * c.block_costs[b] / total : 0.0);
    first = last + 1;
  }
  // The config's own cut into K blocks, if it has one, for comparison.
  std::vector<int> own;
  const std::string& given = config.model().partition();
  if (given != kAutoPartition) {
    auto parsed =
        ParsePartition(given, static_cast<int>(c.unit_costs.unit.size()),
                       given.empty() ? config.model().blocks() : 0);
    if (parsed.ok() && static_cast<int>(parsed->size()) == k) own = *parsed;
  }
  if (!own.empty()) {
    const std::vector<double> own_costs = BlockCosts(c.unit_costs, own);
    std::vector<std::string> cells;
    for (double b : own_costs) cells.push_back(Millis(b));
    out << absl::StrFormat(
        "The config's partition \"%s\" costs %s ms per block (most %s ms; "
        "balanced: %s ms).\n",
        PartitionString(own), absl::StrJoin(cells, " / "),
        Millis(*std::max_element(own_costs.begin(), own_costs.end())),
        Millis(*std::max_element(c.block_costs.begin(), c.block_costs.end())));
  }

  out << absl::StrFormat(
      "\nStep time on the virtual clock (interlock simulate), M = %d, link "
      "%.0f us + bytes / %.3g B/s:\n",
      m, cmd.link.latency_seconds * 1e6, cmd.link.bytes_per_second);
  const Profile balanced = CutProfile(c.units, c.counts);
  const Profile configured = own.empty() ? Profile{} : CutProfile(c.units, own);
  std::string header = absl::StrFormat("  %-16s %12s %8s  %-24s", "mode",
                                       "step (s)", "vs e2e", "busy per block");
  if (!own.empty()) {
    absl::StrAppend(&header,
                    absl::StrFormat(" %14s %8s", "config's (s)", "vs e2e"));
  }
  out << header << "\n";
  double e2e = 0, own_e2e = 0;
  for (const ModeSpec& mode : ModesFor(k)) {
    const SimResult r = PredictMode(balanced, k, m, cmd.link, mode);
    if (mode.e2e) e2e = r.step_seconds;
    std::vector<std::string> busy;
    for (double b : r.busy_ratio) {
      busy.push_back(absl::StrFormat("%.0f%%", 100.0 * b));
    }
    std::string line = absl::StrFormat(
        "  %-16s %12.5f %7.2fx  %-24s", mode.Label(), r.step_seconds,
        r.step_seconds > 0 ? e2e / r.step_seconds : 0.0,
        absl::StrJoin(busy, " "));
    if (!own.empty()) {
      const SimResult o = PredictMode(configured, k, m, cmd.link, mode);
      if (mode.e2e) own_e2e = o.step_seconds;
      absl::StrAppend(
          &line,
          absl::StrFormat(" %14.5f %7.2fx", o.step_seconds,
                          o.step_seconds > 0 ? own_e2e / o.step_seconds : 0.0));
    }
    out << line << "\n";
  }
  out << "(vs e2e: E2E's step time over the mode's; each column against its "
         "own cut's E2E)\n";
  return 0;
}

}  // namespace interlock
