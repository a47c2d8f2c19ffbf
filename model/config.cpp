// Reading config.json strictly: every field that changes the model's function is either understood or
// refused by name. Unknown harmless fields (architectures, transformers_version, ...) are ignored.
#include "model/config.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "core/error.h"
#include "core/json.h"

namespace tuna {
namespace {

using nlohmann::json;

std::string describe(const json& v) {
  std::string s = v.dump();
  return s.size() > 60 ? s.substr(0, 57) + "..." : s;
}

// Upper bounds on the model's dimensions: several times the largest published LLaMA's (hidden 16384, ffn
// 53248, 126 layers, vocab 202048), so no real config meets them; they keep every product of dimensions
// (parameter counts, buffer sizes) far inside int64, so that a typo fails here, by name, and not as an
// overflow or an allocation of petabytes.
constexpr int64_t kMaxWidth = int64_t{1} << 20;     // hidden_size, intermediate_size
constexpr int64_t kMaxCount = int64_t{1} << 14;     // layers, heads, head_dim
constexpr int64_t kMaxVocab = int64_t{1} << 26;
constexpr int64_t kMaxPositions = int64_t{1} << 30;
constexpr bool kRequired = true, kOptional = false;  // get_int's `required`

int64_t get_int(const json& j, const char* key, const std::string& src, int64_t fallback, bool required,
                int64_t min_value, int64_t max_value) {
  if (!j.contains(key) || j[key].is_null()) {
    if (required) fail(src, ": missing field '", key, "' (expected an integer)");
    return fallback;
  }
  return json_int(j, key, src, min_value, max_value);
}

// A finite number in [min_value, max_value] (nlohmann cannot hold inf or nan, but the bounds are the point).
double get_number(const json& j, const char* key, const std::string& src, double fallback, double min_value,
                  double max_value) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  return json_number(j, key, src, min_value, max_value);
}

bool get_bool(const json& j, const char* key, const std::string& src, bool fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  const json& v = j[key];
  if (!v.is_boolean()) fail(src, ": field '", key, "': expected true or false, found ", describe(v));
  return v.get<bool>();
}

// rope_scaling (transformers <= 4.x) and rope_parameters (newer) carry the same content; the newer
// spelling may also hold rope_theta.
void read_rope(const json& j, const std::string& src, LlamaConfig& c) {
  const char* key = nullptr;
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) key = "rope_parameters";
  else if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) key = "rope_scaling";
  if (!key) return;
  const json& r = j[key];
  const std::string where = str(src, ": field '", key, "'");
  if (!r.is_object()) fail(where, ": expected an object, found ", describe(r));
  std::string type;
  for (const char* type_key : {"rope_type", "type"}) {
    if (r.contains(type_key)) {
      if (!r[type_key].is_string())
        fail(where, ".", type_key, ": expected a string, found ", describe(r[type_key]));
      type = r[type_key].get<std::string>();
      break;
    }
  }
  if (r.contains("rope_theta")) c.rope_theta = get_number(r, "rope_theta", where, c.rope_theta, 1e-3, 1e15);
  if (type.empty() || type == "default") return;
  if (type != "llama3" && type != "linear" && type != "dynamic" && type != "yarn")
    fail(where, ": rope type '", type,
         "' is not supported (tuna implements 'default', 'llama3', 'linear', 'dynamic' and 'yarn'; '", type,
         "' changes the positions differently)");
  cpu::RopeScaling& s = c.rope_scaling;
  s.type = type;
  if (!r.contains("factor") || r["factor"].is_null()) fail(where, ": ", type, " rope needs 'factor', which is missing");
  s.factor = get_number(r, "factor", where, 1.0, 1e-6, 1e6);
  if (!(s.factor >= 1.0))
    fail(where, ".factor: expected a number >= 1 (the context grows by it), found ", s.factor);
  if (type == "llama3") {
    for (const char* k : {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
      if (!r.contains(k)) fail(where, ": llama3 rope needs '", k, "', which is missing");
    s.low_freq_factor = get_number(r, "low_freq_factor", where, 1.0, 1e-6, 1e6);
    s.high_freq_factor = get_number(r, "high_freq_factor", where, 4.0, 1e-6, 1e6);
    s.original_max_position_embeddings =
        get_int(r, "original_max_position_embeddings", where, 0, kRequired, 1, kMaxPositions);
    if (!(s.high_freq_factor > s.low_freq_factor))
      fail(where, ": expected high_freq_factor > low_freq_factor, found ", s.high_freq_factor, " and ",
           s.low_freq_factor);
    return;
  }
  // linear, dynamic, yarn: transformers 4.46 (the version tuna matches) takes the original context of dynamic and
  // yarn from max_position_embeddings, and never reads rope_scaling's original_max_position_embeddings.
  s.original_max_position_embeddings = c.max_position_embeddings;
  const bool has_original = r.contains("original_max_position_embeddings") &&
                            !r["original_max_position_embeddings"].is_null();
  if (type == "dynamic" && has_original &&
      get_int(r, "original_max_position_embeddings", where, 0, kRequired, 1, kMaxPositions) != c.max_position_embeddings)
    fail(where, ".original_max_position_embeddings: ", describe(r["original_max_position_embeddings"]),
         " differs from max_position_embeddings ", c.max_position_embeddings, ", which is the original context that "
         "transformers' dynamic rope scales from; set max_position_embeddings to the original context and remove "
         "this field");
  if (type != "yarn") return;
  // Later transformers versions read yarn's original_max_position_embeddings (and then derive the factor from
  // max_position_embeddings / it) and mscale / mscale_all_dim: a config with them means different frequencies in
  // different versions, so tuna refuses it rather than train one of them.
  if (has_original)
    fail(where, ".original_max_position_embeddings: yarn with this field computes different frequencies in different "
         "transformers versions (4.46 ignores it and scales from max_position_embeddings; later ones take the factor "
         "as max_position_embeddings / it); write the original context as max_position_embeddings, the extension as "
         "'factor', and remove the field");
  const bool has_attention_factor = r.contains("attention_factor") && !r["attention_factor"].is_null();
  if (!has_attention_factor && r.contains("mscale") && !r["mscale"].is_null() && r.contains("mscale_all_dim") &&
      !r["mscale_all_dim"].is_null())
    fail(where, ": yarn's 'mscale' and 'mscale_all_dim' set the attention factor in later transformers versions and "
         "are ignored by 4.46; give 'attention_factor' explicitly (0.1 mscale ln(factor) + 1 over 0.1 mscale_all_dim "
         "ln(factor) + 1 is the later versions' value)");
  // transformers: `rope_scaling.get("beta_fast") or 32`: missing, null or 0 means the default.
  auto beta = [&](const char* k, double fallback) {
    const double v = get_number(r, k, where, fallback, -1e6, 1e6);
    return v == 0.0 ? fallback : v;
  };
  s.beta_fast = beta("beta_fast", 32.0);
  s.beta_slow = beta("beta_slow", 1.0);
  if (!(s.beta_fast > s.beta_slow && s.beta_slow > 0.0))
    fail(where, ": yarn needs beta_fast > beta_slow > 0, found ", s.beta_fast, " and ", s.beta_slow);
  if (has_attention_factor) s.attention_factor = get_number(r, "attention_factor", where, 0.0, 1e-6, 1e6);
}

// The rope_scaling object transformers reads back as the same frequencies (null: none).
json rope_scaling_json(const cpu::RopeScaling& s) {
  if (s.type == "default") return nullptr;
  json j = {{"rope_type", s.type}, {"factor", s.factor}};
  if (s.type == "llama3") {
    j["low_freq_factor"] = s.low_freq_factor;
    j["high_freq_factor"] = s.high_freq_factor;
    j["original_max_position_embeddings"] = s.original_max_position_embeddings;
  } else if (s.type == "yarn") {
    j["beta_fast"] = s.beta_fast;
    j["beta_slow"] = s.beta_slow;
    if (s.attention_factor > 0.0) j["attention_factor"] = s.attention_factor;
  }
  return j;
}

// Token ids, each in [0, vocab_size): the trainer and the sampler index the vocabulary with them.
std::vector<int64_t> read_token_ids(const json& j, const char* key, const std::string& src, int64_t vocab_size) {
  if (!j.contains(key) || j[key].is_null()) return {};
  const json& v = j[key];
  std::vector<int64_t> ids;
  auto take = [&](const json& e) {
    if (!e.is_number_integer()) fail(src, ": field '", key, "': expected integers, found ", describe(e));
    const int64_t id = e.is_number_unsigned() && e.get<uint64_t>() > INT64_MAX ? -1 : e.get<int64_t>();
    if (id < 0 || id >= vocab_size)
      fail(src, ": field '", key, "': token id ", describe(e), " is outside the vocabulary [0, ", vocab_size, ")");
    ids.push_back(id);
  };
  if (v.is_number_integer()) {
    take(v);
  } else if (v.is_array()) {
    if (v.size() > 1024) fail(src, ": field '", key, "': ", v.size(), " token ids, expected at most 1024");
    for (const json& e : v) take(e);
  } else {
    fail(src, ": field '", key, "': expected an integer or a list of integers, found ", describe(v));
  }
  return ids;
}

}  // namespace

