#include "model/lora.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "core/error.h"
#include "core/json.h"

namespace tuna {
namespace {

constexpr LoraTarget kTargets[kLoraTargets] = {LoraTarget::Q,    LoraTarget::K,  LoraTarget::V,   LoraTarget::O,
                                               LoraTarget::Gate, LoraTarget::Up, LoraTarget::Down};

std::string valid_names() { return lora_targets_string(kAllLoraTargets); }

// The bit of the projection called exactly `name`; 0 for any other string.
uint32_t lora_target_bit(const std::string& name) {
  for (LoraTarget t : kTargets)
    if (name == lora_target_name(t)) return 1u << static_cast<int>(t);
  return 0;
}

}  // namespace

const char* lora_target_name(LoraTarget t) {
  static const char* const names[kLoraTargets] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                  "gate_proj", "up_proj", "down_proj"};
  return names[static_cast<int>(t)];
}

const char* lora_target_module(LoraTarget t) { return static_cast<int>(t) <= 3 ? "self_attn" : "mlp"; }

bool lora_target_row_parallel(LoraTarget t) { return t == LoraTarget::O || t == LoraTarget::Down; }

LoraInput lora_target_input(LoraTarget t) {
  switch (t) {
    case LoraTarget::Q:
    case LoraTarget::K:
    case LoraTarget::V: return LoraInput::Attention;
    case LoraTarget::O: return LoraInput::AttentionOut;
    case LoraTarget::Gate:
    case LoraTarget::Up: return LoraInput::Mlp;
    case LoraTarget::Down: return LoraInput::MlpOut;
  }
  return LoraInput::Attention;
}

std::vector<LoraTarget> lora_input_targets(LoraInput g) {
  std::vector<LoraTarget> targets;
  for (LoraTarget t : kTargets)
    if (lora_target_input(t) == g) targets.push_back(t);
  return targets;
}

uint32_t parse_lora_targets(const std::string& list) {
  uint32_t bits = 0;
  size_t at = 0;
  for (;;) {
    const size_t comma = std::min(list.find(',', at), list.size());
    std::string name = list.substr(at, comma - at);
    name.erase(0, name.find_first_not_of(" \t"));
    name.erase(name.find_last_not_of(" \t") + 1);
    if (name.empty())
      fail("option 'lora_targets': an empty name in '", list, "' (expected a comma list of ", valid_names(), ")");
    bool found = false;
    for (LoraTarget t : kTargets)
      if (name == lora_target_name(t)) {
        if (bits & (1u << static_cast<int>(t))) fail("option 'lora_targets': '", name, "' given twice in '", list, "'");
        bits |= 1u << static_cast<int>(t), found = true;
      }
    if (!found)
      fail("option 'lora_targets': '", name, "' is not a projection of a LLaMA layer (expected a comma list of ",
           valid_names(), ")");
    if (comma == list.size()) return bits;
    at = comma + 1;
  }
}

std::string lora_targets_string(uint32_t targets) {
  std::string s;
  for (LoraTarget t : kTargets)
    if ((targets >> static_cast<int>(t)) & 1u) s += (s.empty() ? "" : ",") + std::string(lora_target_name(t));
  return s;
}

std::array<int64_t, 2> lora_target_shape(const LlamaConfig& c, LoraTarget t) {
  switch (t) {
    case LoraTarget::Q: return {c.q_dim(), c.hidden_size};
    case LoraTarget::K:
    case LoraTarget::V: return {c.kv_dim(), c.hidden_size};
    case LoraTarget::O: return {c.hidden_size, c.q_dim()};
    case LoraTarget::Gate:
    case LoraTarget::Up: return {c.intermediate_size, c.hidden_size};
    case LoraTarget::Down: return {c.hidden_size, c.intermediate_size};
  }
  return {0, 0};
}

