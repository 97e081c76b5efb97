// Writes the seed corpus of the fuzz targets: valid exchanges a worker sees
// in a run (so the fuzzer starts from messages that pass the checks) and a
// few tensors. Usage: fuzz_seeds DIR (writes DIR/<target>/seed-*).
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "coordinator/checkpoint.h"
#include "services/config.h"
#include "services/models.h"
#include "services/trainer.h"
#include "services/wire.h"
#include "services/wire_codec.h"
#include "tests/fuzz/checkpoint_model.h"
#include "tests/fuzz/fuzz_case.pb.h"

namespace {

namespace v1 = interlock::v1;

void Write(const std::string& dir, int index, const std::string& bytes) {
  std::filesystem::create_directories(dir);
  std::ofstream(absl::StrCat(dir, "/seed-", index), std::ios::binary) << bytes;
}

v1::ConfigureRequest Configure(const char* config, int block, int num_blocks,
                               const interlock::DataShape& shape) {
  v1::ConfigureRequest req;
  req.set_run_id("seed-run");
  req.set_generation(1);
  auto parsed = interlock::ParseRunConfig(config, "seed");
  if (!parsed.ok()) {
    std::cerr << parsed.status() << "\n";
    std::exit(1);
  }
  *req.mutable_config() = *parsed;
  req.set_block(block);
  req.set_num_blocks(num_blocks);
  if (block + 1 < num_blocks) req.set_next_address("127.0.0.1:1");
  interlock::EncodeShape(shape, req.mutable_shape());
  req.set_max_message_bytes(1 << 20);
  return req;
}

v1::DownMessage Forward(int block, int64_t step, int mb, int m,
                        torch::Tensor input, torch::Tensor target) {
  v1::DownMessage d;
  d.mutable_header()->set_run_id("seed-run");
  d.mutable_header()->set_generation(1);
  d.mutable_header()->mutable_route()->set_block(block);
  auto* f = d.mutable_forward();
  f->set_step(step);
  f->set_microbatch(mb);
  f->set_microbatches(m);
  f->set_learning_rate(0.1);
  interlock::EncodeTensor(input, f->mutable_input());
  interlock::EncodeTensor(target, f->mutable_target());
  return d;
}

std::vector<int64_t> WithBatch(int64_t b, std::vector<int64_t> dims) {
  dims.insert(dims.begin(), b);
  return dims;
}

constexpr char kResNet[] = R"pb(
  model {
    resnet { architecture: "8,1/16,1" }
    partition: "2,rest"
    head: "gbpl_fc"
  }
  data {
    kind: SYNTHETIC_IMAGES
    synthetic_shape: [ 3, 8, 8 ]
    synthetic_classes: 4
  }
  training { mode: INTERLOCK n: 2 batch_size: 4 microbatches: 2 }
)pb";

constexpr char kGpt[] = R"pb(
  model {
    transformer { d_model: 16 layers: 2 heads: 2 context: 8 }
    head: "ln_fc"
  }
  data { kind: SYNTHETIC_TEXT }
  training { mode: INTERLOCK n: 1 batch_size: 2 eval_batch_size: 2 }
)pb";

void WorkerSeeds(const std::string& dir) {
  int index = 0;
  interlock::DataShape images;
  images.channels = 3;
  images.height = images.width = 8;
  images.classes = 4;
  auto outs = interlock::BlockOutputShapes(
      interlock::ParseRunConfig(kResNet, "seed")->model(), images);
  if (!outs.ok()) {
    std::cerr << outs.status() << "\n";
    std::exit(1);
  }
  const auto x = torch::rand(WithBatch(2, interlock::SampleShape(images)));
  const auto y = torch::tensor({1, 3}, torch::kInt64);
  for (int block : {0, 1}) {
    interlock::fuzz::FuzzCase c;
    *c.add_ops()->mutable_configure() = Configure(kResNet, block, 2, images);
    const auto input = block == 0 ? x : torch::rand(WithBatch(2, (*outs)[0]));
    for (int mb = 0; mb < 2; ++mb) {
      *c.add_ops()->mutable_down() = Forward(block, 0, mb, 2, input, y);
    }
    if (block == 0) {
      for (int mb = 0; mb < 2; ++mb) {
        auto* up = c.add_ops()->mutable_up()->mutable_upward();
        up->set_step(0);
        up->set_microbatch(mb);
        interlock::EncodeTensor(torch::rand(WithBatch(2, (*outs)[0])),
                                up->add_gradients());
        auto* r = up->add_reports();
        r->set_block(1);
        r->set_loss(1.3);
        r->set_count(2);
      }
    }
    c.add_ops()->mutable_get_state()->set_run_id("seed-run");
    if (block == 0) {
      // The checkpoint calls: the state out, and back in at its step.
      auto* save = c.add_ops()->mutable_save_state();
      save->set_run_id("seed-run");
      save->set_generation(1);
      auto* load = c.add_ops()->mutable_load_state();
      load->mutable_state()->set_run_id("seed-run");
      load->mutable_state()->set_generation(1);
      load->mutable_state()->set_step(1);
      load->set_seal(true);
      load->set_last_saved(true);
    }
    Write(dir, index++, c.SerializeAsString());
  }
  // Evaluation on block 0 of one.
  {
    interlock::fuzz::FuzzCase c;
    auto one = Configure(kResNet, 0, 2, images);
    one.mutable_config()->mutable_model()->set_partition("rest");
    one.set_num_blocks(1);
    one.clear_next_address();
    *c.add_ops()->mutable_configure() = one;
    v1::DownMessage e;
    e.mutable_header()->set_run_id("seed-run");
    e.mutable_header()->set_generation(1);
    e.mutable_eval()->set_batch(0);
    interlock::EncodeTensor(x, e.mutable_eval()->mutable_input());
    interlock::EncodeTensor(y, e.mutable_eval()->mutable_target());
    *c.add_ops()->mutable_down() = e;
    Write(dir, index++, c.SerializeAsString());
  }
  // A Transformer's first block: token inputs.
  {
    interlock::DataShape text;
    text.is_text = true;
    text.classes = 256;
    text.context = 8;
    interlock::fuzz::FuzzCase c;
    *c.add_ops()->mutable_configure() = Configure(kGpt, 0, 1, text);
    const auto tokens = torch::randint(0, 256, {2, 8}, torch::kInt64);
    *c.add_ops()->mutable_down() = Forward(0, 0, 0, 1, tokens, tokens);
    *c.add_ops()->mutable_down() = Forward(0, 1, 0, 1, tokens, tokens);
    Write(dir, index++, c.SerializeAsString());
  }
}