LlamaConfig LlamaConfig::from_json(const json& j, const std::string& src) {
  if (!j.is_object()) fail(src, ": expected a JSON object, found ", describe(j));
  if (j.contains("model_type") && j["model_type"].is_string() && j["model_type"] != "llama")
    fail(src, ": field 'model_type': expected \"llama\", found ", describe(j["model_type"]),
         " (tuna trains LlamaForCausalLM)");
  if (j.contains("hidden_act") && j["hidden_act"] != "silu")
    fail(src, ": field 'hidden_act': expected \"silu\" (SwiGLU), found ", describe(j["hidden_act"]));
  for (const char* k : {"attention_bias", "mlp_bias"})
    if (get_bool(j, k, src, /*fallback=*/false))
      fail(src, ": field '", k, "' is true: biases in the ", k[0] == 'a' ? "attention" : "MLP",
           " projections are not supported");

  LlamaConfig c;
  c.hidden_size = get_int(j, "hidden_size", src, 0, kRequired, 1, kMaxWidth);
  c.intermediate_size = get_int(j, "intermediate_size", src, 0, kRequired, 1, kMaxWidth);
  c.num_hidden_layers = get_int(j, "num_hidden_layers", src, 0, kRequired, 1, kMaxCount);
  c.num_attention_heads = get_int(j, "num_attention_heads", src, 0, kRequired, 1, kMaxCount);
  c.num_key_value_heads = get_int(j, "num_key_value_heads", src, c.num_attention_heads, kOptional, 1, kMaxCount);
  c.vocab_size = get_int(j, "vocab_size", src, 0, kRequired, 1, kMaxVocab);
  c.max_position_embeddings = get_int(j, "max_position_embeddings", src, 2048, kOptional, 1, kMaxPositions);
  if (j.contains("head_dim") && !j["head_dim"].is_null()) {
    c.head_dim = get_int(j, "head_dim", src, 0, kRequired, 2, kMaxCount);
  } else {
    if (c.hidden_size % c.num_attention_heads != 0)
      fail(src, ": no 'head_dim', and hidden_size ", c.hidden_size,
           " is not a multiple of num_attention_heads ", c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
    if (c.head_dim > kMaxCount)
      fail(src, ": hidden_size / num_attention_heads = ", c.head_dim, ": expected a head_dim of at most ", kMaxCount);
  }
  if (c.head_dim % 2 != 0) fail(src, ": head_dim must be even for rotary embeddings, found ", c.head_dim);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    fail(src, ": num_attention_heads ", c.num_attention_heads,
         " must be a multiple of num_key_value_heads ", c.num_key_value_heads);
  // eps is added to the mean square of activations: published models use 1e-5 or 1e-6, and a value near 1
  // or above stops the norm from normalizing (1e308 makes it divide by a constant).
  c.rms_norm_eps = get_number(j, "rms_norm_eps", src, 1e-6, 1e-30, 0.1);
  c.rope_theta = get_number(j, "rope_theta", src, 10000.0, 1e-3, 1e15);
  read_rope(j, src, c);
  // Every dimension is bounded above, but their products are not yet: 2^48 parameters (280 trillion) is past
  // any model, and keeps every element count and byte size of tuna's buffers inside int64.
  const __int128 per_layer = __int128(2) * c.hidden_size + __int128(c.hidden_size) * c.q_dim() * 2 +
                             __int128(2) * c.hidden_size * c.kv_dim() + __int128(3) * c.hidden_size * c.intermediate_size;
  const __int128 params = __int128(c.vocab_size) * c.hidden_size * 2 + per_layer * c.num_hidden_layers;
  if (params > (__int128(1) << 48))
    fail(src, ": the model would have ~", static_cast<double>(params), " parameters (hidden_size ", c.hidden_size,
         ", intermediate_size ", c.intermediate_size, ", ", c.num_hidden_layers, " layers, ", c.num_attention_heads,
         " heads of ", c.head_dim, ", vocab ", c.vocab_size, "): at most 2^48 are supported");
  c.tie_word_embeddings = get_bool(j, "tie_word_embeddings", src, /*fallback=*/false);
  std::vector<int64_t> bos = read_token_ids(j, "bos_token_id", src, c.vocab_size);
  c.bos_token_id = bos.empty() ? -1 : bos[0];
  c.eos_token_ids = read_token_ids(j, "eos_token_id", src, c.vocab_size);
  if (j.contains("torch_dtype") && j["torch_dtype"].is_string()) c.torch_dtype = j["torch_dtype"];
  else if (j.contains("dtype") && j["dtype"].is_string()) c.torch_dtype = j["dtype"];
  return c;
}

LlamaConfig LlamaConfig::load(const std::string& path) {
  std::filesystem::path p(path);
  std::error_code ec;
  if (std::filesystem::is_directory(p, ec)) p /= "config.json";
  return from_json(read_json_file(p, "model config (a Hugging Face config.json)"), p.string());
}

json LlamaConfig::to_json() const {
  json j = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_act", "silu"},
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"num_hidden_layers", num_hidden_layers},
      {"num_attention_heads", num_attention_heads},
      {"num_key_value_heads", num_key_value_heads},
      {"head_dim", head_dim},
      {"vocab_size", vocab_size},
      {"max_position_embeddings", max_position_embeddings},
      {"rms_norm_eps", rms_norm_eps},
      {"rope_theta", rope_theta},
      {"tie_word_embeddings", tie_word_embeddings},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"torch_dtype", torch_dtype},
  };
  j["rope_scaling"] = rope_scaling_json(rope_scaling);
  if (bos_token_id >= 0) j["bos_token_id"] = bos_token_id;
  if (eos_token_ids.size() == 1) j["eos_token_id"] = eos_token_ids[0];
  else if (!eos_token_ids.empty()) j["eos_token_id"] = eos_token_ids;
  return j;
}

