#include "dist/pipeline.h"

#include <algorithm>
#include <utility>

#include "core/error.h"

namespace tuna {

std::vector<PipelineOp> pipeline_schedule(int64_t pp, int64_t stage, int64_t micro_batches) {
  TUNA_CHECK(pp >= 1 && stage >= 0 && stage < pp && micro_batches >= 0, "pipeline schedule of stage ", stage, " of ",
             pp, " over ", micro_batches, " micro-batches");
  const int64_t warmup = std::min(pp - stage - 1, micro_batches), steady = micro_batches - warmup;
  std::vector<PipelineOp> ops;
  for (int64_t i = 0; i < warmup; i++) ops.push_back({true, i});
  for (int64_t i = 0; i < steady; i++) ops.push_back({true, warmup + i}), ops.push_back({false, i});
  for (int64_t i = steady; i < micro_batches; i++) ops.push_back({false, i});
  return ops;
}

bool pipeline_gradient_ahead(int64_t pp, int64_t stage, int64_t micro_batches) {
  return stage < pp - 1 && micro_batches > pp - stage - 1;
}

PipelineLinks pipeline_links(const ParamLayout& stage_layout, bool tie_word_embeddings, bool frozen, int stage,
                             int stages) {
  PipelineLinks links;
  links.recv_activations = str("stage ", stage, ": activations from stage ", stage - 1);
  links.send_activations = str("stage ", stage, ": activations to stage ", stage + 1);
  links.recv_gradient = str("stage ", stage, ": input gradient from stage ", stage + 1);
  links.send_gradient = str("stage ", stage, ": input gradient to stage ", stage - 1);
  links.tied_exchange = str("stage ", stage, ": the tied embedding's gradient");
  const ParamTensor* tied = stage_layout.tied_copy();
  if (!tied && tie_word_embeddings && stage_layout.has_embedding()) tied = stage_layout.find("model.embed_tokens.weight");
  if (tied && !frozen) links.tied = tied, links.tied_peer = tied->copy ? 0 : stages - 1;
  return links;
}

PipelineDriver::PipelineDriver(Comm& stages, PipelineStageModel& stage, PipelineLinks links)
    : comm_(stages), stage_(stage), links_(std::move(links)) {}

LossSum PipelineDriver::step(const std::vector<MicroBatch>& micro_batches) {
  Comm& pp = comm_;
  const int s = pp.rank(), last = pp.size() - 1;
  const CommType wire = stage_.wire_type();
  CommRequest activations_sent = 0, gradient_sent = 0, gradient_posted = 0;
  std::vector<CommRequest> waited_last_pass, waited_this_pass;  // owed their bounded host wait (see the top)
  const auto compute_waits = [&](CommRequest& r) {  // the compute waits for r; the host, if it still must, later
    if (!r) return;
    if (const CommRequest owed = stage_.compute_waits_for(pp, r)) waited_this_pass.push_back(owed);
    r = 0;
  };
  const auto host_wait = [&](std::vector<CommRequest>& requests) {
    for (CommRequest r : requests) pp.wait(r);
    requests.clear();
  };
  LossSum loss;
  const int64_t m = static_cast<int64_t>(micro_batches.size());
  const std::vector<PipelineOp> ops = pipeline_schedule(pp.size(), s, m);
  // Only with a steady phase (see the top of dist/pipeline.h), and where the stage computes on a queue of its own.
  const bool ahead = stage_.receives_gradient_ahead() && pipeline_gradient_ahead(pp.size(), s, m);
  for (size_t i = 0; i < ops.size(); i++) {
    const PipelineOp& op = ops[i];
    const MicroBatch& b = micro_batches[op.micro_batch];
    const int64_t slot = op.micro_batch % stage_.in_flight();
    stage_.begin_pass(op.micro_batch);
    const int64_t count = stage_.boundary_elements(b);
    host_wait(waited_last_pass);  // the pass below waits for the previous pass's upload (see the top)
    if (op.forward) {
      if (s > 0) {
        stage_.before_transfer();  // the backward that last read this slot
        CommRequest r = pp.recv_start(stage_.input(slot), count, wire, s - 1, links_.recv_activations.c_str());
        pp.flush();
        compute_waits(r);
      }
      compute_waits(activations_sent);  // this forward rewrites output()
      if (ahead && i + 1 < ops.size() && !ops[i + 1].forward) {  // the next backward's gradient, posted ahead
        const MicroBatch& next = micro_batches[ops[i + 1].micro_batch];
        stage_.before_transfer();  // the backward before, which read output_grad() (the first stage sends nothing
                                   // after it)
        gradient_posted = pp.recv_start(stage_.output_grad(), stage_.boundary_elements(next), wire, s + 1,
                                        links_.recv_gradient.c_str());
        pp.flush();
      }
      if (s == last) host_wait(waited_this_pass);  // the forward below waits for its loss on the host
      const LossSum l = stage_.forward(slot, b, /*backward_follows=*/true);
      loss.sum += l.sum, loss.count += l.count;
      if (s < last) {
        stage_.before_transfer();
        activations_sent = pp.send_start(stage_.output(), count, wire, s + 1, links_.send_activations.c_str());
        pp.flush();
      }
    } else {
      compute_waits(gradient_sent);  // the receive below and this backward rewrite input_grad()
      if (s < last) {
        if (!gradient_posted) stage_.before_transfer();
        CommRequest r = gradient_posted ? gradient_posted
                                        : pp.recv_start(stage_.output_grad(), count, wire, s + 1,
                                                        links_.recv_gradient.c_str());
        gradient_posted = 0;
        pp.flush();
        compute_waits(r);
      }
      stage_.backward(slot, b);
      if (s > 0) {
        stage_.before_transfer();
        gradient_sent = pp.send_start(stage_.input_grad(), count, wire, s - 1, links_.send_gradient.c_str());
        pp.flush();
      }
    }
    waited_last_pass.swap(waited_this_pass);
  }
  // Every request is waited for once: those the compute waited on above, then the last sends.
  host_wait(waited_last_pass);
  if (activations_sent) pp.wait(activations_sent);
  if (gradient_sent) pp.wait(gradient_sent);
  exchange_tied_gradient();
  return loss;
}

// Both sides start their send before receiving, so the exchange cannot wait on itself; the gradient of the table is
// fp32 whatever the activations' wire type.
void PipelineDriver::exchange_tied_gradient() {
  if (links_.tied == nullptr) return;
  const int64_t n = links_.tied->numel;
  float* mine = stage_.gradients() + links_.tied->offset;  // zero when no micro-batch ran
  float* theirs = stage_.tied_peer_gradient();
  stage_.before_transfer();
  const CommRequest sent = comm_.send_start(mine, n, CommType::F32, links_.tied_peer, links_.tied_exchange.c_str());
  comm_.recv(theirs, n, CommType::F32, links_.tied_peer, links_.tied_exchange.c_str());
  comm_.wait(sent);
  stage_.add_tied_peer_gradient(mine, theirs, n);
}

LossSum PipelineDriver::forward_loss(const MicroBatch& b) {
  LossSum loss;
  forward_pass(b, [&] { loss = stage_.forward(0, b, /*backward_follows=*/false); });
  return loss;
}

void PipelineDriver::forward_pass(const MicroBatch& b, const std::function<void()>& compute) {
  const int s = comm_.rank(), last = comm_.size() - 1;
  const int64_t count = stage_.boundary_elements(b);
  if (s > 0) {
    stage_.before_transfer();  // the last pass that read input(0)
    comm_.recv(stage_.input(0), count, stage_.wire_type(), s - 1, links_.recv_activations.c_str());
  }
  compute();
  if (s < last) {
    stage_.before_transfer();
    comm_.send(stage_.output(), count, stage_.wire_type(), s + 1, links_.send_activations.c_str());
  }
}

}  // namespace tuna
