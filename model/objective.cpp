// Preference losses (see model/objective.h), in doubles. Each pair loss is written as a function of one number z
// (TRL's "logits": a difference of log-ratios), so the gradient is dL/dz times dz/d(each sequence's log-prob).
//   DPO     z = (c - r) - (ref_c - ref_r)      sigmoid: -logsigmoid(beta z)   hinge: relu(1 - beta z)
//                                             ipo: (z - 1 / (2 beta))^2 on log-probs averaged over each completion
//           rewards beta (c - ref_c), beta (r - ref_r)
//   SimPO   z = a_c - a_r - gamma / beta       -logsigmoid(beta z) on averaged log-probs; rewards beta a_c, beta a_r
//   ORPO    z = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r))   pair loss -beta logsigmoid(z), plus the chosen
//           sequence's NLL (prompt and response, TRL's ORPOTrainer); rewards beta a_c, beta a_r
// logsigmoid and its derivative are evaluated in their stable forms (log1p(exp(-|x|)), sigmoid from exp(-|x|)), as
// torch's are; log(1 - e^a) is log(-expm1(a)), exact for the tiny |a| of a likely sequence.
#include "model/objective.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kernels/cpu/classifier.h"  // kIgnoreIndex

namespace tuna {

namespace {

double log_sigmoid(double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); }
double sigmoid(double x) {
  if (x >= 0) return 1 / (1 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1 + e);
}

}  // namespace

const char* objective_name(Objective o) {
  switch (o) {
    case Objective::Sft: return "sft";
    case Objective::Dpo: return "dpo";
    case Objective::Simpo: return "simpo";
    case Objective::Orpo: return "orpo";
  }
  return "?";
}

const char* loss_type_name(PreferenceLossType t) {
  switch (t) {
    case PreferenceLossType::Sigmoid: return "sigmoid";
    case PreferenceLossType::Ipo: return "ipo";
    case PreferenceLossType::Hinge: return "hinge";
  }
  return "?";
}

const char* reference_name(ReferenceSource r) {
  switch (r) {
    case ReferenceSource::None: return "none";
    case ReferenceSource::Adapters: return "adapters";
    case ReferenceSource::Precompute: return "precompute";
  }
  return "?";
}

ObjectiveConfig make_objective_config(const std::string& objective, double beta, const std::string& loss_type,
                                      double simpo_gamma, double rpo_alpha, const std::string& reference,
                                      bool adapters) {
  ObjectiveConfig c;
  if (objective == "sft") c.objective = Objective::Sft;
  else if (objective == "dpo") c.objective = Objective::Dpo;
  else if (objective == "simpo") c.objective = Objective::Simpo;
  else if (objective == "orpo") c.objective = Objective::Orpo;
  else fail("option 'objective': expected sft, dpo, simpo or orpo, found '", objective, "'");
  if (loss_type == "sigmoid") c.loss_type = PreferenceLossType::Sigmoid;
  else if (loss_type == "ipo") c.loss_type = PreferenceLossType::Ipo;
  else if (loss_type == "hinge") c.loss_type = PreferenceLossType::Hinge;
  else fail("option 'loss_type': expected sigmoid, ipo or hinge, found '", loss_type, "'");
  if (!(beta > 0) || !std::isfinite(beta)) fail("option 'beta': expected a number above 0, found ", beta);
  if (!(rpo_alpha >= 0) || !std::isfinite(rpo_alpha)) fail("option 'rpo_alpha': expected a number >= 0, found ", rpo_alpha);
  if (!std::isfinite(simpo_gamma)) fail("option 'simpo_gamma': expected a finite number, found ", simpo_gamma);
  c.beta = beta, c.simpo_gamma = simpo_gamma, c.rpo_alpha = rpo_alpha;
  if (c.objective != Objective::Dpo && c.loss_type != PreferenceLossType::Sigmoid)
    fail("option 'loss_type': ", loss_type, " is a DPO loss; --objective ", objective, " has its own");
  if (c.objective == Objective::Orpo && rpo_alpha != 0)
    fail("option 'rpo_alpha': ORPO's loss already holds the chosen answer's NLL (its weight is 1); leave rpo_alpha at 0");
  if (c.objective == Objective::Sft && rpo_alpha != 0)
    fail("option 'rpo_alpha': an SFT term on top of a preference loss; --objective sft is all SFT already");
  if (reference == "model")
    fail("option 'reference': a live frozen copy of the model doubles its weight memory and is not made; with "
         "adapters (--lora_rank) the reference is the base with the adapters off (--reference adapters), and for a full "
         "fine-tune --reference precompute computes the reference log-probs once, before training, and caches them "
         "beside the shards");
  if (reference == "auto") {
    c.reference = !c.needs_reference() ? ReferenceSource::None
                  : adapters           ? ReferenceSource::Adapters
                                       : ReferenceSource::Precompute;
  } else if (reference == "adapters" || reference == "precompute") {
    if (!c.needs_reference())
      fail("option 'reference': --objective ", objective, " has no reference model (only dpo has one); leave it at auto");
    c.reference = reference == "adapters" ? ReferenceSource::Adapters : ReferenceSource::Precompute;
    if (c.reference == ReferenceSource::Adapters && !adapters)
      fail("option 'reference': adapters needs LoRA (--lora_rank): the reference is then the base with the adapters off; "
           "a full fine-tune uses --reference precompute");
  } else {
    fail("option 'reference': expected auto, adapters or precompute, found '", reference, "'");
  }
  return c;
}