int64_t LlamaConfig::n_params() const {
  const int64_t c = hidden_size, f = intermediate_size;
  const int64_t per_layer = 2 * c + c * q_dim() + 2 * c * kv_dim() + q_dim() * c + 3 * c * f;
  return vocab_size * c * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * per_layer + c;
}

int64_t LlamaConfig::max_context() const {
  if (rope_scaling.type != "dynamic" && rope_scaling.type != "yarn") return max_position_embeddings;
  return static_cast<int64_t>(std::floor(static_cast<double>(max_position_embeddings) * rope_scaling.factor));
}

void check_seq_len(const LlamaConfig& config, int64_t seq_len, const std::string& option,
                   const std::string& config_path) {
  if (seq_len <= config.max_context()) return;
  if (config.max_context() != config.max_position_embeddings)
    fail("option '", option, "': ", seq_len, " tokens is more than the model's max_position_embeddings ",
         config.max_position_embeddings, " times its ", config.rope_scaling.type, " rope factor ",
         config.rope_scaling.factor, " (", config_path, "); use a seq_len up to ", config.max_context(),
         " or a larger factor (--rope_scaling)");
  fail("option '", option, "': ", seq_len, " tokens is more than the model's max_position_embeddings ",
       config.max_position_embeddings, " (", config_path,
       "); use a seq_len up to it, or, to train a longer context, scale the rope (--rope_scaling linear:FACTOR, "
       "dynamic:FACTOR or yarn:FACTOR): checkpoints and the export then carry the new length");
}

