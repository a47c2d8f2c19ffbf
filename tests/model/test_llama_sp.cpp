// Sequence parallelism (LlamaParallel::sequence) against tensor parallelism alone, the tp ranks as threads of this
// process (comm/comm_local.cpp). Each rank runs both models on the same weights and the same two micro-batches
// (accumulated: the norm weights' gradients are summed over tp once per micro-batch, not once per accumulated
// total), and each rank's loss and every gradient tensor must agree. What differs is only the order of fp32 sums:
// a norm weight's gradient is two ranks' partial sums added, where tp alone sums every row in one loop. A missing
// or doubled reduction, a row gathered from the wrong rank or a residual added twice moves a gradient by tens of
// percents; the bound is 1e-5 (relative error norm per tensor).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "core/error.h"  // str
#include "kernels/cpu/classifier.h"  // kIgnoreIndex
#include "model/llama.h"

namespace tuna {
namespace {

constexpr double kTol = 1e-5;

struct SpCase {
  std::string model;  // tests/fixtures/<model>
  int tp;
  int64_t batch, seq;  // the first micro-batch (the planned maximum); the second is smaller
  bool documents;      // packed windows with document boundaries (mask and restarted positions)
  bool lora;           // adapters on every projection, with dropout, on the frozen base
};

struct Batch {
  int64_t batch, seq;
  std::vector<int32_t> inputs, targets, positions;
};

Batch make_batch(int64_t batch, int64_t seq, int64_t vocab, bool documents, uint32_t seed) {
  std::mt19937 rng(seed);
  Batch b{batch, seq, {}, {}, {}};
  for (int64_t i = 0; i < batch * seq; i++) {
    b.inputs.push_back(static_cast<int32_t>(rng() % vocab));
    b.targets.push_back(rng() % 5 == 0 ? cpu::kIgnoreIndex : static_cast<int32_t>(rng() % vocab));
  }
  if (documents)
    for (int64_t r = 0; r < batch; r++) {
      int32_t pos = 0;
      for (int64_t t = 0; t < seq; t++, pos++) {
        if (t > 0 && rng() % 4 == 0) pos = 0;  // a document starts here
        b.positions.push_back(pos);
      }
    }
  return b;
}

double rel_err(const float* a, const float* ref, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; i++) num += double(a[i] - ref[i]) * (a[i] - ref[i]), den += double(ref[i]) * ref[i];
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Returns the rank's failures as text (EXPECT_* is not for threads other than the test's).
std::string run_rank(const SpCase& k, Comm& tp) {
  const LlamaConfig cfg = LlamaConfig::load("tests/fixtures/" + k.model + "/config.json");
  LoraConfig lora;
  if (k.lora) lora.rank = 4, lora.alpha = 8, lora.dropout = 0.25;
  LlamaParallel with_sp{&tp};
  with_sp.sequence = true;
  Llama plain(cfg, k.batch, k.seq, LlamaParallel{&tp}, lora), sp(cfg, k.batch, k.seq, with_sp, lora);
  std::string out;
  if (sp.activation_bytes() >= plain.activation_bytes())
    out += str("sp plans ", sp.activation_bytes(), " activation bytes, tp alone ", plain.activation_bytes(), "\n");
  plain.init_random(7);
  sp.params = plain.params;
  if (k.lora) {  // adapters drawn whole and cut per rank (B non-zero, so that every adapter gradient is)
    init_random_weights(plain.lora_layout().params, 9, 0.2, plain.lora_params.data());
    sp.lora_params = plain.lora_params;
  }
  const Batch batches[2] = {make_batch(k.batch, k.seq, cfg.vocab_size, k.documents, 3),
                            make_batch(std::max<int64_t>(1, k.batch - 1), k.seq - 2, cfg.vocab_size, k.documents, 4)};
  for (int i = 0; i < 2; i++) {
    const Batch& b = batches[i];
    const int32_t* pos = k.documents ? b.positions.data() : nullptr;
    plain.set_lora_dropout_key(100 + i), sp.set_lora_dropout_key(100 + i);
    const LossSum lp = plain.forward_backward(b.inputs.data(), b.targets.data(), b.batch, b.seq, pos);
    const LossSum ls = sp.forward_backward(b.inputs.data(), b.targets.data(), b.batch, b.seq, pos);
    if (lp.count != ls.count || std::abs(lp.sum - ls.sum) > kTol * std::abs(lp.sum))
      out += str("micro-batch ", i, ": loss ", ls.sum, " over ", ls.count, ", tp alone ", lp.sum, " over ", lp.count, "\n");
    const LossSum ep = plain.forward_loss(b.inputs.data(), b.targets.data(), b.batch, b.seq, pos);
    const LossSum es = sp.forward_loss(b.inputs.data(), b.targets.data(), b.batch, b.seq, pos);
    if (std::abs(ep.sum - es.sum) > kTol * std::abs(ep.sum))
      out += str("micro-batch ", i, ": forward_loss ", es.sum, ", tp alone ", ep.sum, "\n");
  }
  const ParamLayout& layout = k.lora ? plain.lora_layout().params : plain.layout();
  const std::vector<float>& gp = k.lora ? plain.lora_grads : plain.grads;
  const std::vector<float>& gs = k.lora ? sp.lora_grads : sp.grads;
  for (const ParamTensor& t : layout.tensors()) {
    const double e = rel_err(gs.data() + t.offset, gp.data() + t.offset, t.numel);
    if (!(e < kTol)) out += str(t.name, ": gradient ", e, " from tp alone's\n");
  }
  return out;
}

void expect_sp_matches_tp(const SpCase& k) {
  std::vector<std::unique_ptr<Comm>> comms = make_local_comms(k.tp, 60);
  std::vector<std::string> failures(k.tp);
  std::vector<std::thread> threads;
  for (int r = 0; r < k.tp; r++)
    threads.emplace_back([&, r] {
      try {
        failures[r] = run_rank(k, *comms[r]);
      } catch (const std::exception& e) {
        failures[r] = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < k.tp; r++) EXPECT_EQ(failures[r], "") << k.model << " tp " << k.tp << " rank " << r;
}

// 21 rows over 2 ranks (11 + 10, then 3 x 5 = 15: 8 + 7): odd counts; the tied embedding and GQA.
TEST(LlamaSequenceParallel, FollowsTpTiedWithDocuments) { expect_sp_matches_tp({"llama32_tiny", 2, 3, 7, true, false}); }
TEST(LlamaSequenceParallel, FollowsTpUntied) { expect_sp_matches_tp({"llama2_tiny", 2, 2, 8, false, false}); }
// 9 rows over 4 ranks: 3, 3, 3 and none; then 7 rows: 2, 2, 2, 1.
TEST(LlamaSequenceParallel, FollowsTpWithEmptyRank) { expect_sp_matches_tp({"llama2_tiny", 4, 1, 9, true, false}); }
// Adapters: a row-parallel adapter adds its output to this rank's rows only.
TEST(LlamaSequenceParallel, FollowsTpWithLora) { expect_sp_matches_tp({"llama32_tiny", 2, 2, 9, true, true}); }

TEST(LlamaSequenceParallel, BufferSizesDivideTheNormAndResidualRegions) {
  const LlamaConfig cfg = LlamaConfig::load("tests/fixtures/llama2_tiny/config.json");
  const ParamLayout layout(cfg, 0, 4);
  const LlamaBufferSizes plain = llama_buffer_sizes(cfg, layout.tp(), 2, 9, {}, false);
  const LlamaBufferSizes sp = llama_buffer_sizes(cfg, layout.tp(), 2, 9, {}, true);
  const int64_t C = cfg.hidden_size;
  EXPECT_EQ(plain.local_rows, 18);
  EXPECT_EQ(sp.local_rows, 5);  // ceil(18 / 4)
  // resid_in, norm1, resid_mid, norm2 and the two rstd: 13 rows fewer each.
  EXPECT_EQ(plain.kept_per_layer - sp.kept_per_layer, (18 - 5) * (4 * C + 2));
  EXPECT_EQ(plain.final_norm - sp.final_norm, (18 - 5) * (2 * C + 1));
  EXPECT_EQ(sp.sequence, 4 * 5 * C + 2 * C);
  EXPECT_EQ(plain.sequence, 0);
}

}  // namespace
}  // namespace tuna
