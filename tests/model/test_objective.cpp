// model/objective and model/preference_step against TRL 0.13.0 (tests/fixtures/preference_*, made by
// tools/reference/make_preference_fixtures.py in float64): for DPO (sigmoid, ipo, hinge; rpo_alpha), SimPO and ORPO
// on a tiny LLaMA and a tied GQA LLaMA, and DPO with LoRA (the base as the reference): the loss, TRL's metrics,
// d loss / d each sequence's log-prob, every gradient and 10 AdamW steps; and packed pairs against pairs one at a
// time (the oracle of packing).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "comm/comm.h"
#include "ckpt/checkpoint.h"  // load_weights
#include "ckpt/peft.h"        // read_peft_adapter_config
#include "ckpt/safetensors.h"
#include "core/error.h"
#include "kernels/cpu/classifier.h"  // kIgnoreIndex
#include "model/llama.h"
#include "model/objective.h"
#include "model/optimizer.h"
#include "model/preference_step.h"
#include "data/reference_logps.h"
#include "data/shard.h"
#include "tests/data/data_test_util.h"
#include "tests/model/fixture.h"
#include "tests/model/preference_test_util.h"  // PackedPairs, pack, PreferenceFixture, config_of

namespace tuna {
namespace {

namespace fs = std::filesystem;
using testing_util::Fixture;
using testing_util::config_of;
using testing_util::pack;
using testing_util::PackedPairs;
using testing_util::PreferenceFixture;

// The loss, TRL's metrics and d loss / d each sequence's log-prob, from TRL's per-sequence log-probs alone.
TEST(Objective, LossMetricsAndSequenceGradientsFollowTrl) {
  for (const char* base : {"llama2_tiny", "llama32_tiny"}) {
    PreferenceFixture fx(base);
    for (const auto& [name, c] : fx.cases().items()) {
      SCOPED_TRACE(std::string(base) + " " + name);
      const ObjectiveConfig config = config_of(c);
      const size_t P = c.at("policy_chosen_logps").size();
      std::vector<PairLogps> pairs(P);
      for (size_t p = 0; p < P; ++p) {
        const auto& pr = fx.meta.at("pairs")[p];
        pairs[p].chosen = c.at("policy_chosen_logps")[p];
        pairs[p].rejected = c.at("policy_rejected_logps")[p];
        pairs[p].chosen_tokens = static_cast<int64_t>(pr.at("chosen").size());
        pairs[p].rejected_tokens = static_cast<int64_t>(pr.at("rejected").size());
        pairs[p].ref_chosen = c.at("ref_chosen_logps")[p];
        pairs[p].ref_rejected = c.at("ref_rejected_logps")[p];
      }
      // The NLL term as TRL reports it (a token mean): one token here, so the sums are that mean.
      const double nll = c.at("metrics").value("nll_loss", 0.0);
      std::vector<PairGrad> grads(P);
      const PreferenceStep step{static_cast<int64_t>(P), 1};
      const PreferenceSums s = preference_loss(config, pairs, nll, 1, step, grads, nullptr);
      const double n = static_cast<double>(P);
      EXPECT_NEAR(s.loss / n, c.at("loss").get<double>(), 1e-12 * std::max(1.0, std::abs(c.at("loss").get<double>())));
      const nlohmann::json m = metrics_json(s, config);
      for (const char* key : {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                              "logps/chosen", "logps/rejected"}) {
        const double want = c.at("metrics").at(key);
        // TRL takes the accuracies' mean over a float tensor: float32's rounding of k / 3.
        const double tol = std::string(key) == "rewards/accuracies" ? 1e-7 : 1e-12 * std::max(1.0, std::abs(want));
        EXPECT_NEAR(m.at(key).get<double>(), want, tol) << key;
      }
      for (size_t p = 0; p < P; ++p) {
        const double dc = c.at("d_chosen")[p], dr = c.at("d_rejected")[p];
        EXPECT_NEAR(grads[p].chosen / n, dc, 1e-12 * std::max(1e-3, std::abs(dc))) << "pair " << p;
        EXPECT_NEAR(grads[p].rejected / n, dr, 1e-12 * std::max(1e-3, std::abs(dr))) << "pair " << p;
      }
    }
  }
}

// Every refusal names its option; a live frozen copy names the two ways that need none.
TEST(Objective, OptionsAreCheckedByName) {
  auto refused = [](auto&& make, std::initializer_list<const char*> pieces) {
    try {
      make();
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      for (const char* p : pieces) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  };
  refused([] { make_objective_config("ppo", 0.1, "sigmoid", 0.5, 0, "auto", false); }, {"'objective'", "ppo"});
  refused([] { make_objective_config("simpo", 0.1, "ipo", 0.5, 0, "auto", false); }, {"'loss_type'", "DPO loss"});
  refused([] { make_objective_config("orpo", 0.1, "sigmoid", 0.5, 0.5, "auto", false); }, {"'rpo_alpha'", "ORPO"});
  refused([] { make_objective_config("dpo", 0, "sigmoid", 0.5, 0, "auto", false); }, {"'beta'"});
  refused([] { make_objective_config("dpo", 0.1, "sigmoid", 0.5, 0, "model", false); },
          {"'reference'", "--reference adapters", "--reference precompute"});
  refused([] { make_objective_config("dpo", 0.1, "sigmoid", 0.5, 0, "adapters", false); }, {"--lora_r", "precompute"});
  refused([] { make_objective_config("simpo", 0.1, "sigmoid", 0.5, 0, "precompute", false); }, {"no reference"});
  EXPECT_EQ(make_objective_config("dpo", 0.1, "sigmoid", 0.5, 0, "auto", false).reference, ReferenceSource::Precompute);
  EXPECT_EQ(make_objective_config("dpo", 0.1, "sigmoid", 0.5, 0, "auto", true).reference, ReferenceSource::Adapters);
  EXPECT_EQ(make_objective_config("orpo", 0.1, "sigmoid", 0.5, 0, "auto", false).reference, ReferenceSource::None);
}

// The fixture's policy on a Llama: the base model, or with LoRA the base and the fixture's starting adapter.
struct Policy {
  Fixture f;
  LoraConfig lora;
  Llama model;
  Policy(const std::string& base, bool with_lora, int64_t batch, int64_t seq)
      : f(base),
        lora(with_lora ? read_peft_adapter_config((fs::path("tests/fixtures") / ("lora_" + base)).string()) : LoraConfig{}),
        model(f.config, batch, seq, LlamaParallel{}, lora) {
    load_weights(f.dir, model.layout(), model.params.data());
    if (with_lora) {
      SafetensorsFile a(fs::path("tests/fixtures") / ("lora_" + base) / "adapter_model.safetensors");
      for (const ParamTensor& t : model.lora_layout().params.tensors())
        a.read_f32(t.name, t.shape, model.lora_params.data() + t.offset);
    }
  }
  const ParamLayout& trained() const { return lora.enabled() ? model.lora_layout().params : model.layout(); }
  std::vector<float>& params() { return lora.enabled() ? model.lora_params : model.params; }
  std::vector<float>& grads() { return lora.enabled() ? model.lora_grads : model.grads; }
};

// One step's pass over the packed pairs; the precomputed reference from the fixture (full fine-tune cases).
PreferenceSums pair_step(Policy& policy, const ObjectiveConfig& config, const nlohmann::json& c, const PackedPairs& b,
                         bool want_grad) {
  const std::vector<double> rc = c.at("ref_chosen_logps"), rr = c.at("ref_rejected_logps");
  PairBatch batch{b.inputs.data(), b.targets.data(), b.positions.data(), b.rows(), b.batch, b.seq};
  if (config.reference == ReferenceSource::Precompute) batch.ref_chosen = rc.data(), batch.ref_rejected = rr.data();
  const PreferenceStep step{b.pairs, count_nll_tokens(config, b.rows(), b.targets.data())};
  return llama_pair_step(policy.model, config, batch, step, want_grad);
}

class PreferenceParity : public testing::TestWithParam<std::string> {};

// The model's log-probs, the loss, the metrics and every gradient (the adapters' with LoRA, whose reference is the
// base with them off) equal TRL's to 1e-5, on all three pairs packed into one window.
TEST_P(PreferenceParity, LossMetricsAndEveryGradientFollowTrl) {
  PreferenceFixture fx(GetParam());
  SafetensorsFile grads_file(fx.dir / "grads.safetensors");
  const PackedPairs b = pack(fx.meta.at("pairs"), /*one_row=*/true);
  for (const auto& [name, c] : fx.cases().items()) {
    SCOPED_TRACE(name);
    const ObjectiveConfig config = config_of(c);
    Policy policy(fx.base, c.at("lora"), b.batch, b.seq);
    policy.model.zero_grads();
    const PreferenceSums s = pair_step(policy, config, c, b, /*want_grad=*/true);
    const double P = static_cast<double>(s.pairs), want_loss = c.at("loss");
    EXPECT_NEAR(s.loss / P, want_loss, 1e-5 * std::abs(want_loss));
    const nlohmann::json m = metrics_json(s, config);
    for (const auto& [key, want] : c.at("metrics").items()) {
      if (!m.contains(key)) continue;  // TRL's logits/* and ORPO's log-odds: not tuna's metrics
      // Absolute for the accuracies (0 or 1 per pair) and values near 0, relative otherwise.
      EXPECT_NEAR(m.at(key).get<double>(), want.get<double>(), 1e-5 * std::max(1.0, std::abs(want.get<double>()))) << key;
    }
    for (const ParamTensor& t : policy.trained().tensors()) {
      std::vector<float> want32(t.numel);
      grads_file.read_f32(name + ".grad." + t.name, t.shape, want32.data());
      std::vector<double> want(want32.begin(), want32.end());
      EXPECT_LE(testing_util::rel_err_norm(policy.grads().data() + t.offset, want.data(), t.numel, 1.0 / P), 1e-5)
          << t.name;
    }
  }
}

// 10 AdamW steps (the fixture's schedule, no clipping): each step's loss and gradient norm equal TRL's.
TEST_P(PreferenceParity, TenAdamWStepsFollowTrl) {
  PreferenceFixture fx(GetParam());
  const PackedPairs b = pack(fx.meta.at("pairs"), /*one_row=*/true);
  OptimizerConfig oc;
  const nlohmann::json& m = fx.meta;
  oc.lr = m.at("lr"), oc.min_lr = m.at("min_lr"), oc.warmup_steps = m.at("warmup_steps");
  oc.schedule = "cosine", oc.beta1 = m.at("beta1"), oc.beta2 = m.at("beta2"), oc.eps = m.at("eps");
  oc.weight_decay = m.at("weight_decay"), oc.grad_clip = m.at("grad_clip");
  const int64_t steps = m.at("steps");
  for (const auto& [name, c] : fx.cases().items()) {
    SCOPED_TRACE(name);
    const ObjectiveConfig config = config_of(c);
    Policy policy(fx.base, c.at("lora"), b.batch, b.seq);
    AdamW opt(policy.trained(), oc);
    for (int64_t s = 0; s < steps; s++) {
      policy.model.zero_grads();
      const PreferenceSums sums = pair_step(policy, config, c, b, /*want_grad=*/true);
      const OptimizerStats stats =
          opt.step(policy.params().data(), policy.grads().data(), 1.0 / sums.pairs, learning_rate(oc, s, steps));
      const double want_loss = c.at("train_losses")[s], want_norm = c.at("grad_norms")[s];
      EXPECT_NEAR(sums.loss / sums.pairs, want_loss, 1e-5 * std::max(1e-2, std::abs(want_loss))) << "step " << s;
      EXPECT_NEAR(stats.grad_norm, want_norm, 1e-5 * std::max(1e-2, want_norm)) << "step " << s;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PreferenceParity, testing::Values("llama2_tiny", "llama32_tiny"));

// The oracle of packing: all pairs in one window under document masks give the loss, the metrics and the gradients of
// the pairs one to a row (the same numbers, summed in another order: fp32 rounding apart).
TEST(PreferencePacking, PackedPairsEqualPairsOneAtATime) {
  PreferenceFixture fx("llama32_tiny");
  const PackedPairs packed = pack(fx.meta.at("pairs"), /*one_row=*/true);
  const PackedPairs apart = pack(fx.meta.at("pairs"), /*one_row=*/false);
  for (const char* name : {"dpo_sigmoid_rpo", "orpo", "lora_dpo_sigmoid"}) {
    SCOPED_TRACE(name);
    const nlohmann::json& c = fx.cases().at(name);
    const ObjectiveConfig config = config_of(c);
    Policy a(fx.base, c.at("lora"), packed.batch, packed.seq), b(fx.base, c.at("lora"), apart.batch, apart.seq);
    a.model.zero_grads(), b.model.zero_grads();
    const PreferenceSums sa = pair_step(a, config, c, packed, true), sb = pair_step(b, config, c, apart, true);
    EXPECT_NEAR(sa.loss, sb.loss, 1e-6 * std::abs(sb.loss));
    EXPECT_EQ(metrics_json(sa, config).dump().size() > 2, true);
    EXPECT_NEAR(sa.logps_chosen, sb.logps_chosen, 1e-5 * std::abs(sb.logps_chosen));
    EXPECT_NEAR(sa.rewards_rejected, sb.rewards_rejected, 1e-5 * std::max(1e-3, std::abs(sb.rewards_rejected)));
    std::vector<double> want(b.grads().begin(), b.grads().end());
    EXPECT_LE(testing_util::rel_err_norm(a.grads().data(), want.data(), static_cast<int64_t>(want.size())), 1e-5);
  }
}


// --reference precompute: one pass over the pair shards with the starting weights gives TRL's log-probs of that model,
// is written beside the shards, read back by the same data, model and options, and refused when one of them changed.
// With the starting weights as reference, DPO's first step is at z = 0: the loss is log 2.
TEST(PreferenceReference, PrecomputedOnceReusedAndRefusedWhenChanged) {
  testing_data::TempDir dir;
  PreferenceFixture fx("llama2_tiny");
  const std::string shard = dir.file("train-00000.bin");
  {
    ShardWriter w(shard, 128, /*with_mask=*/true, 0, /*pairs=*/true);
    for (const auto& p : fx.meta.at("pairs")) {
      const std::vector<int32_t> prompt = p.at("prompt");
      for (const char* key : {"chosen", "rejected"}) {
        std::vector<int32_t> doc = prompt;
        std::vector<uint8_t> mask(prompt.size(), 0);
        for (int32_t t : p.at(key)) doc.push_back(t), mask.push_back(1);
        w.add_document(doc, mask);
      }
    }
    w.finish();
  }
  LoaderOptions lo;
  lo.seq_len = 32, lo.micro_batch = 1, lo.vocab_size = 128, lo.eval = true;
  DataLoader loader({shard}, lo);
  Fixture f("llama2_tiny");
  Llama model(f.config, 1, 32);
  load_weights(f.dir, model.layout(), model.params.data());
  std::vector<double> chosen, rejected;
  precompute_reference_logps(model, loader, chosen, rejected);
  const nlohmann::json& c = fx.cases().at("dpo_sigmoid");
  for (size_t p = 0; p < 3; ++p) {
    const double want_c = c.at("policy_chosen_logps")[p], want_r = c.at("policy_rejected_logps")[p];
    EXPECT_NEAR(chosen[p], want_c, 1e-5 * std::abs(want_c)) << p;
    EXPECT_NEAR(rejected[p], want_r, 1e-5 * std::abs(want_r)) << p;
  }

  const fs::path path = reference_logps_path({shard});
  EXPECT_EQ(path, fs::path(dir.file("reference-logps.bin")));
  const ReferenceKey key{files_key({shard}), files_key({(f.dir / "model.safetensors").string()}), 32};
  EXPECT_FALSE(read_reference_logps(path, key, 3).has_value());  // nothing yet: the run computes it
  write_reference_logps(path, ReferenceLogps{key, chosen, rejected});
  const std::optional<ReferenceLogps> again = read_reference_logps(path, key, 3);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->chosen, chosen);
  EXPECT_EQ(again->rejected, rejected);
  auto refused = [&](const ReferenceKey& k, const char* what) {
    try {
      read_reference_logps(path, k, 3);
      ADD_FAILURE() << "reused for " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
    }
  };
  refused({key.data + 1, key.model, key.options}, "other data");
  refused({key.data, key.model + 1, key.options}, "another model");
  refused({key.data, key.model, key.options + 1}, "other options");

  // DPO's first step against the starting weights' own log-probs.
  const ObjectiveConfig config = make_objective_config("dpo", 0.1, "sigmoid", 0.5, 0, "precompute", false);
  std::vector<int32_t> in(32), tg(32), pos(32), seq(32);
  std::vector<uint8_t> comp(32);
  std::vector<uint64_t> ids;
  ASSERT_TRUE(loader.next_pairs(in.data(), tg.data(), pos.data(), seq.data(), comp.data(), &ids));
  std::vector<double> rc, rr;
  for (uint64_t id : ids) rc.push_back(chosen[id]), rr.push_back(rejected[id]);
  const PairBatch b{in.data(), tg.data(), pos.data(), PairRows{seq.data(), comp.data(), 32, int64_t(ids.size())}, 1, 32,
                    rc.data(), rr.data()};
  const PreferenceSums s = llama_pair_step(model, config, b, PreferenceStep{int64_t(ids.size()), 0}, false);
  EXPECT_NEAR(s.loss / s.pairs, std::log(2.0), 1e-6);
}

// Tensor parallelism, the tp ranks as threads: the vocab-parallel log-probs and the weighted backward through the
// split head give TRL's loss on every rank and TRL's gradient, each rank its block of every tensor.
TEST(PreferenceParallel, TensorParallelRanksFollowTrl) {
  PreferenceFixture fx("llama32_tiny");  // tied embedding, GQA (2 kv heads: tp 2)
  const PackedPairs b = pack(fx.meta.at("pairs"), /*one_row=*/true);
  SafetensorsFile grads_file(fx.dir / "grads.safetensors");
  const Fixture f(fx.base);
  for (const char* name : {"dpo_sigmoid_rpo", "orpo"}) {
    const nlohmann::json& c = fx.cases().at(name);
    const ObjectiveConfig config = config_of(c);
    const int tp = 2;
    std::vector<std::unique_ptr<Comm>> comms = make_local_comms(tp, 60);
    std::vector<std::string> failures(tp);
    std::vector<std::thread> threads;
    for (int r = 0; r < tp; r++)
      threads.emplace_back([&, r] {
        try {
          Llama model(f.config, b.batch, b.seq, LlamaParallel{comms[r].get()});
          load_weights(f.dir, model.layout(), model.params.data());
          model.zero_grads();
          const std::vector<double> rc = c.at("ref_chosen_logps"), rr = c.at("ref_rejected_logps");
          PairBatch batch{b.inputs.data(), b.targets.data(), b.positions.data(), b.rows(), b.batch, b.seq};
          if (config.needs_reference()) batch.ref_chosen = rc.data(), batch.ref_rejected = rr.data();
          const PreferenceStep step{b.pairs, count_nll_tokens(config, b.rows(), b.targets.data())};
          const PreferenceSums s = llama_pair_step(model, config, batch, step, true);
          const double P = static_cast<double>(s.pairs), want = c.at("loss");
          if (!(std::abs(s.loss / P - want) <= 1e-5 * std::abs(want)))
            failures[r] += str("loss ", s.loss / P, ", TRL's ", want, "\n");
          for (const ParamTensor& t : model.layout().tensors()) {
            int64_t whole = 1;
            for (int64_t d : t.global_shape) whole *= d;
            std::vector<float> g(whole);
            grads_file.read_f32(std::string(name) + ".grad." + t.name, t.global_shape, g.data());
            std::vector<double> block;  // this rank's part: global.narrow(split_dim, split_begin, shape[split_dim])
            const int64_t cols = t.global_shape.size() == 2 ? t.global_shape[1] : 1;
            for (int64_t i = 0; i < t.numel; i++) {
              const int64_t row = t.shape.size() == 2 ? i / t.shape[1] : i, col = t.shape.size() == 2 ? i % t.shape[1] : 0;
              const int64_t gr = row + (t.split_dim == 0 ? t.split_begin : 0), gc = col + (t.split_dim == 1 ? t.split_begin : 0);
              block.push_back(g[gr * cols + gc]);
            }
            const double e = testing_util::rel_err_norm(model.grads.data() + t.offset, block.data(), t.numel, 1.0 / P);
            if (!(e <= 1e-5)) failures[r] += str(t.name, ": gradient ", e, " from TRL's\n");
          }
        } catch (const std::exception& e) {
          failures[r] = e.what();
        }
      });
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < tp; r++) EXPECT_EQ(failures[r], "") << name << " tp rank " << r;
  }
}
}  // namespace
}  // namespace tuna