void validate_lora(const LoraConfig& lora, const LlamaConfig& config) {
  if (lora.rank < 1) fail("option 'lora_rank': expected a rank of at least 1, found ", lora.rank);
  if ((lora.targets & kAllLoraTargets) == 0 || (lora.targets & ~kAllLoraTargets))
    fail("option 'lora_targets': expected a comma list of ", valid_names());
  for (LoraTarget t : kTargets) {
    if (!lora.has(t)) continue;
    const auto [out, in] = lora_target_shape(config, t);
    if (lora.rank > std::min(out, in))
      fail("option 'lora_rank': ", lora.rank, " exceeds the smaller dimension of ", lora_target_name(t), " (", out,
           " x ", in, "); a rank above it adds parameters and no capacity");
  }
  if (!std::isfinite(lora.alpha) || lora.alpha <= 0)
    fail("option 'lora_alpha': expected a finite number above 0, found ", lora.alpha);
  if (!std::isfinite(lora.dropout) || lora.dropout < 0 || lora.dropout >= 1)
    fail("option 'lora_dropout': expected a probability in [0, 1), found ", lora.dropout);
}

std::string lora_tensor_name(int64_t layer, LoraTarget t, char which) {
  return str("base_model.model.model.layers.", layer, ".", lora_target_module(t), ".", lora_target_name(t), ".lora_",
             which, ".weight");
}

LoraLayout lora_layout(const LlamaConfig& config, const LoraConfig& lora, int tp_rank, int tp_size,
                       const PipelineStage* stage) {
  validate_lora(lora, config);
  const ParamLayout model(config, tp_rank, tp_size);  // the tp dimensions and each projection's block
  const int64_t r = lora.rank;
  std::vector<ParamTensor> tensors;
  std::vector<std::pair<int64_t, int64_t>> units;
  std::vector<LoraOffsets> layers(config.num_hidden_layers);
  int64_t total = 0;
  int streams = 0;  // tensors of the whole model's adapters so far, held here or not
  auto add = [&](const std::string& name, std::vector<int64_t> global_shape, int layer, int split_dim,
                 int64_t split_begin, int64_t split_size) {
    ParamTensor t;
    t.stream = streams++;
    t.name = name;
    t.shape = global_shape;
    if (split_dim >= 0) t.shape[split_dim] = split_size;
    t.global_shape = std::move(global_shape);
    t.split_dim = split_dim, t.split_begin = split_begin;
    t.layer = layer;
    t.decays = true;  // PEFT under the HF Trainer: every non-bias, non-norm weight decays
    t.numel = t.shape[0] * t.shape[1];
    const int64_t offset = total;
    total += t.numel;
    tensors.push_back(std::move(t));
    return offset;
  };
  for (int64_t l = 0; l < config.num_hidden_layers; l++) {
    const LayerOffsets& w = model.layer(l);
    const int64_t weight_offset[kLoraTargets] = {w.q_proj,    w.k_proj,  w.v_proj,   w.o_proj,
                                                 w.gate_proj, w.up_proj, w.down_proj};
    const int64_t begin = total;
    LoraOffsets& o = layers[l];
    o.a.fill(-1), o.b.fill(-1);
    const bool held = !stage || (l >= stage->layer_begin && l < stage->layer_end);
    for (LoraTarget t : kTargets) {
      if (!lora.has(t)) continue;
      if (!held) {  // another stage's: counted in the streams only
        streams += 2;
        continue;
      }
      const int i = static_cast<int>(t);
      const ParamTensor* base = nullptr;
      for (const ParamTensor& p : model.tensors())
        if (p.offset == weight_offset[i]) base = &p;
      TUNA_CHECK(base, "no weight for ", lora_target_name(t));
      const auto [out, in] = lora_target_shape(config, t);
      const int li = static_cast<int>(l);
      if (lora_target_row_parallel(t)) {  // W split by columns: A likewise, B whole
        o.a[i] = add(lora_tensor_name(l, t, 'A'), {r, in}, li, base->split_dim, base->split_begin,
                     base->split_dim >= 0 ? base->shape[1] : 0);
        o.b[i] = add(lora_tensor_name(l, t, 'B'), {out, r}, li, -1, 0, 0);
      } else {  // W split by rows: A whole, B likewise
        o.a[i] = add(lora_tensor_name(l, t, 'A'), {r, in}, li, -1, 0, 0);
        o.b[i] = add(lora_tensor_name(l, t, 'B'), {out, r}, li, base->split_dim, base->split_begin,
                     base->split_dim >= 0 ? base->shape[0] : 0);
      }
    }
    units.emplace_back(begin, total);
  }
  LoraLayout layout{ParamLayout(model.tp(), std::move(tensors), std::move(units), /*keep_streams=*/true),
                    std::move(layers)};
  TUNA_CHECK(layout.params.total() == total, "adapter layout of ", layout.params.total(), " elements, expected ", total);
  return layout;
}

