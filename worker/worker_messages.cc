// WorkerCore: the messages of the block's streams (from the upstream sink,
// from the link to the next block, and its control stream to the
// coordinator), all on the host's executor.
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "plan/replica_routes.h"
#include "plan/status_macros.h"
#include "services/config.h"
#include "services/failure.h"
#include "services/logging.h"
#include "services/wire_codec.h"
#include "worker/worker_core.h"
#include "worker/worker_run.h"

namespace interlock {

void WorkerCore::Attach(std::shared_ptr<UpstreamSink> sink, int from) {
  std::shared_ptr<UpstreamSink> old;
  {
    std::lock_guard<std::mutex> l(sink_mu_);
    old = std::move(sinks_[from]);
    sinks_[from] = std::move(sink);
  }
  if (old) old->Finish(absl::AbortedError("replaced by a newer stream"));
}

void WorkerCore::Detach(const UpstreamSink* sink) {
  std::lock_guard<std::mutex> l(sink_mu_);
  for (auto it = sinks_.begin(); it != sinks_.end(); ++it) {
    if (it->second.get() == sink) {
      sinks_.erase(it);
      return;
    }
  }
}

void WorkerCore::OpenControl(const v1::ControlRequest& request,
                             std::shared_ptr<ControlSink> sink) {
  host_.Post([this, request, sink = std::move(sink)] {
    absl::Status s =
        CheckRun("control", request.run_id(), request.generation());
    if (!s.ok()) {
      if (run_) run_->metrics->rejected->Increment();
      LOG(WARNING) << "block " << (run_ ? run_->block : -1)
                   << ": control stream refused: " << s;
      sink->Finish(s);
      return;
    }
    VLOG(1) << "block " << run_->block << ": control stream opened";
    std::shared_ptr<ControlSink> old;
    {
      std::lock_guard<std::mutex> l(sink_mu_);
      old = std::move(control_);
      control_ = sink;
    }
    if (old)
      old->Finish(absl::AbortedError("replaced by a newer control stream"));
    v1::ControlEvent opened;
    opened.mutable_opened()->set_block(run_->block);
    sink->Send(std::move(opened));
  });
}

void WorkerCore::CloseControl(const ControlSink* sink) {
  std::lock_guard<std::mutex> l(sink_mu_);
  if (control_.get() == sink) control_.reset();
}

void WorkerCore::OnFirstDown(std::shared_ptr<UpstreamSink> from, DownFrame msg,
                             std::function<void()> accepted) {
  host_.Post([this, from = std::move(from), msg = std::move(msg),
              accepted = std::move(accepted)]() mutable {
    if (!run_) {
      LOG(WARNING) << "stream refused: no block configured";
      from->Finish(absl::FailedPreconditionError(
          "stream: no block configured on this worker"));
      return;
    }
    const auto& h = msg.proto.header();
    // First: a stream that does not carry this generation's key (only the
    // block before and the coordinator were told it) changes nothing,
    // whatever else it names, and learns nothing of the run.
    if (!SameKey(h.stream_key(), run_->stream_key)) {
      run_->metrics->rejected->Increment();
      LOG(WARNING) << "block " << run_->block
                   << ": stream refused: its first message does not carry "
                      "this generation's stream key";
      from->Finish(absl::PermissionDeniedError(
          "stream: not a stream of this block's configured neighbour"));
      return;
    }
    if (h.run_id() != run_->run_id || h.generation() != run_->generation) {
      run_->metrics->rejected->Increment();
      const absl::Status refused = absl::FailedPreconditionError(
          absl::StrCat("stream: the first message names run ",
                       Quoted(h.run_id()), " generation ", h.generation(),
                       ", not the run this worker is configured for"));
      LOG(WARNING) << "block " << run_->block << ": " << refused.message();
      from->Finish(refused);
      return;
    }
    // Streams come from the replicas of block k-1 (the coordinator for
    // block 0: 0), each one at most.
    const int senders = run_->block == 0 ? 1 : run_->microbatches;
    if (h.from_replica() < 0 || h.from_replica() >= senders) {
      run_->metrics->rejected->Increment();
      from->Finish(absl::InvalidArgumentError(
          absl::StrCat("stream: from_replica ", h.from_replica(),
                       " outside [0, ", senders, ")")));
      return;
    }
    // The same run and generation: a reconnect (the coordinator after a
    // broken stream, block k-1 re-opening its link) takes over from the
    // stream of the same sender.
    VLOG(1) << "block " << run_->block << ": stream from replica "
            << h.from_replica() << " of the block before attached";
    Attach(from, h.from_replica());
    accepted();
    ProcessDown(from, std::move(msg));
  });
}

void WorkerCore::OnDown(std::shared_ptr<UpstreamSink> from, DownFrame msg) {
  // Messages are processed even if their stream was replaced meanwhile: they
  // were delivered, and the driver's checks refuse anything stale.
  host_.Post([this, from = std::move(from), msg = std::move(msg)]() mutable {
    ProcessDown(from, std::move(msg));
  });
}

void WorkerCore::OnDownClosed(std::shared_ptr<UpstreamSink> from) {
  host_.Post([from = std::move(from)] { from->Finish(absl::OkStatus()); });
}

void WorkerCore::ProcessDown(const std::shared_ptr<UpstreamSink>& from,
                             DownFrame msg) {
  if (run_) run_->metrics->received_down_bytes->Increment(FrameBytes(msg));
  Run* before = run_.get();
  const int64_t seen = before ? before->nonfinite_seen : 0;
  absl::Status s = HandleDown(msg);
  if (!s.ok()) {
    // A stop by this block's non-finite policy is not a refused message.
    const bool own =
        run_ && run_.get() == before && run_->nonfinite_seen > seen;
    if (run_ && !own) run_->metrics->rejected->Increment();
    from->Finish(s);
  }
}

absl::Status WorkerCore::HandleDown(const DownFrame& msg) {
  if (!run_) {
    return absl::FailedPreconditionError("worker: no block configured");
  }
  const auto& h = msg.proto.header();
  if (h.run_id() != run_->run_id || h.generation() != run_->generation) {
    return absl::FailedPreconditionError(
        absl::StrCat("block ", run_->block, ": message for run ",
                     Quoted(h.run_id()), " generation ", h.generation(),
                     ", not the run this worker is configured for"));
  }
  if (h.route().block() != run_->block ||
      h.route().replica() != run_->replica) {
    return absl::InvalidArgumentError(
        absl::StrCat("block ", run_->block, ": message routed to block ",
                     h.route().block(), " replica ", h.route().replica()));
  }
  if (run_->failed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "block ", run_->block, ": the run failed; reconfigure to continue"));
  }
  switch (msg.proto.kind_case()) {
    case v1::DownMessage::kForward:
      return HandleForward(msg, h.from_replica());
    case v1::DownMessage::kEval:
      return HandleEval(msg);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("block ", run_->block, ": empty down message"));
  }
}

