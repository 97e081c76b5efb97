// interlock_analysis_check: links interlock_analysis and nothing else of
// ours, writes a made-up profile.json, reads it back and predicts every mode
// of it. It fails to build if the library needs LibTorch or gRPC, and exits
// 1 if the prediction is not sane.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <iostream>
#include <string>

#include "analysis/run_files.h"
#include "analysis/simulate.h"

namespace interlock {
namespace {

v1::RunProfile MadeUpProfile(int blocks) {
  v1::RunProfile p;
  p.set_name("check");
  p.set_blocks(blocks);
  p.set_microbatches(2);
  p.set_batch_size(16);
  p.set_mode("interlock");
  p.set_n(2);
  p.set_rule("furthest");
  p.set_steps(10);
  p.set_input_bytes(1000);
  for (int k = 0; k + 1 < blocks; ++k) {
    p.add_down_bytes(1000);
    p.add_up_bytes(2000);
  }
  p.mutable_link()->set_latency_seconds(1e-4);
  p.mutable_link()->set_bytes_per_second(1e9);
  for (int k = 0; k < blocks; ++k) {
    v1::BlockCosts* b = p.add_per_block();
    b->set_forward(0.01);
    b->set_head(0.002);
    b->set_backward(0.02);
    b->set_input_grad(0.0);
    b->set_optimizer(0.001);
  }
  p.mutable_step_seconds()->set_wall(0.1);
  p.mutable_step_seconds()->set_virtual_(0.05);
  return p;
}

int Check() {
  const std::string dir =
      (std::filesystem::temp_directory_path() /
       ("interlock_analysis_check_" + std::to_string(getpid())))
          .string();
  std::filesystem::create_directories(dir);
  constexpr int kBlocks = 3;
  if (auto st = WriteProfileFile(dir + "/profile.json", MadeUpProfile(kBlocks));
      !st.ok()) {
    std::cerr << st << "\n";
    return 1;
  }
  auto profile = LoadProfile(dir);
  std::filesystem::remove_all(dir);
  if (!profile.ok()) {
    std::cerr << profile.status() << "\n";
    return 1;
  }
  for (const ModeSpec& mode : ModesFor(kBlocks)) {
    const SimResult r = PredictMode(*profile, kBlocks, profile->microbatches,
                                    profile->link, mode);
    std::cout << mode.Label() << ": step " << r.step_seconds
              << " s, utilisation " << r.utilisation << "\n";
    if (!(r.step_seconds > 0) || !std::isfinite(r.step_seconds) ||
        !(r.utilisation > 0) || r.utilisation > 1) {
      std::cerr << "implausible prediction for " << mode.Label() << "\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace
}  // namespace interlock

int main() { return interlock::Check(); }