int64_t lora_parameter_count(const LlamaConfig& config, const LoraConfig& lora) {
  int64_t per_layer = 0;
  for (LoraTarget t : kTargets)
    if (lora.has(t)) {
      const auto [out, in] = lora_target_shape(config, t);
      per_layer += lora.rank * (in + out);
    }
  return per_layer * config.num_hidden_layers;
}

double lora_flops_per_token(const LlamaConfig& c, const LoraConfig& lora, int64_t seq) {
  double matmul_params = static_cast<double>(c.n_params());
  if (!c.tie_word_embeddings) matmul_params -= static_cast<double>(c.vocab_size * c.hidden_size);
  const double attention = model_flops_per_token(c, seq) - 6.0 * matmul_params;
  return 4.0 * matmul_params + attention + 6.0 * static_cast<double>(lora_parameter_count(c, lora));
}

void init_lora_weights_piece(const ParamLayout& adapters, uint64_t seed, const Segment& piece, float* out) {
  for_each_tensor_piece(adapters, piece.begin, piece.size, out,
                        [&](size_t index, const ParamTensor& t, int64_t lb, int64_t le, float* p) {
    TUNA_CHECK(t.shape.size() == 2 && t.global_shape.size() == 2, t.name, ": an adapter is a matrix");
    if (t.name.find(".lora_B.") != std::string::npos) {  // B starts at zero: the model starts as its base
      std::fill(p, p + (le - lb), 0.0f);
      return;
    }
    // PEFT's kaiming_uniform_(a = sqrt(5)) over the whole layer's in_features: U(-1/sqrt(in), 1/sqrt(in)).
    const double bound = 1.0 / std::sqrt(static_cast<double>(t.global_shape[1]));
    std::mt19937_64 rng(tensor_stream_seed(seed, index));
    std::uniform_real_distribution<double> uniform(-bound, bound);
    draw_block_piece(t, lb, le, p, [&] { return static_cast<float>(uniform(rng)); });
  });
}

uint64_t lora_dropout_key(uint64_t seed, int64_t step, int64_t micro_batch, int dp_rank) {
  uint64_t k = lora_mix(seed ^ 0x4C6F5241ull);
  k = lora_mix(k + static_cast<uint64_t>(step));
  k = lora_mix(k + static_cast<uint64_t>(micro_batch));
  return lora_mix(k + static_cast<uint64_t>(dp_rank));
}

uint64_t lora_dropout_stream(uint64_t key, int64_t layer, LoraTarget t) {
  return lora_mix(lora_mix(key + static_cast<uint64_t>(layer)) + static_cast<uint64_t>(t));
}

nlohmann::json peft_adapter_config(const LoraConfig& lora, const std::string& base_path) {
  nlohmann::json targets = nlohmann::json::array();
  for (LoraTarget t : kTargets)
    if (lora.has(t)) targets.push_back(lora_target_name(t));
  return {{"peft_type", "LORA"},
          {"task_type", "CAUSAL_LM"},
          {"base_model_name_or_path", base_path},
          {"r", lora.rank},
          {"lora_alpha", lora.alpha},
          {"lora_dropout", lora.dropout},
          {"target_modules", targets},
          {"bias", "none"},
          {"fan_in_fan_out", false},
          {"inference_mode", true},
          {"init_lora_weights", true},
          {"use_rslora", false},
          {"use_dora", false},
          {"modules_to_save", nullptr},
          {"layers_to_transform", nullptr},
          {"rank_pattern", nlohmann::json::object()},
          {"alpha_pattern", nlohmann::json::object()}};
}

