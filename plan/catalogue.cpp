// The planner's catalogues (plan/planner.h): the GPUs and published models build/plan knows by name, and the
// counts a user types ("130B").
#include "plan/planner.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <ctime>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>

#include "core/error.h"
#include "core/progress.h"
#include "comm/comm.h"  // shard_range
#include "model/optimizer.h"  // dp_unit_pieces
#include "model/layout.h"
#include "model/lora_shape.h"
#include "plan/text.h"

namespace tuna {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace plan_text;

// ---- hardware ----

const std::vector<GpuKind>& gpu_catalogue() {
  // Peaks and HBM from NVIDIA's datasheets (SXM boards, dense bf16); hbm_bytes as nvidia-smi reports memory.total.
  // Bus bandwidths are nominal per-direction link rates at 80% (what nccl-tests commonly reach): the planner
  // says so, and build/bench_comm on the cluster measures the real figure (--intra_gbps overrides).
  static const std::vector<GpuKind> kinds = {
      {"h100-80gb", "NVIDIA H100 SXM 80 GB", 989.4e12, 81559.0 * (1 << 20), 3.35e12, 0.8 * 450e9,
       "NVLink 4: 450 GB/s per direction per GPU, 80% assumed reached"},
      {"h200", "NVIDIA H200 SXM 141 GB", 989.4e12, 143771.0 * (1 << 20), 4.8e12, 0.8 * 450e9,
       "NVLink 4: 450 GB/s per direction per GPU, 80% assumed reached"},
      {"a100-80gb", "NVIDIA A100 SXM 80 GB", 312e12, 81920.0 * (1 << 20), 2.039e12, 0.8 * 300e9,
       "NVLink 3: 300 GB/s per direction per GPU, 80% assumed reached"},
      // A 24 GB workstation card (Ada whitepaper: bf16 dense with fp32 accumulation); no NVLink, GPUs talk over PCIe.
      {"rtx-4090", "NVIDIA GeForce RTX 4090 24 GB", 165.2e12, 24564.0 * (1 << 20), 1.008e12, 0.8 * 32e9,
       "no NVLink: PCIe 4.0 x16, 32 GB/s per direction, 80% assumed reached"},
  };
  return kinds;
}

const GpuKind& find_gpu(const std::string& name) {
  std::string known;
  for (const GpuKind& g : gpu_catalogue()) {
    if (g.name == name) return g;
    known += (known.empty() ? "" : ", ") + g.name;
  }
  fail("unknown GPU kind '", name, "': the planner knows ", known,
       " (add one to gpu_catalogue in plan/planner.cpp with its peak, memory and bandwidth)");
}

// ---- models ----

const std::vector<std::pair<std::string, json>>& model_catalogue() {
  auto llama2 = [](int64_t hidden, int64_t ffn, int64_t layers, int64_t heads, int64_t kv) {
    return json{{"hidden_size", hidden}, {"intermediate_size", ffn}, {"num_hidden_layers", layers},
                {"num_attention_heads", heads}, {"num_key_value_heads", kv}, {"vocab_size", 32000},
                {"max_position_embeddings", 4096}, {"rms_norm_eps", 1e-5}, {"rope_theta", 10000.0},
                {"tie_word_embeddings", false}, {"torch_dtype", "bfloat16"}};
  };
  auto llama3 = [](int64_t hidden, int64_t ffn, int64_t layers, int64_t heads, bool tied) {
    return json{{"hidden_size", hidden}, {"intermediate_size", ffn}, {"num_hidden_layers", layers},
                {"num_attention_heads", heads}, {"num_key_value_heads", 8}, {"vocab_size", 128256},
                {"max_position_embeddings", 131072}, {"rms_norm_eps", 1e-5}, {"rope_theta", 500000.0},
                {"rope_scaling", {{"rope_type", "llama3"}, {"factor", tied ? 32.0 : 8.0}, {"low_freq_factor", 1.0},
                                  {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}}},
                {"tie_word_embeddings", tied}, {"torch_dtype", "bfloat16"}};
  };
  static const std::vector<std::pair<std::string, json>> models = {
      {"llama-3.2-1b", llama3(2048, 8192, 16, 32, true)},   {"llama-3.2-3b", llama3(3072, 8192, 28, 24, true)},
      {"llama-2-7b", llama2(4096, 11008, 32, 32, 32)},     {"llama-3.1-8b", llama3(4096, 14336, 32, 32, false)},
      {"llama-2-13b", llama2(5120, 13824, 40, 40, 40)},    {"llama-2-70b", llama2(8192, 28672, 80, 64, 8)},
      {"llama-3.1-70b", llama3(8192, 28672, 80, 64, false)},
  };
  return models;
}

LlamaConfig load_model_for_plan(const std::string& spec, std::string* name) {
  for (const auto& [n, j] : model_catalogue())
    if (n == spec) {
      if (name) *name = n;
      return LlamaConfig::from_json(j, "the planner's catalogue: " + n);
    }
  if (!fs::exists(spec)) {
    std::string known;
    for (const auto& [n, j] : model_catalogue()) known += (known.empty() ? "" : ", ") + n;
    fail("--model '", spec, "': no such file or directory, and not a model the planner knows (", known,
         "); give a config.json, a Hugging Face download or a tuna checkpoint directory");
  }
  if (name) *name = fs::path(spec).filename() == "config.json" ? fs::path(spec).parent_path().filename().string()
                                                               : fs::path(spec).filename().string();
  return LlamaConfig::load(spec);
}


double parse_count(const std::string& text, const std::string& what) {
  std::string digits;
  for (char ch : text)
    if (ch != ',' && ch != '_') digits += ch;
  double scale = 1;
  if (!digits.empty()) {
    const char last = static_cast<char>(std::toupper(static_cast<unsigned char>(digits.back())));
    const std::string suffixes = "KMBT";
    const size_t at = suffixes.find(last);
    if (at != std::string::npos) scale = std::pow(1e3, double(at + 1)), digits.pop_back();
  }
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(digits, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != digits.size() || !(v >= 0))
    fail(what, ": expected a count such as 130B, 7.5e9 or 500M, found '", text, "'");
  return v * scale;
}

}  // namespace tuna