absl::Status WorkerCore::CheckRoutes(const v1::ForwardData& f,
                                     const std::string& where) const {
  const Run& r = *run_;
  return CheckBlockRoutes(
      absl::MakeConstSpan(f.routes().data(), f.routes_size()), r.microbatches,
      r.num_blocks, r.block, r.replicas,
      static_cast<int>(r.next_addresses.size()), where);
}

absl::Status WorkerCore::HandleForward(const DownFrame& msg, int from) {
  const v1::ForwardData& f = msg.proto.forward();
  Run& r = *run_;
  const std::string where = absl::StrCat("block ", r.block, " step ", f.step(),
                                         " micro-batch ", f.microbatch());
  if (f.microbatches() != r.microbatches) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": microbatches ", f.microbatches(),
                     ", the run uses ", r.microbatches));
  }
  if (f.microbatch() < 0 || f.microbatch() >= r.microbatches) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": micro-batch index outside [0, ", r.microbatches, ")"));
  }
  if (f.step() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": negative step"));
  }
  // Before anything changes: a rate LibTorch cannot apply would otherwise
  // fail the block's optimizer step, and every step after it.
  RETURN_IF_ERROR(CheckLearningRate(f.learning_rate(), where));
  RETURN_IF_ERROR(CheckRoutes(f, where));
  if (r.driver->Seen(f.step(), f.microbatch())) {
    // A repeat (a coordinator resending after a broken stream): applying
    // it again would count its gradient twice. Acknowledge it instead.
    v1::ControlEvent ack;
    ack.mutable_duplicate()->set_block(r.block);
    ack.mutable_duplicate()->set_step(f.step());
    ack.mutable_duplicate()->set_microbatch(f.microbatch());
    SendControl(std::move(ack));
    return absl::OkStatus();
  }
  // What the run's window allows to be queued (see DoConfigure); more is
  // a client growing the worker's memory.
  const int64_t current = r.driver->current_step();
  if (f.step() > current + r.max_steps_ahead) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": more than ", r.max_steps_ahead,
                     " steps ahead of the block (at step ", current, ", with ",
                     r.window, " micro-batches in flight)"));
  }
  // The forward the block runs next is always taken: it drains the queue.
  const std::vector<int32_t> routes(f.routes().begin(), f.routes().end());
  if (!r.driver->RunsNext(f.step(), f.microbatch(), routes) &&
      static_cast<int64_t>(r.driver->queued()) >= r.max_queued) {
    return absl::ResourceExhaustedError(absl::StrCat(
        where, ": ", r.driver->queued(),
        " forwards already wait for their turn, the most a window of ",
        r.window, " micro-batches allows"));
  }
  ASSIGN_OR_RETURN(ForwardMsg m,
                   r.codec.DecodeForward(msg, where, options_.limits));
  RETURN_IF_ERROR(ExpectTensor(m.input, r.input_dtype,
                               WithBatch(r.mb_size, r.sample_shape),
                               where + " input"));
  if (!m.input_finite) {
    RETURN_IF_ERROR(r.CheckFinite(m.input, where + " input"));
  }
  RETURN_IF_ERROR(ExpectTensor(m.target, torch::kInt64,
                               WithBatch(r.mb_size, r.target_shape),
                               where + " target"));
  if (m.target.numel() > 0 && (m.target.min().item<int64_t>() < 0 ||
                               m.target.max().item<int64_t>() >= r.classes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": target values outside [0, ", r.classes, ")"));
  }
  r.senders[{f.step(), f.microbatch()}] = from;
  absl::Status s = r.driver->OnForward(std::move(m));
  if (!s.ok() && run_.get() == &r) r.senders.erase({f.step(), f.microbatch()});
  r.SyncNonFinite();
  return s;
}

