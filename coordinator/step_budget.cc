#include "coordinator/step_budget.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <thread>

#include "coordinator/train.h"
#include "plan/status_macros.h"
#include "services/wire_codec.h"

namespace interlock {
namespace {

namespace v1 = interlock::v1;

// Bytes an fp32 value takes in `codec` (with its int8 block size).
double BytesPerValue(v1::WireSpec::Codec codec, int int8_block_size) {
  constexpr int64_t kValues = 1 << 20;
  auto c = CodecFor(codec, int8_block_size);
  return c.ok() ? static_cast<double>(
                      (*c)->MaxEncodedBytes(torch::kFloat32, kValues)) /
                      kValues
                : 4.0;
}

// `profile`, measured with `from`'s codecs, with its message sizes scaled
// to `to`'s (targets and token ids, which no codec changes, are scaled too:
// close enough for a step count).
Profile WithCodecs(Profile p, const v1::WireSpec& from,
                   const v1::WireSpec& to) {
  const double down = BytesPerValue(to.activations(), to.int8_block_size()) /
                      BytesPerValue(from.activations(), from.int8_block_size());
  const double up = BytesPerValue(to.gradients(), to.int8_block_size()) /
                    BytesPerValue(from.gradients(), from.int8_block_size());
  p.input_bytes = std::llround(p.input_bytes * down);
  for (auto& b : p.down_bytes) b = std::llround(b * down);
  for (auto& b : p.up_bytes) b = std::llround(b * up);
  return p;
}

}  // namespace

ModeSpec ModeOf(const v1::RunConfig& config) {
  const auto& t = config.training();
  ModeSpec m;
  m.e2e = t.mode() == v1::TrainingSpec::E2E;
  m.n = t.n();
  m.sum = t.rule() == v1::TrainingSpec::SUM;
  return m;
}

absl::StatusOr<std::vector<int64_t>> StepsInBudget(
    const v1::RunConfig& calibration, const std::vector<BudgetRun>& runs,
    const TrainOptions& options, int64_t cap, const std::string& scratch_dir) {
  if (runs.empty()) return std::vector<int64_t>();
  TrainOptions t = options;
  t.output.out_dir = scratch_dir;
  t.output.quiet = true;
  t.output.replace = true;
  t.output.metrics_port = -1;
  t.budget.wall = t.budget.virtual_time = absl::ZeroDuration();
  t.checkpoints = CheckpointOptions();
  v1::RunConfig c = calibration;
  c.mutable_training()->set_steps(kCalibrationSteps);
  c.mutable_training()->set_eval_every_steps(0);
  auto run = Train(c, t);
  auto profile = run.ok() ? LoadProfile(scratch_dir) : run.status();
  std::error_code ec;
  std::filesystem::remove_all(scratch_dir, ec);
  if (!profile.ok()) {
    return absl::Status(profile.status().code(),
                        absl::StrCat("the calibration run failed: ",
                                     profile.status().message()));
  }
  const bool serial = options.engine.kind == EngineKind::kInProcess &&
                      options.engine.schedule == Schedule::kSequential;
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  // Predicted virtual and wall step time of a run.
  auto predict = [&](const BudgetRun& r) {
    const SimResult s = PredictMode(
        WithCodecs(*profile, runs[0].wire, r.wire), profile->blocks,
        profile->microbatches, options.link, r.mode, ProfileReplicas(*profile));
    double tracks = 0;  // one per replica
    for (const auto& replicas : s.replica_busy_ratio) tracks += replicas.size();
    const double busy = s.utilisation * tracks * s.step_seconds;
    return std::make_pair(
        s.step_seconds, serial ? busy : std::max(s.step_seconds, busy / cores));
  };
  // The profile's means include the first step's start-up; the run's means
  // after it put the predictions back on scale.
  const auto [first_virtual, first_wall] = predict(runs[0]);
  const double scale_virtual = first_virtual > 0 && run->mean_step_virtual > 0
                                   ? run->mean_step_virtual / first_virtual
                                   : 1.0;
  const double scale_wall = first_wall > 0 && run->mean_step_wall > 0
                                ? run->mean_step_wall / first_wall
                                : 1.0;
  const double bv = absl::ToDoubleSeconds(options.budget.virtual_time);
  const double bw = absl::ToDoubleSeconds(options.budget.wall);
  std::vector<int64_t> out;
  for (const BudgetRun& r : runs) {
    const auto [step_virtual, step_wall] = predict(r);
    int64_t expected = cap;
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
  return out;
}

}  // namespace interlock