void PreferenceSums::add(const PreferenceSums& o) {
  loss += o.loss, rewards_chosen += o.rewards_chosen, rewards_rejected += o.rewards_rejected;
  rewards_accuracies += o.rewards_accuracies, logps_chosen += o.logps_chosen, logps_rejected += o.logps_rejected;
  nll += o.nll, pairs += o.pairs, nll_tokens += o.nll_tokens;
}

nlohmann::json metrics_json(const PreferenceSums& s, const ObjectiveConfig& config) {
  nlohmann::json j = nlohmann::json::object();
  if (s.pairs == 0) return j;
  const double n = static_cast<double>(s.pairs);
  j["rewards/chosen"] = s.rewards_chosen / n;
  j["rewards/rejected"] = s.rewards_rejected / n;
  j["rewards/margins"] = (s.rewards_chosen - s.rewards_rejected) / n;
  j["rewards/accuracies"] = s.rewards_accuracies / n;
  j["logps/chosen"] = s.logps_chosen / n;
  j["logps/rejected"] = s.logps_rejected / n;
  if (config.nll_weight() > 0 && s.nll_tokens > 0) j["nll_loss"] = s.nll / static_cast<double>(s.nll_tokens);
  return j;
}

PreferenceSums preference_loss(const ObjectiveConfig& config, std::span<const PairLogps> pairs, double nll,
                               int64_t nll_tokens, const PreferenceStep& step, std::span<PairGrad> grads,
                               double* nll_token_weight) {
  TUNA_CHECK(config.preference(), "preference_loss of objective ", objective_name(config.objective));
  TUNA_CHECK(grads.empty() || grads.size() == pairs.size(), grads.size(), " gradients for ", pairs.size(), " pairs");
  const double beta = config.beta;
  const bool averaged = config.averaged();
  PreferenceSums s;
  s.pairs = static_cast<int64_t>(pairs.size());
  for (size_t p = 0; p < pairs.size(); p++) {
    const PairLogps& x = pairs[p];
    if (x.chosen_tokens < 1 || x.rejected_tokens < 1)
      fail("preference pair ", p, ": a completion without tokens (", x.chosen_tokens, " chosen, ", x.rejected_tokens,
           " rejected); prepare --preference drops such records");
    // The log-probs the loss takes, and d(them) / d(the sums).
    const double sc = averaged ? 1.0 / static_cast<double>(x.chosen_tokens) : 1.0;
    const double sr = averaged ? 1.0 / static_cast<double>(x.rejected_tokens) : 1.0;
    const double c = x.chosen * sc, r = x.rejected * sr;
    double loss = 0, dz = 0, dc = 0, dr = 0, reward_c = 0, reward_r = 0;
    switch (config.objective) {
      case Objective::Dpo: {
        const double ref_c = x.ref_chosen * sc, ref_r = x.ref_rejected * sr;
        const double z = (c - r) - (ref_c - ref_r);
        switch (config.loss_type) {
          case PreferenceLossType::Sigmoid:
            loss = -log_sigmoid(beta * z), dz = -beta * sigmoid(-beta * z);
            break;
          case PreferenceLossType::Hinge:
            loss = std::max(0.0, 1 - beta * z), dz = 1 - beta * z > 0 ? -beta : 0.0;  // relu's gradient at 0 is 0
            break;
          case PreferenceLossType::Ipo: {
            const double d = z - 1 / (2 * beta);
            loss = d * d, dz = 2 * d;
            break;
          }
        }
        dc = dz, dr = -dz;
        reward_c = beta * (c - ref_c), reward_r = beta * (r - ref_r);
        break;
      }
      case Objective::Simpo: {
        const double z = c - r - config.simpo_gamma / beta;
        loss = -log_sigmoid(beta * z), dz = -beta * sigmoid(-beta * z);
        dc = dz, dr = -dz;
        reward_c = beta * c, reward_r = beta * r;
        break;
      }
      case Objective::Orpo: {
        // log(1 - e^a) for an averaged log-prob a < 0; d/da = -e^a / (1 - e^a).
        const double l1c = std::log(-std::expm1(c)), l1r = std::log(-std::expm1(r));
        const double z = (c - r) - (l1c - l1r);
        loss = -beta * log_sigmoid(z), dz = -beta * sigmoid(-z);
        dc = dz * (1 + std::exp(c) / -std::expm1(c));
        dr = -dz * (1 + std::exp(r) / -std::expm1(r));
        reward_c = beta * c, reward_r = beta * r;
        break;
      }
      case Objective::Sft: break;
    }
    s.loss += loss;
    s.rewards_chosen += reward_c, s.rewards_rejected += reward_r;
    s.rewards_accuracies += reward_c > reward_r ? 1.0 : 0.0;
    s.logps_chosen += c, s.logps_rejected += r;
    if (!grads.empty()) grads[p] = {dc * sc, dr * sr};
  }
  // The NLL term, as a share of the step's mean: alpha * nll / step tokens, times step pairs (the trainer divides).
  s.nll = nll, s.nll_tokens = nll_tokens;
  const double alpha = config.nll_weight();
  double token_weight = 0;
  if (alpha > 0 && step.nll_tokens > 0) {
    const double scale = alpha * static_cast<double>(step.pairs) / static_cast<double>(step.nll_tokens);
    s.loss += scale * nll;
    token_weight = -scale;  // nll = -sum of the tokens' log-probs
  }
  if (nll_token_weight) *nll_token_weight = token_weight;
  return s;
}

