// libFuzzer target: a worker's message handling in process, no network. The
// input is a FuzzCase: Configure requests, messages on the incoming stream,
// messages from the next block's link, GetState, SaveState and LoadState
// calls, fed to one WorkerCore in order. Whatever the input, the worker must
// answer with a status and keep serving: no crash, no sanitizer report, no
// hang. Stream messages go through the frame parser a worker's stream
// reads them with (services/wire_frame.h), in pieces of the size the case
// gives, as they would arrive.
#include <google/protobuf/stubs/logging.h>

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>

#include "services/digest.h"
#include "tests/fuzz/fuzz_case.pb.h"
#include "tests/fuzz/received.h"
#include "worker/metrics.h"
#include "worker/worker_core.h"

namespace {

namespace v1 = interlock::v1;

// The incoming stream's upstream end: keeps what the worker sends up.
class Sink : public interlock::UpstreamSink {
 public:
  void Send(const interlock::UpFrame& msg) override {
    std::lock_guard<std::mutex> l(mu_);
    ++sent_;
  }
  void Finish(const absl::Status& status) override {
    std::lock_guard<std::mutex> l(mu_);
    finished_ = true;
  }

 private:
  std::mutex mu_;
  int sent_ = 0;
  bool finished_ = false;
};

// The link to block k+1: swallows what goes down, lets the harness answer.
struct Link : interlock::DownstreamLink {
  void Send(const interlock::DownFrame& msg) override {}
  void Close() override {}
};

// Runs `call` with a callback and waits until the core answered.
template <typename Result, typename Call>
Result Await(Call call) {
  std::mutex m;
  std::condition_variable cv;
  std::optional<Result> result;
  call([&](Result r) {
    std::lock_guard<std::mutex> l(m);
    result = std::move(r);
    cv.notify_all();
  });
  std::unique_lock<std::mutex> l(m);
  cv.wait(l, [&] { return result.has_value(); });
  return *std::move(result);
}

struct Harness {
  Harness()
      : core(Options(), &metrics,
             [this](const std::string&, int64_t,
                    std::function<void(interlock::UpFrame)> on_message,
                    std::function<void(absl::Status)> on_done) {
               std::lock_guard<std::mutex> l(mu);
               from_below = std::move(on_message);
               return std::make_unique<Link>();
             }) {}

  static interlock::WorkerOptions Options() {
    interlock::WorkerOptions o;
    o.max_message_bytes = 1 << 20;
    return o;
  }

  // Waits until everything posted to the executor so far has run (it is
  // one FIFO thread; GetState answers in order).
  void Drain(const v1::GetStateRequest& request = {}) {
    (void)Await<absl::StatusOr<v1::GetStateResponse>>(
        [&](auto done) { core.GetState(request, done); });
  }