LoraConfig read_peft_adapter_config(const std::filesystem::path& path) {
  const std::filesystem::path file =
      std::filesystem::is_directory(path) ? path / "adapter_config.json" : path;
  const std::string src = file.string();
  const nlohmann::json j = read_json_file(file, src);
  if (!j.is_object()) fail(src, ": expected a JSON object");
  auto text = [&](const char* key, const char* expected) {
    if (!j.contains(key) || j[key].is_null()) return;
    if (!j[key].is_string() || j[key].get<std::string>() != expected)
      fail(src, ": field '", key, "': tuna trains ", expected, ", found ", j[key].dump());
  };
  auto off = [&](const char* key) {
    if (!j.contains(key) || j[key].is_null()) return;
    const nlohmann::json& v = j[key];
    const bool empty = (v.is_boolean() && !v.get<bool>()) || (v.is_object() && v.empty()) || (v.is_array() && v.empty());
    if (!empty) fail(src, ": field '", key, "' is ", v.dump(), ": not trained by tuna (expected it off or empty)");
  };
  if (!j.contains("peft_type")) fail(src, ": missing field 'peft_type' (expected \"LORA\")");
  text("peft_type", "LORA");
  text("bias", "none");
  for (const char* key : {"use_rslora", "use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern",
                          "modules_to_save", "layers_to_transform", "layers_pattern", "layer_replication", "loftq_config"})
    off(key);
  LoraConfig lora;
  lora.rank = json_int(j, "r", src, 1, int64_t{1} << 20);
  // The file's values are refused here, naming the file and its key (validate_lora's messages name the options).
  lora.alpha = json_number(j, "lora_alpha", src, 0, 1e12);
  if (lora.alpha <= 0)
    fail(src, ": field 'lora_alpha': expected a number above 0 (the update is scaled by lora_alpha / r), found ",
         j["lora_alpha"].dump());
  lora.dropout = j.contains("lora_dropout") && !j["lora_dropout"].is_null() ? json_number(j, "lora_dropout", src, 0, 1)
                                                                             : 0.0;
  if (lora.dropout >= 1) fail(src, ": field 'lora_dropout': expected a probability in [0, 1), found ", j["lora_dropout"].dump());
  if (!j.contains("target_modules")) fail(src, ": missing field 'target_modules'");
  const nlohmann::json& tm = j["target_modules"];
  if (tm.is_string()) {
    if (tm.get<std::string>() != "all-linear")
      fail(src, ": field 'target_modules': a regular expression (", tm.dump(), ") is not supported; expected a list of ",
           valid_names(), " or \"all-linear\"");
    lora.targets = kAllLoraTargets;
  } else if (tm.is_array() && !tm.empty()) {
    // Each entry exactly a projection's name: PEFT matches module names as they are, so "q_proj " or "" targets
    // nothing there (PEFT refuses the configuration), and a comma list in one entry is one name.
    lora.targets = 0;
    for (const nlohmann::json& name : tm) {
      const uint32_t bit = name.is_string() ? lora_target_bit(name.get<std::string>()) : 0;
      if (bit == 0)
        fail(src, ": field 'target_modules': ", name.dump(), " is not the name of a projection of a LLaMA layer (expected ",
             "each entry exactly one of ", valid_names(), ", or the string \"all-linear\")");
      if (lora.targets & bit) fail(src, ": field 'target_modules': ", name.dump(), " is given twice");
      lora.targets |= bit;
    }
  } else {
    fail(src, ": field 'target_modules': expected a non-empty list of names, found ", tm.dump());
  }
  return lora;
}

}  // namespace tuna