namespace {

// Whether token i's target counts in the chosen NLL: a chosen sequence's completion, or with ORPO any of its targets.
bool in_nll(const ObjectiveConfig& config, const PairRows& rows, const int32_t* targets, int64_t i) {
  const int32_t s = rows.sequence[i];
  if (s < 0 || s % 2 != 0 || targets[i] == cpu::kIgnoreIndex) return false;
  return config.nll_covers_prompt() || rows.completion[i] != 0;
}

void check_sequence(const PairRows& rows, int64_t i) {
  const int32_t s = rows.sequence[i];
  if (s >= 2 * rows.pairs)
    fail("preference rows: token ", i, " belongs to sequence ", s, ", but the micro-batch holds ", rows.pairs, " pairs");
}

}  // namespace

int64_t count_nll_tokens(const ObjectiveConfig& config, const PairRows& rows, const int32_t* targets) {
  if (config.nll_weight() <= 0) return 0;
  int64_t n = 0;
  for (int64_t i = 0; i < rows.rows; i++) n += in_nll(config, rows, targets, i);
  return n;
}

void gather_pair_logps(const ObjectiveConfig& config, const PairRows& rows, const int32_t* targets,
                       const float* logps, const float* ref_logps, std::span<PairLogps> pairs, double* nll,
                       int64_t* nll_tokens) {
  TUNA_CHECK(static_cast<int64_t>(pairs.size()) == rows.pairs, pairs.size(), " pairs for ", rows.pairs);
  for (PairLogps& p : pairs) p = PairLogps{};
  *nll = 0, *nll_tokens = 0;
  const bool with_nll = config.nll_weight() > 0;
  for (int64_t i = 0; i < rows.rows; i++) {
    const int32_t s = rows.sequence[i];
    if (s < 0 || targets[i] == cpu::kIgnoreIndex) continue;
    check_sequence(rows, i);
    PairLogps& p = pairs[s / 2];
    if (rows.completion[i]) {
      if (s % 2 == 0) {
        p.chosen += logps[i], p.chosen_tokens++;
        if (ref_logps) p.ref_chosen += ref_logps[i];
      } else {
        p.rejected += logps[i], p.rejected_tokens++;
        if (ref_logps) p.ref_rejected += ref_logps[i];
      }
    }
    if (with_nll && in_nll(config, rows, targets, i)) *nll -= logps[i], ++*nll_tokens;
  }
}

void preference_token_weights(const ObjectiveConfig& config, const PairRows& rows, const int32_t* targets,
                              std::span<const PairLogps> pairs, std::span<const PairGrad> grads,
                              double nll_token_weight, float* weights) {
  TUNA_CHECK(static_cast<int64_t>(grads.size()) == rows.pairs && pairs.size() == grads.size(), "gradients of ",
             grads.size(), " pairs for ", rows.pairs);
  for (int64_t i = 0; i < rows.rows; i++) {
    const int32_t s = rows.sequence[i];
    double d = 0;  // d loss_sum / d logp[i]
    if (s >= 0 && targets[i] != cpu::kIgnoreIndex) {
      check_sequence(rows, i);
      if (rows.completion[i]) d += s % 2 == 0 ? grads[s / 2].chosen : grads[s / 2].rejected;
      if (in_nll(config, rows, targets, i)) d += nll_token_weight;
    }
    weights[i] = static_cast<float>(-d);
  }
}

}  // namespace tuna