void apply_rope_scaling(LlamaConfig& config, json& config_json, const std::string& spec, const std::string& option,
                        const std::string& config_path) {
  if (spec.empty()) return;
  const size_t colon = spec.find(':');
  const std::string type = spec.substr(0, colon);
  if (colon == std::string::npos || (type != "linear" && type != "dynamic" && type != "yarn"))
    fail("option '", option, "': expected TYPE:FACTOR with TYPE linear, dynamic or yarn (e.g. linear:4), found '",
         spec, "'");
  const std::string factor_text = spec.substr(colon + 1);
  char* end = nullptr;
  const double factor = std::strtod(factor_text.c_str(), &end);
  if (factor_text.empty() || *end != '\0' || !std::isfinite(factor) || factor <= 1.0 || factor > 1024.0)
    fail("option '", option, "': the factor of '", spec, "' must be a number above 1 and at most 1024, found '",
         factor_text, "'");
  cpu::RopeScaling& s = config.rope_scaling;
  // Resuming, or starting from a checkpoint of a run that scaled the same way: its config already says so.
  if (s.type == type && s.factor == factor) return;
  if (s.type != "default")
    fail("option '", option, "': the model already has ", s.type, " rope scaling (factor ", s.factor, ", ",
         config_path, "); scaling it again is not supported: start from the unscaled model, or leave the option out "
         "to train the context its config.json gives");
  // linear divides the positions, so max_position_embeddings becomes the extended context (as linear-scaled
  // checkpoints publish it); dynamic and yarn scale from max_position_embeddings, which stays the original context.
  if (type == "linear")
    config.max_position_embeddings =
        static_cast<int64_t>(std::floor(static_cast<double>(config.max_position_embeddings) * factor));
  s = cpu::RopeScaling{};
  s.type = type, s.factor = factor, s.original_max_position_embeddings = config.max_position_embeddings;
  const json written = rope_scaling_json(s);
  config_json["max_position_embeddings"] = config.max_position_embeddings;
  config_json["rope_scaling"] = written;
  if (config_json.contains("rope_parameters") && !config_json["rope_parameters"].is_null()) {
    json parameters = written;
    parameters["rope_theta"] = config.rope_theta;
    config_json["rope_parameters"] = parameters;
  }
  // What is written must read back as what trains.
  const LlamaConfig back = LlamaConfig::from_json(config_json, config_path);
  TUNA_CHECK(back.rope_scaling.type == s.type && back.rope_scaling.factor == s.factor &&
                 back.max_context() == config.max_context(),
             "rope scaling ", spec, " did not round-trip through config.json");
}

double model_flops_per_token(const LlamaConfig& c, int64_t seq) {
  double matmul_params = static_cast<double>(c.n_params());
  if (!c.tie_word_embeddings) matmul_params -= static_cast<double>(c.vocab_size * c.hidden_size);
  const double attention = 6.0 * static_cast<double>(seq) * static_cast<double>(c.q_dim()) *
                           static_cast<double>(c.num_hidden_layers);
  return 6.0 * matmul_params + attention;
}

}  // namespace tuna
