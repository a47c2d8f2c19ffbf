// LlamaConfig from config.json: what LLaMA 2 / 3.x configs say is read, what tuna cannot train is refused
// by name, and malformed files fail with the file and field in the message.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "model/config.h"
#include "model/layout.h"

namespace tuna {
namespace {

using nlohmann::json;

json llama32_1b() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": true, "attention_bias": false, "mlp_bias": false,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"})");
}

std::string error_of(const json& j) {
  try {
    LlamaConfig::from_json(j, "cfg.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(LlamaConfig, ReadsLlama32) {
  LlamaConfig c = LlamaConfig::from_json(llama32_1b(), "cfg.json");
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.rope_scaling.type, "llama3");
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 128000);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  // The published size of Llama 3.2 1B: 1,235,814,400 parameters.
  EXPECT_EQ(c.n_params(), 1235814400);
  EXPECT_EQ(ParamLayout(c).total(), c.n_params());
}

TEST(LlamaConfig, ReadsLlama2DefaultsAndDerivesHeadDim) {
  json j = json::parse(R"({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "vocab_size": 32000, "rms_norm_eps": 1e-05,
    "rope_scaling": null, "bos_token_id": 1, "eos_token_id": 2})");
  LlamaConfig c = LlamaConfig::from_json(j, "cfg.json");
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.num_key_value_heads, 32);
  EXPECT_EQ(c.rope_scaling.type, "default");
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_FALSE(c.tie_word_embeddings);
  // LLaMA-2 7B: 6,738,415,616 parameters.
  EXPECT_EQ(c.n_params(), 6738415616);
}

TEST(LlamaConfig, ReadsTheNewerRopeParametersSpelling) {
  json j = llama32_1b();
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 8.0},
                          {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                          {"original_max_position_embeddings", 8192}};
  LlamaConfig c = LlamaConfig::from_json(j, "cfg.json");
  EXPECT_EQ(c.rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
}

TEST(LlamaConfig, RefusesWhatItCannotTrainNamingTheField) {
  struct Case {
    const char* field;
    json value;
    const char* expect;
  };
  const Case cases[] = {
      {"attention_bias", true, "attention_bias"},
      {"mlp_bias", true, "mlp_bias"},
      {"hidden_act", "gelu", "hidden_act"},
      {"model_type", "mistral", "model_type"},
      {"rope_scaling", json{{"rope_type", "longrope"}, {"factor", 4.0}}, "longrope"},
      {"rope_scaling", json{{"rope_type", "llama3"}, {"factor", 8.0}}, "low_freq_factor"},
      {"num_key_value_heads", 5, "num_key_value_heads 5"},
      {"head_dim", 63, "head_dim must be even"},
  };
  for (const Case& c : cases) {
    json j = llama32_1b();
    j[c.field] = c.value;
    const std::string msg = error_of(j);
    EXPECT_NE(msg.find("cfg.json"), std::string::npos) << c.field << ": " << msg;
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.field << ": " << msg;
  }
}

TEST(LlamaConfig, MalformedFieldsNameTheFieldAndWhatWasFound) {
  json j = llama32_1b();
  j["hidden_size"] = "2048";
  std::string msg = error_of(j);
  EXPECT_NE(msg.find("'hidden_size'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected an integer"), std::string::npos) << msg;
  EXPECT_NE(msg.find("\"2048\""), std::string::npos) << msg;

  j = llama32_1b();
  j.erase("vocab_size");
  msg = error_of(j);
  EXPECT_NE(msg.find("missing field 'vocab_size'"), std::string::npos) << msg;

  j = llama32_1b();
  j["num_hidden_layers"] = 0;
  msg = error_of(j);
  EXPECT_NE(msg.find("'num_hidden_layers'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("found 0"), std::string::npos) << msg;

  j = llama32_1b();
  j["eos_token_id"] = "x";
  EXPECT_NE(error_of(j).find("eos_token_id"), std::string::npos);
}

TEST(LlamaConfig, FileErrorsNameTheFile) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "tuna_test_config";
  std::filesystem::create_directories(dir);
  {
    std::ofstream(dir / "config.json") << "{\"hidden_size\": 64,";
  }
  try {
    LlamaConfig::load(dir.string());
    FAIL() << "truncated JSON accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find((dir / "config.json").string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not valid JSON"), std::string::npos) << e.what();
  }
  std::filesystem::remove(dir / "config.json");
  EXPECT_THROW(LlamaConfig::load(dir.string()), Error);
  std::filesystem::remove_all(dir);
}