absl::Status WorkerCore::HandleEval(const DownFrame& msg) {
  const v1::EvalData& e = msg.proto.eval();
  Run& r = *run_;
  const std::string where =
      absl::StrCat("block ", r.block, " eval batch ", e.batch());
  ASSIGN_OR_RETURN(EvalMsg m, r.codec.DecodeEval(msg, where, options_.limits));
  const int64_t b = m.input.dim() > 0 ? m.input.size(0) : 0;
  if (b < 1 || b > r.eval_batch) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": batch of ", b, " samples, expected 1..", r.eval_batch));
  }
  RETURN_IF_ERROR(ExpectTensor(m.input, r.input_dtype,
                               WithBatch(b, r.sample_shape), where + " input"));
  if (!m.input_finite) {
    RETURN_IF_ERROR(r.CheckFinite(m.input, where + " input"));
  }
  RETURN_IF_ERROR(ExpectTensor(m.target, torch::kInt64,
                               WithBatch(b, r.target_shape),
                               where + " target"));
  ASSIGN_OR_RETURN(EvalResult res, host_.Evaluate(m, where));
  v1::ControlEvent up;
  const bool head = !res.loss.empty();
  const EvalReport report{m.batch,
                          r.block,
                          head,
                          head ? res.loss[0] : 0.0,
                          head ? res.correct[0] : 0,
                          res.count};
  r.codec.EncodeEvalResult(report, up.mutable_eval());
  SendControl(std::move(up));
  if (r.block + 1 < r.num_blocks) {
    DownFrame down;
    SetHeader(r.run_id, r.generation, r.block + 1, r.next_stream_key,
              &down.proto);
    m.input = std::move(res.output);
    m.nonfinite = res.output_nonfinite;
    r.codec.EncodeEval(m, &down);
    // Replicas hold the same parameters between steps: the first evaluates.
    down.proto.mutable_header()->set_from_replica(r.replica);
    SendDown(0, std::move(down));
  }
  return absl::OkStatus();
}