void TensorSeeds(const std::string& dir) {
  int index = 0;
  for (const auto& t : {torch::rand({2, 3}), torch::arange(4, torch::kInt64),
                        torch::zeros({}, torch::kUInt8), torch::zeros({0, 5}),
                        torch::ones({1, 2, 1, 2}, torch::kFloat64),
                        torch::arange(6, torch::kInt32)}) {
    v1::Tensor w;
    interlock::EncodeTensor(t, &w);
    Write(dir, index++, w.SerializeAsString());
  }
  interlock::UpwardMsg m;
  m.step = 3;
  m.mb = 1;
  m.grads = {torch::rand({2, 3}), torch::zeros({2, 3})};
  m.nonfinite = {false, true};
  m.reports.push_back({1, 0.5, 1, 2});
  m.timings.push_back({1, interlock::Phase::kBackward, 0.01});
  interlock::UpFrame up;
  interlock::WireCodec(interlock::Fp32Codec(), interlock::Fp32Codec())
      .EncodeUpward(m, &up);
  Write(dir, index++, interlock::ToProto(up).upward().SerializeAsString());
}

// The codec target's input is a byte choosing the codec (its kChoices:
// bf16, fp16, int8 in blocks of 256, 1 and 7) and a Tensor or UpwardData
// encoded with it.
void CodecSeeds(const std::string& dir) {
  struct Choice {
    v1::WireSpec::Codec codec;
    int block_size;
  } choices[] = {{v1::WireSpec::BF16, 0},
                 {v1::WireSpec::FP16, 0},
                 {v1::WireSpec::INT8_BLOCKWISE, 256},
                 {v1::WireSpec::INT8_BLOCKWISE, 1},
                 {v1::WireSpec::INT8_BLOCKWISE, 7}};
  int index = 0;
  for (int i = 0; i < 5; ++i) {
    auto codec = interlock::CodecFor(choices[i].codec, choices[i].block_size);
    if (!codec.ok()) {
      std::cerr << codec.status() << "\n";
      std::exit(1);
    }
    const std::string pick(1, static_cast<char>(i));
    v1::Tensor w;
    (*codec)->Encode(torch::randn({3, 10}), &w);
    Write(dir, index++, pick + w.SerializeAsString());
    interlock::UpwardMsg m;
    m.grads = {torch::randn({2, 9}), torch::zeros({2, 9})};
    m.nonfinite = {false, true};
    interlock::UpFrame up;
    interlock::WireCodec(interlock::Fp32Codec(), *codec).EncodeUpward(m, &up);
    Write(dir, index++,
          pick + interlock::ToProto(up).upward().SerializeAsString());
  }
}

// The checkpoint reader's input is a tag byte (0: manifest, 1: a block's
// archive) and the bytes; the seeds come from a real checkpoint of the
// target's model (tests/fuzz/checkpoint_model.h).
void CheckpointSeeds(const std::string& dir) {
  auto config =
      interlock::ParseRunConfig(interlock::fuzz::kCheckpointModel, "seed");
  std::vector<std::string> archives;
  for (int block : {0, 1}) {
    auto t = config.ok()
                 ? interlock::BlockTrainer::Create(
                       *config, interlock::fuzz::CheckpointModelShape(), block)
                 : config.status();
    auto a = t.ok() ? (*t)->SaveState(0) : t.status();
    if (!a.ok()) {
      std::cerr << a.status() << "\n";
      std::exit(1);
    }
    archives.push_back(*a);
  }
  const std::string root = dir + "/tmp-checkpoints";
  auto store = interlock::CheckpointStore::Open(root, 1);
  v1::CheckpointManifest m;
  *m.mutable_config() = *config;
  m.set_step(0);
  m.set_total_steps(10);
  auto written = store.ok() ? store->Write(m, archives) : store.status();
  if (!written.ok()) {
    std::cerr << written.status() << "\n";
    std::exit(1);
  }
  std::stringstream manifest;
  manifest << std::ifstream(*written + "/manifest.pbtxt").rdbuf();
  std::filesystem::remove_all(root);
  Write(dir, 0, std::string(1, '\0') + manifest.str());
  Write(dir, 1, std::string(1, '\1') + archives[0]);
  Write(dir, 2, std::string(1, '\1') + archives[1]);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: fuzz_seeds DIR\n";
    return 2;
  }
  torch::manual_seed(1);
  WorkerSeeds(std::string(argv[1]) + "/fuzz_worker_messages");
  TensorSeeds(std::string(argv[1]) + "/fuzz_tensor_decoder");
  CheckpointSeeds(std::string(argv[1]) + "/fuzz_checkpoint_reader");
  CodecSeeds(std::string(argv[1]) + "/fuzz_codec_payload");
  return 0;
}
