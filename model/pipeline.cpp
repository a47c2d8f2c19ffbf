#include "model/pipeline.h"

#include <algorithm>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "model/layout.h"

namespace tuna {

namespace {

// Forward + backward FLOPs per token of one decoder layer (model_flops_per_token's terms for one layer) and of the
// head (the final norm is negligible; the embedding lookup costs no FLOPs).
double layer_flops(const LlamaConfig& c, int64_t seq) {
  const double C = static_cast<double>(c.hidden_size), F = static_cast<double>(c.intermediate_size);
  const double matmul = C * static_cast<double>(c.q_dim()) * 2 + C * static_cast<double>(c.kv_dim()) * 2 + 3 * C * F;
  return 6.0 * matmul + 6.0 * static_cast<double>(seq) * static_cast<double>(c.q_dim());
}
double head_flops(const LlamaConfig& c) {
  return 6.0 * static_cast<double>(c.vocab_size) * static_cast<double>(c.hidden_size);
}

}  // namespace

std::vector<PipelineStage> pipeline_stages(const LlamaConfig& config, int64_t pp, int64_t seq) {
  const int64_t L = config.num_hidden_layers;
  TUNA_CHECK(pp >= 1 && pp <= L, pp, " stages of ", L, " layers (the support table, model/support.h, refuses them first)");
  const double layer = layer_flops(config, seq), head = head_flops(config);
  // Stage cost when it runs `layers` layers and is the last one.
  const auto cost = [&](int64_t layers, bool last) { return static_cast<double>(layers) * layer + (last ? head : 0.0); };
  // The cheapest costliest stage: the layers are alike, so only the last stage's head breaks the symmetry. Try every
  // count for the last stage and spread the rest as evenly as layers allow.
  double best = std::numeric_limits<double>::infinity();
  for (int64_t last = 1; last <= L - (pp - 1); last++) {
    const int64_t rest = L - last, others = pp - 1;
    const double front = others == 0 ? 0.0 : cost((rest + others - 1) / others, false);
    if (others == 0 && rest != 0) continue;
    best = std::min(best, std::max(front, cost(last, true)));
  }
  // Earlier stages as small as the best allows: each stage takes the fewest layers that leave the rest splittable
  // within `best` (the stages after it can hold at most best / layer layers each, the last one less its head).
  const auto fits_after = [&](int64_t remaining, int64_t stages_left) {
    // Can `remaining` layers go to the last `stages_left` stages (the last included), each at least one, within best?
    if (remaining < stages_left) return false;
    const int64_t per_stage = static_cast<int64_t>(best / layer + 1e-9);
    const int64_t last_max = static_cast<int64_t>((best - head) / layer + 1e-9);
    if (last_max < 1) return false;
    return remaining <= per_stage * (stages_left - 1) + last_max;
  };
  std::vector<PipelineStage> stages(pp);
  int64_t begin = 0;
  for (int64_t s = 0; s < pp; s++) {
    PipelineStage& st = stages[s];
    st.layer_begin = begin;
    if (s == pp - 1) {
      st.layer_end = L;
    } else {
      int64_t take = 1;
      while (!fits_after(L - begin - take, pp - 1 - s)) take++;
      st.layer_end = begin + take;
    }
    st.embedding = s == 0;
    st.head = s == pp - 1;
    st.flops_per_token = cost(st.layers(), st.head);
    TUNA_CHECK(st.layers() >= 1 && st.flops_per_token <= best * (1 + 1e-12), "pipeline split: stage ", s, " of ", pp,
               " has ", st.layers(), " layers");
    begin = st.layer_end;
  }
  return stages;
}

std::vector<int> pipeline_stage_units(const ParamLayout& layout, const PipelineStage& stage) {
  TUNA_CHECK(stage.layer_end <= layout.num_layers(), "stage layers ", stage.layer_begin, "-", stage.layer_end, " of ",
             layout.num_layers());
  std::vector<int> units;
  if (stage.embedding) units.push_back(0);
  for (int64_t layer = stage.layer_begin; layer < stage.layer_end; layer++) units.push_back(static_cast<int>(1 + layer));
  if (stage.head) {
    units.push_back(layout.head_unit());
    if (layout.lm_head_unit() == 0 && !stage.embedding) units.push_back(0);
  }
  return units;
}

std::string format_pipeline_stages(const std::vector<PipelineStage>& stages) {
  double total = 0, worst = 0;
  for (const PipelineStage& s : stages) total += s.flops_per_token, worst = std::max(worst, s.flops_per_token);
  std::ostringstream out;
  for (size_t i = 0; i < stages.size(); i++) {
    const PipelineStage& s = stages[i];
    out << (i ? ", " : "") << "stage " << i << ": " << (s.embedding ? "embedding + " : "") << "layers " << s.layer_begin
        << "-" << s.layer_end - 1 << " (" << s.layers() << ")" << (s.head ? " + head" : "");
  }
  out.precision(1);
  out << std::fixed << "; costliest stage " << 100.0 * worst / total << "% of the model's FLOPs";
  return out.str();
}

}  // namespace tuna
