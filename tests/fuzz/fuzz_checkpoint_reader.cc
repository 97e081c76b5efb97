// libFuzzer target: the checkpoint reader. The first byte picks the part:
// even, the manifest parser (the coordinator reads manifest.pbtxt); odd, a
// block's state archive as a worker loads it (BlockTrainer::LoadState: our
// zip and pickle checks, LibTorch's unpickler). Whatever the input, the
// reader must return a status and leak nothing (the leak check stays on): a
// manifest it accepts must survive a write and a second read unchanged, and
// an archive it refuses must leave the block's parameters unchanged.
#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/util/message_differencer.h>

#include <cstdlib>
#include <iostream>
#include <memory>

#include "coordinator/checkpoint.h"
#include "services/config.h"
#include "services/digest.h"
#include "services/trainer.h"
#include "tests/fuzz/checkpoint_model.h"

namespace {

std::unique_ptr<interlock::BlockTrainer> g_trainer;

std::string StateDigest() {
  return interlock::DigestTensors(g_trainer->NamedState());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  google::protobuf::SetLogHandler(nullptr);
  auto config =
      interlock::ParseRunConfig(interlock::fuzz::kCheckpointModel, "fuzz");
  if (!config.ok()) {
    std::cerr << config.status() << "\n";
    std::abort();
  }
  auto trainer = interlock::BlockTrainer::Create(
      *config, interlock::fuzz::CheckpointModelShape(), /*block=*/0);
  if (!trainer.ok()) {
    std::cerr << trainer.status() << "\n";
    std::abort();
  }
  g_trainer = std::move(*trainer);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const absl::string_view bytes(reinterpret_cast<const char*>(data) + 1,
                                size - 1);
  if (data[0] % 2 == 0) {
    auto m = interlock::ParseManifest(bytes, "fuzz manifest");
    if (m.ok()) {
      auto again =
          interlock::ParseManifest(interlock::SerializeManifest(*m), "again");
      if (!again.ok() ||
          !google::protobuf::util::MessageDifferencer::Equals(*m, *again)) {
        __builtin_trap();
      }
    }
    return 0;
  }
  const std::string before = StateDigest();
  auto loaded = g_trainer->LoadState(std::string(bytes));
  if (!loaded.ok() && StateDigest() != before) __builtin_trap();
  return 0;
}