  interlock::WorkerMetrics metrics;
  std::mutex mu;
  std::function<void(interlock::UpFrame)> from_below;
  interlock::WorkerCore core;
};

// Model and data sizes are an authenticated coordinator's choice and are
// bounded by the pod's memory, not by the worker: keep them small so the
// fuzzer spends its time on the message checks.
void Clamp(v1::ConfigureRequest* req) {
  auto clamp = [](auto v, decltype(v) hi) { return std::min(v, hi); };
  auto* shape = req->mutable_shape();
  shape->set_channels(clamp(shape->channels(), 4));
  shape->set_height(clamp(shape->height(), 12));
  shape->set_width(clamp(shape->width(), 12));
  shape->set_classes(clamp(shape->classes(), 16));
  shape->set_context(clamp(shape->context(), 16));
  auto* model = req->mutable_config()->mutable_model();
  model->set_blocks(clamp(model->blocks(), 4));
  if (model->has_resnet()) {
    model->mutable_resnet()->set_architecture(
        model->resnet().architecture().substr(0, 16));
    model->mutable_resnet()->set_stem_planes(
        clamp(model->resnet().stem_planes(), 16));
  }
  if (model->has_transformer()) {
    auto* t = model->mutable_transformer();
    t->set_d_model(clamp(t->d_model(), 32));
    t->set_layers(clamp(t->layers(), 4));
    t->set_heads(clamp(t->heads(), 4));
    t->set_d_ff(clamp(t->d_ff(), 64));
    t->set_context(clamp(t->context(), 16));
  }
  if (model->has_mlp()) {
    auto* m = model->mutable_mlp();
    while (m->hidden_size() > 4) m->mutable_hidden()->RemoveLast();
    for (int i = 0; i < m->hidden_size(); ++i) {
      m->set_hidden(i, clamp(m->hidden(i), 64));
    }
  }
  model->set_head(model->head().substr(0, 32));
  auto* data = req->mutable_config()->mutable_data();
  while (data->synthetic_shape_size() > 3) {
    data->mutable_synthetic_shape()->RemoveLast();
  }
  for (int i = 0; i < data->synthetic_shape_size(); ++i) {
    data->set_synthetic_shape(i, clamp(data->synthetic_shape(i), 12));
  }
  auto* t = req->mutable_config()->mutable_training();
  t->set_batch_size(clamp(t->batch_size(), 16));
  t->set_eval_batch_size(clamp(t->eval_batch_size(), 16));
  t->set_microbatches(clamp(t->microbatches(), 4));
  t->set_threads_per_block(1);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Inputs that fail to parse are expected; their log lines are noise.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Harness* h = new Harness();  // one worker for the whole session
  static std::string last_saved;      // the last archive SaveState gave
  interlock::fuzz::FuzzCase input;
  if (!input.ParseFromArray(data, static_cast<int>(size))) return 0;
  auto sink = std::make_shared<Sink>();
  h->core.Attach(sink);
  int ops = 0;
  for (auto& op : *input.mutable_ops()) {
    if (++ops > 12) break;
    switch (op.kind_case()) {
      case interlock::fuzz::Op::kConfigure: {
        Clamp(op.mutable_configure());
        (void)Await<absl::StatusOr<v1::ConfigureResponse>>(
            [&](auto done) { h->core.Configure(op.configure(), done); });
        break;
      }
      case interlock::fuzz::Op::kDown: {
        auto frame = interlock::ParseDownFrame(
            interlock::fuzz::Received(op.down().SerializeAsString(), ops * 7));
        // Unknown groups kept from the input are refused; nothing else.
        if (frame.ok()) h->core.OnDown(sink, *std::move(frame));
        h->Drain();
        break;
      }
      case interlock::fuzz::Op::kUp: {
        std::function<void(interlock::UpFrame)> deliver;
        {
          std::lock_guard<std::mutex> l(h->mu);
          deliver = h->from_below;
        }
        auto frame = interlock::ParseUpFrame(
            interlock::fuzz::Received(op.up().SerializeAsString(), ops * 5));
        if (deliver && frame.ok()) deliver(*std::move(frame));
        h->Drain();
        break;
      }
      case interlock::fuzz::Op::kGetState:
        h->Drain(op.get_state());
        break;
      case interlock::fuzz::Op::kSaveState: {
        auto saved = Await<absl::StatusOr<interlock::BlockStateArchive>>(
            [&](auto done) { h->core.SaveState(op.save_state(), done); });
        if (saved.ok()) last_saved = std::move(saved->bytes);
        break;
      }
      case interlock::fuzz::Op::kLoadState: {
        const auto& in = op.load_state();
        interlock::BlockStateArchive a;
        a.run_id = in.state().run_id();
        a.generation = in.state().generation();
        a.block = in.state().block();
        a.step = in.state().step();
        a.bytes = in.last_saved() ? last_saved : in.state().data();
        a.sha256 = in.seal()
                       ? interlock::Sha256Hex(a.bytes.data(), a.bytes.size())
                       : in.state().sha256();
        (void)Await<absl::StatusOr<int64_t>>(
            [&](auto done) { h->core.LoadState(std::move(a), done); });
        break;
      }
      default:
        break;
    }
  }
  h->core.Detach(sink.get());
  return 0;
}