TEST(LlamaConfig, ToJsonReadsBackAsTheSameModel) {
  LlamaConfig a = LlamaConfig::from_json(llama32_1b(), "cfg.json");
  LlamaConfig b = LlamaConfig::from_json(a.to_json(), "round trip");
  EXPECT_EQ(a.to_json(), b.to_json());
}

TEST(ParamLayout, IsLayerMajorWithContiguousLayers) {
  LlamaConfig c = LlamaConfig::from_json(llama32_1b(), "cfg.json");
  c.num_hidden_layers = 3;
  ParamLayout layout(c);
  EXPECT_EQ(layout.tensors().front().name, "model.embed_tokens.weight");
  EXPECT_EQ(layout.lm_head(), layout.embed_tokens());  // tied
  int64_t expect = layout.tensors().front().numel;
  for (int64_t l = 0; l < 3; l++) {
    auto [begin, end] = layout.layer_range(l);
    EXPECT_EQ(begin, expect);
    expect = end;
  }
  EXPECT_EQ(layout.final_norm(), expect);
  EXPECT_FALSE(layout.find("model.norm.weight")->decays);
  EXPECT_TRUE(layout.find("model.layers.2.mlp.down_proj.weight")->decays);
  EXPECT_EQ(layout.find("model.layers.1.self_attn.k_proj.weight")->shape, (std::vector<int64_t>{512, 2048}));
  EXPECT_EQ(layout.find("lm_head.weight"), nullptr);
}

}  // namespace
}  // namespace tuna

namespace tuna {
namespace {

// Crafted or damaged values: each a clean error naming the field, never an overflow, a crash or a model that
// trains on nonsense.
TEST(LlamaConfig, RefusesValuesOutsideTheirRanges) {
  auto with = [](const char* key, json value) {
    json j = llama32_1b();
    j[key] = std::move(value);
    return error_of(j);
  };
  EXPECT_NE(with("hidden_size", int64_t{1} << 40).find("field 'hidden_size': expected an integer in [1, 1048576]"),
            std::string::npos);
  EXPECT_NE(with("vocab_size", uint64_t{1} << 63).find("field 'vocab_size'"), std::string::npos);
  EXPECT_NE(with("num_hidden_layers", -3).find("field 'num_hidden_layers'"), std::string::npos);
  EXPECT_NE(with("rms_norm_eps", 1e308).find("field 'rms_norm_eps': expected a number in [1e-30, 0.1]"),
            std::string::npos);
  EXPECT_NE(with("rms_norm_eps", 0).find("field 'rms_norm_eps'"), std::string::npos);
  EXPECT_NE(with("rope_theta", -1).find("field 'rope_theta'"), std::string::npos);
  EXPECT_NE(with("eos_token_id", 128256).find("token id 128256 is outside the vocabulary"), std::string::npos);
  EXPECT_NE(with("bos_token_id", -1).find("field 'bos_token_id'"), std::string::npos);
  // Each dimension within bounds, the product not: 2^48 parameters at most.
  json j = llama32_1b();
  j["hidden_size"] = 1 << 20, j["intermediate_size"] = 1 << 20, j["num_hidden_layers"] = 1 << 14;
  j["num_attention_heads"] = 1 << 10, j["num_key_value_heads"] = 1 << 10, j["head_dim"] = 1 << 10;
  EXPECT_NE(error_of(j).find("at most 2^48 are supported"), std::string::npos) << error_of(j);
}

TEST(LlamaConfig, FileThatCannotBeParsedFailsNamingIt) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "tuna_config_1e400";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"hidden_size": 1e400, "intermediate_size": 64})";
  try {
    LlamaConfig::load(dir.string());
    ADD_FAILURE() << "1e400 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find((dir / "config.json").string() + ": not valid JSON"), std::string::npos) << e.what();
  }
  std::ofstream(dir / "config.json") << std::string(100000, '[') + std::string(100000, ']');
  try {
    LlamaConfig::load(dir.string());
    ADD_FAILURE() << "deep nesting accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nested deeper"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tuna
