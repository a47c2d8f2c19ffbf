// Preference (engine/preference.h).
#include "engine/preference.h"

#include <xxhash.h>

#include <cstdio>

#include "core/error.h"
#include "model/preference_step.h"  // PairBatch

namespace tuna {

void declare_preference_options(Options& o, PreferenceOptions& p) {
  o.add("objective", &p.objective,
        "the training objective: sft (next-token loss), or a preference loss over the pairs of prepare --preference's "
        "shards: dpo, simpo, orpo (TRL's definitions)", {"sft", "dpo", "simpo", "orpo"});
  o.add("beta", &p.beta, "dpo, simpo, orpo: TRL's beta (the reward scale; ORPO's odds-ratio weight)",
        Bounds::open_closed(0, 1e6));
  o.add("loss_type", &p.loss_type, "dpo: the loss of the reward margin (TRL's loss_type)", {"sigmoid", "ipo", "hinge"});
  o.add("simpo_gamma", &p.simpo_gamma, "simpo: the target reward margin (TRL's simpo_gamma)", Bounds::closed(-1e6, 1e6));
  o.add("rpo_alpha", &p.rpo_alpha,
        "dpo, simpo: the weight of an SFT term (the chosen completion's NLL) added to the loss (TRL's rpo_alpha, "
        "CPO's cpo_alpha); 0: none", Bounds::closed(0, 1e6));
  o.add("reference", &p.reference,
        "dpo's reference model, never a second copy in memory: adapters (with LoRA: the base with the adapters off) or "
        "precompute (a full fine-tune: the starting weights' log-probs, computed once before training and kept beside "
        "the shards); auto: adapters with LoRA, else precompute", {"auto", "adapters", "precompute", "model"});
}

Preference::Preference(const PreferenceOptions& o, bool adapters)
    : config_(make_objective_config(o.objective, o.beta, o.loss_type, o.simpo_gamma, o.rpo_alpha, o.reference,
                                    adapters)) {
  if (!config_.preference() && (o.beta != 0.1 || o.simpo_gamma != 0.5 || o.reference != "auto"))
    fail("options 'beta', 'simpo_gamma' and 'reference' are for a preference objective (--objective dpo, simpo or "
         "orpo); --objective sft has none of them");
}

std::string Preference::describe() const {
  const ObjectiveConfig& c = config_;
  if (!c.preference()) return "objective sft (next-token loss)";
  std::string what = str("objective ", objective_name(c.objective), " (");
  if (c.objective == Objective::Dpo) what += str(loss_type_name(c.loss_type), ", ");
  what += str("beta ", c.beta);
  if (c.objective == Objective::Simpo) what += str(", gamma ", c.simpo_gamma);
  if (c.rpo_alpha > 0) what += str(", rpo_alpha ", c.rpo_alpha);
  what += ")";
  if (c.reference == ReferenceSource::Adapters) what += "; reference: the base with the adapters off";
  if (c.reference == ReferenceSource::Precompute) what += "; reference: the starting weights' log-probs, precomputed";
  if (!c.needs_reference()) what += "; no reference model";
  return what;
}

void Preference::check_data(const DataLoader& loader, const std::string& option) const {
  if (enabled() && !loader.pairs())
    fail("option '", option, "': --objective ", objective_name(config_.objective), " trains on preference pairs, but ",
         loader.shard(0).path(), " holds no pairs; write pair shards with build/prepare --preference");
  if (!enabled() && loader.pairs())
    fail("option '", option, "': ", loader.shard(0).path(), " holds preference pairs (build/prepare --preference), "
         "which --objective sft does not train on; give --objective dpo, simpo or orpo");
}

void Preference::prepare_reference(Engine& engine, const std::vector<std::string>& shards, DataLoader& eval_loader,
                                   const ReferenceInputs& in, bool can_compute, bool train, Comm& world, Comm* dp) {
  if (config_.reference != ReferenceSource::Precompute) return;
  ReferenceLogps& ref = train ? train_reference_ : val_reference_;
  const auto text_key = [](const std::string& text) { return XXH3_64bits(text.data(), text.size()); };
  ref.key.data = files_key(shards);
  ref.key.model = in.weight_files.empty() ? text_key(in.model_text) : files_key(in.weight_files);
  ref.key.options = text_key(in.options_text);
  const uint64_t pairs = eval_loader.total_pairs();
  // The validation pairs' file is named apart: train and val shards often share a directory (prepare writes both).
  std::filesystem::path path = reference_logps_path(shards);
  if (!train) path.replace_filename("reference-logps-val.bin");
  if (std::optional<ReferenceLogps> found = read_reference_logps(path, ref.key, pairs)) {
    ref = std::move(*found);
    std::printf("reference log-probs of %llu %s pairs: %s (reused)\n", (unsigned long long)pairs,
                train ? "training" : "validation", path.c_str());
    return;
  }
  if (!can_compute)
    fail(path.string(), ": DPO's precomputed reference is missing, and a resumed run no longer holds the starting "
         "weights it was computed with; restore the file, or start the run again (--overwrite)");
  // One pass with the starting weights: each rank its share of the windows, the pairs it did not see left 0.
  ref.chosen.assign(pairs, 0.0), ref.rejected.assign(pairs, 0.0);
  Micro m;
  eval_loader.reset();
  while (read(eval_loader, m, nullptr)) {
    const PairBatch b = batch(eval_loader, m);
    std::vector<double> c(m.ids.size()), r(m.ids.size());
    engine.pair_logps(b, c.data(), r.data());
    for (size_t p = 0; p < m.ids.size(); p++) ref.chosen[m.ids[p]] = c[p], ref.rejected[m.ids[p]] = r[p];
  }
  eval_loader.reset();
  if (dp && dp->size() > 1 && pairs > 0) {
    dp->all_reduce_sum(ref.chosen.data(), static_cast<int64_t>(pairs), "reference log-probs");
    dp->all_reduce_sum(ref.rejected.data(), static_cast<int64_t>(pairs), "reference log-probs");
  }
  if (world.rank() == 0) write_reference_logps(path, ref);
  world.barrier("reference log-probs written");
  std::printf("reference log-probs of %llu %s pairs: computed with the starting weights, kept in %s\n",
              (unsigned long long)pairs, train ? "training" : "validation", path.c_str());
}

bool Preference::read(DataLoader& loader, Micro& m, const ReferenceLogps* reference) const {
  const LoaderOptions& o = loader.options();
  const int64_t n = o.micro_batch * o.seq_len;
  m.inputs.resize(n), m.targets.resize(n), m.positions.resize(n), m.sequence.resize(n), m.completion.resize(n);
  if (!loader.next_pairs(m.inputs.data(), m.targets.data(), m.positions.data(), m.sequence.data(),
                         m.completion.data(), &m.ids))
    return false;
  m.ref_chosen.clear(), m.ref_rejected.clear();
  if (reference)
    for (uint64_t id : m.ids) {
      TUNA_CHECK(id < reference->chosen.size(), "pair ", id, " of ", reference->chosen.size());
      m.ref_chosen.push_back(reference->chosen[id]), m.ref_rejected.push_back(reference->rejected[id]);
    }
  return true;
}

PairBatch Preference::batch(const DataLoader& loader, const Micro& m) const {
  const LoaderOptions& o = loader.options();
  PairBatch b{m.inputs.data(), m.targets.data(), m.positions.data(),
              PairRows{m.sequence.data(), m.completion.data(), o.micro_batch * o.seq_len,
                       static_cast<int64_t>(m.ids.size())},
              o.micro_batch, o.seq_len};
  if (!m.ref_chosen.empty()) b.ref_chosen = m.ref_chosen.data(), b.ref_rejected = m.ref_rejected.data();
  return b;
}

int64_t Preference::nll_tokens(const DataLoader& loader, const Micro& m) const {
  const PairBatch b = batch(loader, m);
  return count_nll_tokens(config_, b.rows, m.targets.data());
}

namespace {

// A step's or a validation's sums over the dp ranks (each tp rank holds the same ones).
PreferenceSums sum_over(Comm* dp, const PreferenceSums& s) {
  if (!dp || dp->size() < 2) return s;
  double v[9] = {s.loss, s.rewards_chosen, s.rewards_rejected, s.rewards_accuracies, s.logps_chosen, s.logps_rejected,
                 s.nll, double(s.pairs), double(s.nll_tokens)};
  dp->all_reduce_sum(v, 9, "preference metrics");
  PreferenceSums out;
  out.loss = v[0], out.rewards_chosen = v[1], out.rewards_rejected = v[2], out.rewards_accuracies = v[3];
  out.logps_chosen = v[4], out.logps_rejected = v[5], out.nll = v[6];
  out.pairs = std::llround(v[7]), out.nll_tokens = std::llround(v[8]);
  return out;
}

PreferenceStep count_over(Comm* dp, PreferenceStep s) {
  if (!dp || dp->size() < 2) return s;
  int64_t v[2] = {s.pairs, s.nll_tokens};
  dp->all_reduce(v, 2, CommType::I64, ReduceOp::Sum, "preference step's pairs and tokens");
  return {v[0], v[1]};
}

}  // namespace

LossSum Preference::step(Engine& engine, DataLoader& loader, int64_t grad_accum, Comm* dp) {
  TUNA_CHECK(enabled(), "a preference step of objective sft");
  micro_.resize(grad_accum);
  const ReferenceLogps* reference = config_.reference == ReferenceSource::Precompute ? &train_reference_ : nullptr;
  // The step's normalizers before any forward: its pairs and NLL tokens, on every rank.
  PreferenceStep local;
  for (Micro& m : micro_) {
    TUNA_CHECK(read(loader, m, reference), "the training loader ran dry");
    local.pairs += static_cast<int64_t>(m.ids.size());
    local.nll_tokens += nll_tokens(loader, m);
  }
  const PreferenceStep all = count_over(dp, local);
  std::vector<PairBatch> batches;
  for (const Micro& m : micro_) batches.push_back(batch(loader, m));
  const Engine::PairStepSums step = engine.forward_pairs_step(batches, config_, all);
  metrics_ = metrics_json(sum_over(dp, step.sums), config_);
  return step.counted;
}

Preference::Validation Preference::validate(Engine& engine, DataLoader& loader, int64_t max_batches, Comm* dp) {
  const ReferenceLogps* reference = config_.reference == ReferenceSource::Precompute ? &val_reference_ : nullptr;
  // The normalizers first (a pass over the data alone), then the forwards.
  Micro m;
  PreferenceStep local;
  loader.reset();
  for (int64_t b = 0; (max_batches == 0 || b < max_batches) && read(loader, m, nullptr); b++)
    local.pairs += static_cast<int64_t>(m.ids.size()), local.nll_tokens += nll_tokens(loader, m);
  const PreferenceStep all = count_over(dp, local);
  loader.reset();
  PreferenceSums sums;
  for (int64_t b = 0; (max_batches == 0 || b < max_batches) && read(loader, m, reference); b++)
    sums.add(engine.forward_pairs(batch(loader, m), config_, all, /*want_grad=*/false));
  const PreferenceSums total = sum_over(dp, sums);
  Validation v;
  v.pairs = total.pairs;
  v.loss = total.pairs ? total.loss / double(total.pairs) : NAN;
  v.metrics = metrics_json(total, config_);
  return v;
}

}  // namespace tuna