void WorkerCore::HandleUp(uint64_t link_id, UpFrame msg) {
  if (!run_) return;
  const int from = run_->LinkReplica(link_id);
  if (from < 0) return;  // an old run's link
  Run& r = *run_;
  r.metrics->received_up_bytes->Increment(FrameBytes(msg));
  bool own_failure = false;
  absl::Status s = [&]() -> absl::Status {
    if (msg.proto.kind_case() != v1::UpMessage::kUpward) {
      return absl::InvalidArgumentError(absl::StrCat(
          "block ", r.block, ": empty up message from block ", r.block + 1));
    }
    ASSIGN_OR_RETURN(UpwardMsg up, r.codec.DecodeUpward(msg, options_.limits));
    for (size_t i = 0; i < up.grads.size(); ++i) {
      const std::string what =
          absl::StrCat("block ", r.block, " step ", up.step, " micro-batch ",
                       up.mb, " gradient ", i, " from block ", r.block + 1);
      RETURN_IF_ERROR(ExpectTensor(up.grads[i], torch::kFloat32,
                                   WithBatch(r.mb_size, r.output_shape), what));
      if (!up.grads_finite) RETURN_IF_ERROR(r.CheckFinite(up.grads[i], what));
    }
    const int64_t before = r.driver->trainer().nonfinite_count();
    absl::Status st = r.driver->OnUpward(std::move(up));
    r.SyncNonFinite();
    if (!st.ok() && r.driver->trainer().nonfinite_count() > before) {
      own_failure = true;  // this block's policy stopped the run
    }
    return st;
  }();
  if (!s.ok() && own_failure) {
    FailRun(r.block, "", s);
  } else if (!s.ok()) {
    r.metrics->rejected->Increment();
    FailRun(r.block + 1, r.next_addresses[from], s);
  }
}

void WorkerCore::HandleLinkDone(uint64_t link_id, absl::Status status) {
  if (!run_ || run_->failed) return;
  const int to = run_->LinkReplica(link_id);
  if (to < 0) return;
  if (ReportedFailure(status)) {
    // A block below reported it to the coordinator itself: stop, and pass
    // the mark on so that no block above blames its own neighbour.
    run_->failed = true;
    EndUpstream(status);
    return;
  }
  if (status.ok()) {
    status = absl::UnavailableError("stream to the next block ended");
  }
  FailRun(run_->block + 1, run_->next_addresses[to], status);
}

void WorkerCore::FailRun(int block, const std::string& address,
                         const absl::Status& s) {
  // Logged here, on the side that saw it, as well as reported.
  LOG(ERROR) << "run " << (run_ ? run_->run_id : std::string("(none)"))
             << " block " << (run_ ? run_->block : -1) << ": the link to block "
             << block << " at " << address << " failed: " << s;
  if (run_) run_->failed = true;
  v1::ControlEvent event;
  auto* f = event.mutable_failure();
  f->set_block(block);
  f->set_address(address);
  f->set_code(static_cast<int>(s.code()));
  f->set_message(std::string(s.message()));
  const absl::Status reported = ReportedStatus(*f);
  SendControl(std::move(event));
  EndUpstream(reported);
}

void WorkerCore::EndUpstream(const absl::Status& s) {
  std::map<int, std::shared_ptr<UpstreamSink>> sinks;
  {
    std::lock_guard<std::mutex> l(sink_mu_);
    sinks = sinks_;
  }
  for (auto& [from, sink] : sinks) sink->Finish(s);
}

void WorkerCore::SendUp(int64_t step, int mb, bool final, UpFrame msg) {
  int from = 0;
  if (run_) {
    auto it = run_->senders.find({step, mb});
    if (it != run_->senders.end()) {
      from = it->second;
      if (final) run_->senders.erase(it);
    }
  }
  std::shared_ptr<UpstreamSink> sink;
  {
    std::lock_guard<std::mutex> l(sink_mu_);
    auto it = sinks_.find(from);
    if (it != sinks_.end()) sink = it->second;
  }
  if (!sink) return;  // nobody upstream: the coordinator will notice
  if (run_) run_->metrics->sent_up_bytes->Increment(FrameBytes(msg));
  sink->Send(msg);
}

void WorkerCore::SendControl(v1::ControlEvent event) {
  std::shared_ptr<ControlSink> sink;
  {
    std::lock_guard<std::mutex> l(sink_mu_);
    sink = control_;
  }
  if (!sink) return;
  if (run_) run_->metrics->sent_control_bytes->Increment(event.ByteSizeLong());
  sink->Send(std::move(event));
}

void WorkerCore::SendDown(int replica, DownFrame msg) {
  Run& r = *run_;
  Run::Link& link = r.links[replica];
  if (!link.link) {
    const uint64_t id = next_link_id_++;
    link.id = id;
    link.link = link_factory_(
        r.next_addresses[replica], r.max_message_bytes,
        [this, id](UpFrame m) {
          host_.Post([this, id, m = std::move(m)]() mutable {
            HandleUp(id, std::move(m));
          });
        },
        [this, id](absl::Status s) {
          host_.Post([this, id, s] { HandleLinkDone(id, s); });
        });
  }
  r.metrics->sent_down_bytes->Increment(FrameBytes(msg));
  link.link->Send(msg);
}

}  // namespace interlock
