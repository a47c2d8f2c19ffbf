// One micro-batch of pairs through a model (the flow once, the CPU model's passes here): see model/preference_step.h.
#include "model/preference_step.h"

#include "core/error.h"

namespace tuna {

PairPasses llama_passes(Llama& model, const PairBatch& b) {
  return PairPasses{
      [&model, &b](float* logps, bool backward_follows, bool adapters_off) {
        model.forward_logps(b.inputs, b.targets, b.batch, b.seq, b.positions, logps, backward_follows, adapters_off);
      },
      [&model, &b](const float* weights) { model.backward_weighted(b.inputs, b.targets, weights, b.batch, b.seq); }};
}

void sum_pair_logps(const PairBatch& b, const float* logps, double* chosen, double* rejected) {
  ObjectiveConfig plain;
  plain.objective = Objective::Dpo;
  std::vector<PairLogps> pairs(b.rows.pairs);
  double nll = 0;
  int64_t nll_tokens = 0;
  gather_pair_logps(plain, b.rows, b.targets, logps, nullptr, pairs, &nll, &nll_tokens);
  for (int64_t p = 0; p < b.rows.pairs; p++) chosen[p] = pairs[p].chosen, rejected[p] = pairs[p].rejected;
}

PreferenceSums pair_loss(const ObjectiveConfig& config, const PairBatch& b, const PreferenceStep& step,
                         const float* logps, const double* ref_chosen, const double* ref_rejected, float* weights) {
  TUNA_CHECK(b.rows.rows == b.batch * b.seq, "pair rows ", b.rows.rows, " for ", b.batch, " x ", b.seq);
  const double* rc = ref_chosen ? ref_chosen : b.ref_chosen;
  const double* rr = ref_chosen ? ref_rejected : b.ref_rejected;
  TUNA_CHECK(!config.needs_reference() || (rc && rr),
             "DPO: the micro-batch came without its reference log-probs (precomputed, or the base's)");
  const int64_t P = b.rows.pairs;
  std::vector<PairLogps> pairs(P);
  double nll = 0;
  int64_t nll_tokens = 0;
  gather_pair_logps(config, b.rows, b.targets, logps, nullptr, pairs, &nll, &nll_tokens);
  if (config.needs_reference())
    for (int64_t p = 0; p < P; p++) pairs[p].ref_chosen = rc[p], pairs[p].ref_rejected = rr[p];
  std::vector<PairGrad> grads(weights ? P : 0);
  double nll_weight = 0;
  PreferenceSums sums = preference_loss(config, pairs, nll, nll_tokens, step, grads, &nll_weight);
  if (weights) preference_token_weights(config, b.rows, b.targets, pairs, grads, nll_weight, weights);
  return sums;
}

void pair_logp_sums(const PairPasses& passes, const PairBatch& b, bool adapters_off, double* chosen,
                    double* rejected) {
  std::vector<float> logps(b.batch * b.seq);
  passes.forward_logps(logps.data(), /*backward_follows=*/false, adapters_off);
  sum_pair_logps(b, logps.data(), chosen, rejected);
}

PreferenceSums pair_step(const PairPasses& passes, const ObjectiveConfig& config, const PairBatch& b,
                         const PreferenceStep& step, bool want_grad) {
  TUNA_CHECK(b.rows.rows == b.batch * b.seq, "pair rows ", b.rows.rows, " for ", b.batch, " x ", b.seq);
  const int64_t n = b.batch * b.seq, P = b.rows.pairs;
  std::vector<double> ref_c, ref_r;
  if (config.needs_reference() && config.reference == ReferenceSource::Adapters) {
    // The reference first: its forward overwrites the activations the policy's backward needs.
    ref_c.resize(P), ref_r.resize(P);
    pair_logp_sums(passes, b, /*adapters_off=*/true, ref_c.data(), ref_r.data());
  }
  std::vector<float> logps(n), weights(want_grad ? n : 0);
  passes.forward_logps(logps.data(), want_grad, /*adapters_off=*/false);
  const PreferenceSums sums = pair_loss(config, b, step, logps.data(), ref_c.empty() ? nullptr : ref_c.data(),
                                        ref_r.empty() ? nullptr : ref_r.data(), want_grad ? weights.data() : nullptr);
  if (want_grad) passes.backward_weighted(weights.data());
  return sums;
}

void llama_pair_logps(Llama& model, const PairBatch& b, bool adapters_off, double* chosen, double* rejected) {
  pair_logp_sums(llama_passes(model, b), b, adapters_off, chosen, rejected);
}

PreferenceSums llama_pair_step(Llama& model, const ObjectiveConfig& config, const PairBatch& b,
                               const PreferenceStep& step, bool want_grad) {
  return pair_step(llama_passes(model, b), config, b, step, want_grad);
}

void precompute_reference_logps(Llama& model, DataLoader& loader, std::vector<double>& chosen,
                                std::vector<double>& rejected) {
  TUNA_CHECK(loader.options().eval, "the reference pass reads every pair once: an eval loader");
  const int64_t B = loader.options().micro_batch, T = loader.options().seq_len, n = B * T;
  chosen.assign(loader.total_pairs(), 0.0), rejected.assign(loader.total_pairs(), 0.0);
  std::vector<int32_t> inputs(n), targets(n), positions(n), sequence(n);
  std::vector<uint8_t> completion(n);
  std::vector<uint64_t> ids;
  loader.reset();
  while (loader.next_pairs(inputs.data(), targets.data(), positions.data(), sequence.data(), completion.data(), &ids)) {
    const int64_t P = static_cast<int64_t>(ids.size());
    PairBatch b{inputs.data(), targets.data(), positions.data(), PairRows{sequence.data(), completion.data(), n, P}, B, T};
    std::vector<double> c(P), r(P);
    llama_pair_logps(model, b, /*adapters_off=*/false, c.data(), r.data());
    for (int64_t p = 0; p < P; p++) chosen[ids[p]] = c[p], rejected[ids[p]] = r[p];
  }
  loader.reset();
}

}  // namespace tuna
