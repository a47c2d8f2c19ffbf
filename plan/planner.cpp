// The planner (plan/planner.h): hardware and model catalogues, measured rates, the step-time model, the job's
// verdict and the layout search.
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

namespace tuna {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string format_number(double x, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, x);
  return buf;
}

std::string gb(double bytes) { return format_number(bytes / 1e9, 2) + " GB"; }

// 1.23B, 45.6M: parameter and token counts.
std::string human_count(double x) {
  char buf[32];
  if (x >= 1e12) std::snprintf(buf, sizeof buf, "%.2fT", x / 1e12);
  else if (x >= 1e9) std::snprintf(buf, sizeof buf, "%.2fB", x / 1e9);
  else if (x >= 1e6) std::snprintf(buf, sizeof buf, "%.1fM", x / 1e6);
  else if (x >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", x / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", x);
  return buf;
}

}  // namespace

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

// ---- rates ----

namespace {

const json& field(const json& j, const std::string& key, const std::string& where) {
  if (!j.is_object() || !j.contains(key)) fail(where, ": missing field '", key, "'");
  return j[key];
}

double positive(const json& j, const std::string& key, const std::string& where) {
  const json& v = field(j, key, where);
  if (!v.is_number() || v.get<double>() <= 0)
    fail(where, ": field '", key, "': expected a positive number, found ", v.dump());
  return v.get<double>();
}

// A JSON file; null when it does not exist, an error naming it when it does not parse.
json read_json_file(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return json();
  try {
    return json::parse(in);
  } catch (const json::parse_error& e) {
    fail(path.string(), ": not valid JSON: ", e.what());
  }
}

std::string source_of(const json& section) {
  return section.is_object() && section.contains("source") && section["source"].is_string()
             ? section["source"].get<std::string>()
             : "(no source given)";
}

}  // namespace

Rates parse_rates(const json& j, const std::string& where) {
  Rates r;
  const json& device = field(j, "device", where);
  if (!device.is_string()) fail(where, ": field 'device': expected a GPU kind, found ", device.dump());
  r.device = device.get<std::string>();
  find_gpu(r.device);  // a table of an unknown card cannot be scaled to another
  const json& gemm = field(j, "gemm", where);
  const std::string gw = where + ": gemm";
  r.gemm_fwd = positive(gemm, "layer_fwd_tflops", gw) * 1e12;
  r.gemm_bwd = positive(gemm, "layer_bwd_tflops", gw) * 1e12;
  r.lm_head = positive(gemm, "lm_head_tflops", gw) * 1e12;
  if (gemm.contains("shapes"))
    for (const json& s : gemm["shapes"]) {
      const std::string sw = gw + ": shapes";
      const json& pass = field(s, "pass", sw);
      const int p = pass == "fwd" ? 0 : pass == "dinp" ? 1 : pass == "dweight" ? 2 : -1;
      if (p < 0) fail(sw, ": field 'pass': expected fwd, dinp or dweight, found ", pass.dump());
      r.gemm_shapes.push_back({static_cast<int64_t>(positive(s, "tokens", sw)), static_cast<int64_t>(positive(s, "in", sw)),
                               static_cast<int64_t>(positive(s, "out", sw)), p, positive(s, "tflops", sw) * 1e12});
    }
  r.sources["gemm"] = source_of(gemm);
  const json& att = field(j, "attention", where);
  for (const json& a : field(att, "rates", where + ": attention")) {
    const std::string aw = where + ": attention: rates";
    r.attention.push_back({static_cast<int64_t>(positive(a, "head_dim", aw)), static_cast<int64_t>(positive(a, "seq", aw)),
                           positive(a, "fwd_tflops", aw) * 1e12, positive(a, "bwd_tflops", aw) * 1e12});
  }
  if (r.attention.empty()) fail(where, ": attention: rates: expected at least one measured shape");
  r.sources["attention"] = source_of(att);
  const json& mem = field(j, "memory", where);
  r.copy_bytes_per_s = positive(mem, "copy_gbps", where + ": memory") * 1e9;
  for (const char* k : {"rmsnorm_fwd", "rmsnorm_bwd", "rope", "swiglu_fwd", "swiglu_bwd", "classifier", "grad_norm",
                        "adamw_fp32", "adamw_bf16"})
    r.of_copy[k] = positive(field(mem, "of_copy", where + ": memory"), k, where + ": memory: of_copy");
  r.sources["memory"] = source_of(mem);
  const json& over = field(j, "step_overhead", where);
  const json& fraction = field(over, "fraction", where + ": step_overhead");
  if (!fraction.is_number() || fraction.get<double>() < 0)
    fail(where, ": step_overhead: field 'fraction': expected a number >= 0, found ", fraction.dump());
  r.overhead = fraction.get<double>();
  r.sources["step_overhead"] = source_of(over);
  return r;
}

Rates load_rates(const fs::path& path) {
  const json j = read_json_file(path);
  if (j.is_null()) fail(path.string(), ": cannot open the rates table (plan/plan_rates.json of the checkout; --rates FILE)");
  return parse_rates(j, path.string());
}

fs::path default_rates_path() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {  // build/plan -> build/../plan/plan_rates.json; build/gpu-check/bin/plan -> ../../../plan/...
    for (fs::path dir = exe.parent_path(); !dir.empty() && dir != dir.root_path(); dir = dir.parent_path())
      if (fs::is_regular_file(dir / "plan" / "plan_rates.json")) return dir / "plan" / "plan_rates.json";
  }
  return fs::path("plan") / "plan_rates.json";
}

double Rates::gemm(int64_t tokens, int64_t in, int64_t out, int pass) const {
  // The nearest measured shape of the same pass, by log distance in tokens and in weight size.
  double best = INFINITY, rate = pass == 0 ? gemm_fwd : gemm_bwd;
  for (const GemmShape& s : gemm_shapes) {
    if (s.pass != pass) continue;
    const double d = std::abs(std::log(double(s.tokens) / tokens)) + std::abs(std::log(double(s.in * s.out) / double(in * out)));
    if (d < best) best = d, rate = s.flops;
  }
  return rate;
}

double Rates::attention_rate(int64_t head_dim, int64_t seq, bool backward) const {
  const Attention* best = nullptr;
  double best_d = INFINITY;
  for (const Attention& a : attention) {
    const double d = std::abs(std::log(double(a.head_dim) / head_dim)) * 4 + std::abs(std::log(double(a.seq) / seq));
    if (d < best_d) best_d = d, best = &a;
  }
  return backward ? best->bwd : best->fwd;
}

double Rates::memory_rate(const std::string& kernel) const {
  auto it = of_copy.find(kernel);
  TUNA_CHECK(it != of_copy.end(), "no rate for kernel ", kernel);
  return it->second * copy_bytes_per_s;
}

namespace {

// One bench's Google Benchmark JSON from a gpu-check run: OUTDIR/benches.json (what comes back from the GPU
// machine: {"gemm": ..., "attention": ..., ...}) or that file itself, or a directory of one file per bench
// (NAME.json or bench_NAME.json, as gpu-check writes them while it runs). Null when absent.
json read_bench(const fs::path& where, const std::string& name) {
  const fs::path merged = fs::is_directory(where) ? where / "benches.json" : where;
  if (fs::is_regular_file(merged)) {
    const json all = read_json_file(merged);
    return all.contains(name) ? all[name] : json();
  }
  for (const fs::path& p : {where / (name + ".json"), where / ("bench_" + name + ".json")})
    if (fs::is_regular_file(p)) return read_json_file(p);
  return json();
}

// "BM_Gemm/ic:2048/oc:512/pass:1/manual_time" -> the value of `arg`, -1 when absent.
int64_t bench_arg(const std::string& name, const std::string& arg) {
  const size_t at = name.find("/" + arg + ":");
  if (at == std::string::npos) return -1;
  return std::stoll(name.substr(at + arg.size() + 2));
}

std::string today_utc() {
  char buf[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

}  // namespace

json rates_from_bench(const json& base, const fs::path& dir) {
  parse_rates(base, "the rates table to refresh");
  json out = base;
  const std::string stamp = str("gpu-check in ", dir.string(), " (", today_utc(), ")");
  bool any = false;
  const json gemm = read_bench(dir, "gemm");
  if (gemm.contains("benchmarks")) {
    json shapes = json::array();
    double fwd_sum = 0, bwd_sum = 0;
    int fwd_n = 0, bwd_n = 0;
    for (const json& b : gemm["benchmarks"]) {
      const std::string name = b.value("name", "");
      const int64_t in = bench_arg(name, "ic"), oc = bench_arg(name, "oc"), pass = bench_arg(name, "pass");
      if (in < 0 || oc < 0 || pass < 0 || !b.contains("TFLOP/s")) continue;
      const double tf = b["TFLOP/s"].get<double>();
      shapes.push_back({{"tokens", 8192}, {"in", in}, {"out", oc}, {"pass", pass == 0 ? "fwd" : pass == 1 ? "dinp" : "dweight"},
                        {"tflops", tf}});
      (pass == 0 ? fwd_sum : bwd_sum) += tf;
      (pass == 0 ? fwd_n : bwd_n)++;
    }
    if (!shapes.empty()) {
      out["gemm"]["shapes"] = shapes;
      if (fwd_n) out["gemm"]["layer_fwd_tflops"] = fwd_sum / fwd_n;
      if (bwd_n) out["gemm"]["layer_bwd_tflops"] = bwd_sum / bwd_n;
      out["gemm"]["source"] = "layer GEMMs: bench_gemm_gpu of " + stamp + " (per shape; the means for other shapes); lm_head: " +
                              base["gemm"].value("source", "");
      any = true;
    }
  }
  const json att = read_bench(dir, "attention");
  if (att.contains("benchmarks")) {
    std::map<std::pair<int64_t, int64_t>, json> rates;
    for (const json& b : att["benchmarks"]) {
      const std::string name = b.value("name", "");
      const int64_t seq = bench_arg(name, "seq"), hd = bench_arg(name, "hd"), bwd = bench_arg(name, "bwd");
      if (seq < 0 || hd < 0 || bwd < 0 || !b.contains("TFLOP/s")) continue;
      json& r = rates[{hd, seq}];
      r["head_dim"] = hd, r["seq"] = seq;
      r[bwd ? "bwd_tflops" : "fwd_tflops"] = b["TFLOP/s"].get<double>();
    }
    json list = json::array();
    for (auto& [key, r] : rates)
      if (r.contains("fwd_tflops") && r.contains("bwd_tflops")) list.push_back(r);
    if (!list.empty()) {
      out["attention"] = {{"source", "bench_attention_gpu of " + stamp}, {"rates", list}};
      any = true;
    }
  }
  const json mem = read_bench(dir, "memory");
  if (mem.contains("benchmarks")) {
    const std::map<std::string, std::string> kernels = {{"BM_RmsNormFwd", "rmsnorm_fwd"}, {"BM_RmsNormBwd", "rmsnorm_bwd"},
                                                        {"BM_Rope", "rope"},           {"BM_SwigluFwd", "swiglu_fwd"},
                                                        {"BM_SwigluBwd", "swiglu_bwd"}, {"BM_AdamW/0", "adamw_fp32"},
                                                        {"BM_AdamW/1", "adamw_bf16"}};
    int found = 0;
    for (const json& b : mem["benchmarks"]) {
      const std::string name = b.value("name", "");
      if (name.rfind("BM_Copy", 0) == 0 && b.contains("GB/s")) out["memory"]["copy_gbps"] = b["GB/s"].get<double>(), found++;
      for (const auto& [prefix, key] : kernels)
        if ((name == prefix || name.rfind(prefix + "/", 0) == 0) && b.contains("of_copy"))
          out["memory"]["of_copy"][key] = b["of_copy"].get<double>(), found++;
    }
    if (found) {
      out["memory"]["source"] = "bench_memory_gpu of " + stamp + "; kernels it does not bench (classifier, gradient norm): " +
                                base["memory"].value("source", "");
      any = true;
    }
  }
  if (!any)
    fail(dir.string(), ": no GEMM, attention or memory bench results (gpu-check's OUTDIR/benches.json, or a "
         "directory of gemm.json, attention.json, memory.json)");
  parse_rates(out, "the refreshed rates table");
  return out;
}

// ---- memory ----

namespace {

// The dimensions of tp rank 0 as a model of their own: a tp-local model is what one tp rank holds (hidden and
// the norms whole; heads, ffn and vocabulary split).
LlamaConfig tp_local_model(const LlamaConfig& c, int64_t tp) {
  const ParamLayout split(c, 0, static_cast<int>(tp));  // refuses a tp that splits kv groups, naming it
  LlamaConfig local = c;
  local.num_attention_heads = split.tp().heads;
  local.num_key_value_heads = split.tp().kv_heads;
  local.intermediate_size = split.tp().ffn;
  local.vocab_size = split.tp().vocab;
  return local;
}

}  // namespace

MemoryPlan design_gpu_memory(const LlamaConfig& config, const MemoryLayout& layout) {
  // The engine's own plan of one tp rank's dimensions as a model of their own, at the same dp, ZeRO stage,
  // recompute and batch: what a GPU holds under Megatron splits (heads, ffn and vocabulary split; hidden, the
  // norms and the [tokens, hidden] activations whole: no sequence parallelism).
  MemoryLayout near = layout;
  near.tp = 1, near.tp_rank = 0;
  return plan_gpu_memory(tp_local_model(config, layout.tp), near);
}

// ---- the step ----

namespace {

// Whether the CUDA engine trains these adapters, laying them out from plan_gpu_memory's adapter items: it does at
// ZeRO 0-3 on a bf16 base and 0-2 on an nf4 base (model/llama_gpu.cpp), with or without sp, and over pipeline stages
// (ZeRO 0-1, as a full fine-tune) on a bf16 or nf4 base; the adapter plans it does not run yet (an nf4 base sharded
// at ZeRO-3, an int8 base) are the design, and the plan says so.
std::string cuda_adapter_refusal(const MemoryLayout& l) {
  if (!l.lora.enabled()) return "";
  if (l.lora.base_quant == BaseQuant::Int8)
    return "an int8 base is not trained on cuda yet (--base_quant int8 with --device cuda)";
  if (l.training && l.zero == 3 && l.lora.base_quant != BaseQuant::None)
    return "a quantized base is not sharded on cuda (--base_quant with --zero 3)";
  return "";
}
// The memory of one layout: the engine's own plan, or, for a layout it refuses, the design.
struct GpuMemory {
  MemoryPlan plan;
  bool engines = true;
  std::string refusal;
};

GpuMemory gpu_memory_plan(const LlamaConfig& c, const MemoryLayout& l) {
  GpuMemory m;
  try {
    m.plan = plan_gpu_memory(c, l);
  } catch (const Error& e) {
    m.engines = false, m.refusal = e.what();
    m.plan = design_gpu_memory(c, l);
  }
  // Pipeline stages at ZeRO-2 and 3, which the CUDA engine does not run (it runs them at ZeRO 0 and 1): their plans
  // are the design. Sequence parallelism is priced as the engine runs it (a bf16 all-gather before the column-parallel
  // GEMMs, a bf16 reduce-scatter after the row-parallel ones).
  if (m.engines && l.pp > 1 && l.zero >= 2)
    m.engines = false, m.refusal = "pipeline stages run on cuda at ZeRO 0 and 1 only (--pp with --zero 2 or 3)";
  if (const std::string refusal = cuda_adapter_refusal(l); m.engines && !refusal.empty())
    m.engines = false, m.refusal = refusal;
  return m;
}

// A plan's peak, memoized: a search and its suggestions ask for the same plans many times (an 80-layer plan has a
// thousand items; a pipeline layout has a plan per stage). The plan itself is made again for the one printed.
struct GpuPeak {
  int64_t peak = 0;
  bool engines = true;
  std::string refusal;
};

const GpuPeak& gpu_peak(const LlamaConfig& c, const MemoryLayout& l) {
  static std::map<std::string, GpuPeak> cache;
  static std::mutex mutex;
  const std::string key = str(c.hidden_size, ",", c.intermediate_size, ",", c.num_hidden_layers, ",",
                              c.num_attention_heads, ",", c.num_key_value_heads, ",", c.head_dim, ",", c.vocab_size, ",",
                              c.tie_word_embeddings, "|", l.dp, ",", l.tp, ",", l.dp_rank, ",", l.tp_rank, ",", l.zero,
                              ",", l.zero_prefetch, ",", recompute_name(l.recompute), ",", l.bf16_moments, ",",
                              l.master_weights, ",", l.training, ",", l.micro_batch, ",", l.seq_len, ",", l.lora.rank,
                              ",", l.lora.targets, ",", l.lora.dropout, ",", base_quant_name(l.lora.base_quant), ",",
                              l.pp, ",", l.pp_rank, ",", l.sp, ",", static_cast<int>(l.attention));
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  const GpuMemory m = gpu_memory_plan(c, l);
  std::lock_guard<std::mutex> lock(mutex);
  return cache.emplace(key, GpuPeak{m.plan.peak(), m.engines, m.refusal}).first->second;
}

// Tensor-parallel rank 0's layout, kept for the next prediction of the same model and tp (a search makes thousands).
const ParamLayout& tp_rank0_layout(const LlamaConfig& c, int64_t tp) {
  thread_local std::map<std::string, std::unique_ptr<const ParamLayout>> cache;
  const std::string key = c.to_json().dump() + str("|", tp);
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  if (cache.size() >= 64) cache.clear();
  return *cache.emplace(key, std::make_unique<const ParamLayout>(c, 0, static_cast<int>(tp))).first->second;
}

// Rates measured on one card, applied to another: compute-bound rates by the ratio of bf16 peaks, memory-bound
// ones by the ratio of HBM bandwidths.
struct Scaling {
  double compute = 1, memory = 1;
  std::string note;
};

Scaling scaling_for(const Rates& r, const GpuKind& gpu) {
  Scaling s;
  if (gpu.name == r.device) return s;
  const GpuKind& measured = find_gpu(r.device);
  s.compute = gpu.peak_bf16_flops / measured.peak_bf16_flops;
  s.memory = gpu.hbm_bytes_per_s / measured.hbm_bytes_per_s;
  s.note = str("rates measured on ", r.device, ", scaled to ", gpu.name, " (compute x", format_number(s.compute, 2),
               " by bf16 peak, memory-bound x", format_number(s.memory, 2), " by HBM bandwidth): unmeasured on ", gpu.name);
  return s;
}

double ring_factor_all_reduce(int64_t n) { return n > 1 ? 2.0 * double(n - 1) / double(n) : 0.0; }
double ring_factor_gather(int64_t n) { return n > 1 ? double(n - 1) / double(n) : 0.0; }

}  // namespace

namespace {

// keep_plan false: the prediction without its memory plan (the search ranks thousands of layouts by their figures).
Prediction predict_layout(const JobSpec& job, const Rates& rates, bool keep_plan) {
  const LlamaConfig& c = job.model;
  const MemoryLayout& l = job.layout;
  const Cluster& k = job.cluster;
  if (l.pp < 1) fail("--pp: expected at least 1 pipeline stage, found ", l.pp);
  if (l.dp * l.pp * l.tp != k.gpus())
    fail("layout dp ", l.dp, l.pp > 1 ? str(" x pp ", l.pp) : std::string(), " x tp ", l.tp, " is ", l.dp * l.pp * l.tp,
         " ranks, but the cluster has ", k.gpus(), " GPUs (", k.nodes, " nodes x ", k.gpus_per_node, ")");
  if (l.tp > k.gpus_per_node || k.gpus_per_node % l.tp != 0)
    fail("--tp ", l.tp, ": tensor-parallel ranks must sit inside a node and divide its ", k.gpus_per_node, " GPUs");
  if (l.seq_len > c.max_position_embeddings)
    fail("--seq_len ", l.seq_len, " exceeds the model's max_position_embeddings ", c.max_position_embeddings);
  if (job.grad_accum < 1) fail("--grad_accum: expected >= 1, found ", job.grad_accum);
  if (l.sp && l.seq_len % l.tp != 0)
    fail("--sp: sequence parallelism splits each sequence over the ", l.tp, " tp ranks; --seq_len ", l.seq_len,
         " is not a multiple of ", l.tp);
  // 1F1B fills the pipe with pp micro-batches before the first backward; the plans count that many in flight.
  if (l.pp > 1 && job.grad_accum < l.pp)
    fail("--grad_accum ", job.grad_accum, " with --pp ", l.pp, ": a 1F1B pipeline needs at least as many micro-batches "
         "per step as stages");
  check_lora_plan(c, l.lora, "build/plan --lora_rank, --lora_targets, --lora_dropout, --base_quant");

  Prediction p;
  p.layout = l, p.grad_accum = job.grad_accum;
  p.stages = pipeline_stages(c, l.pp, l.seq_len);
  // Every stage's plan; the fullest is the one shown, and the layout fits when it does.
  p.gpu_bytes = -1;
  for (int64_t s = 0; s < l.pp; s++) {
    MemoryLayout stage = l;
    stage.pp_rank = s;
    const GpuPeak& memory = gpu_peak(c, stage);
    const double bytes = double(memory.peak) + k.reserve_bytes;
    p.stage_gpu_bytes.push_back(bytes);
    if (bytes > p.gpu_bytes) {
      p.gpu_bytes = bytes, p.fullest_stage = s;
      p.memory_is_engines = memory.engines, p.not_implemented = memory.refusal;
    }
  }
  p.fits = p.gpu_bytes <= k.gpu.hbm_bytes;
  if (keep_plan) {
    MemoryLayout stage = l;
    stage.pp_rank = p.fullest_stage;
    p.memory = gpu_memory_plan(c, stage).plan;
  }

  const Scaling scale = scaling_for(rates, k.gpu);
  if (!scale.note.empty()) p.notes.push_back(scale.note);
  const ParamLayout& layout = tp_rank0_layout(c, l.tp);
  const TpDims& d = layout.tp();
  const int64_t n = l.micro_batch * l.seq_len, C = c.hidden_size;
  const int64_t qd = d.q_dim, kvd = d.kv_dim, F = d.ffn, V = d.vocab;
  const LoraPlan& lora = l.lora;
  const bool adapters = lora.enabled();
  auto gemm_time = [&](int64_t in, int64_t out, int pass) {
    return 2.0 * double(n) * double(in) * double(out) / (rates.gemm(n, in, out, pass) * scale.compute);
  };
  auto mem_time = [&](double bytes, const char* kernel) { return bytes / (rates.memory_rate(kernel) * scale.memory); };
  const double copy_rate = rates.copy_bytes_per_s * scale.memory;

  // One micro-batch, one layer.
  // The GPU model's GEMMs: q|k|v and gate|up fused (one GEMM over each adjacent weight block), o_proj, down_proj.
  // A frozen weight (adapters) has no weight-gradient GEMM: 4 FLOPs per weight and token instead of 6.
  const std::vector<std::pair<int64_t, int64_t>> gemms = {{C, qd + 2 * kvd}, {qd, C}, {C, 2 * F}, {F, C}};
  double layer_fwd_gemm = 0, layer_bwd_gemm = 0;
  for (const auto& [in, out] : gemms) {
    layer_fwd_gemm += gemm_time(in, out, 0);
    layer_bwd_gemm += gemm_time(in, out, 1) + (adapters ? 0.0 : gemm_time(in, out, 2));
  }
  // Adapters: 6 FLOPs per adapter weight and token, in GEMMs r wide. Those move more bytes than they compute:
  // each reads or accumulates into a [tokens, in] or [tokens, out] activation. A GEMM group reads its input once
  // (q|k|v's A share x, as do gate|up's) unless dropout draws a mask per target. Forward: read x, write A x, read it
  // and accumulate B A x into the base's output (read and write); backward: read dy twice (dB and B^T dy), read x
  // for dA, accumulate A's share into dx. Priced at the larger of the FLOPs at the layer GEMM rates and the bytes
  // at the measured copy bandwidth (the skinny GEMMs are not benched).
  double lora_fwd = 0, lora_bwd = 0, lora_fwd_bytes = 0, lora_bwd_bytes = 0;
  int64_t lora_layer = 0;
  struct AdapterGroup {
    int64_t in = 0, width = 0;  // input features; summed rank of its targets (the tp all-reduce's width)
    bool column = true;
  };
  std::vector<AdapterGroup> groups;
  if (adapters) {
    const std::vector<LoraTargetShape> shapes = lora_layer_shapes(c, lora, l.tp);
    lora_layer = lora_layer_params(c, lora, l.tp);
    const double tokens = double(n), r = double(lora.rank);
    // q|k|v share the attention's input and gate|up the MLP's; o and down are their own.
    const auto group_of = [](const std::string& m) {
      return m == "o_proj" ? 1 : m == "gate_proj" || m == "up_proj" ? 2 : m == "down_proj" ? 3 : 0;
    };
    int last_group = -1;
    for (const LoraTargetShape& t : shapes) {
      const bool shares_input = lora.dropout == 0 && group_of(t.module) == last_group;
      last_group = group_of(t.module);
      if (!shares_input) groups.push_back({t.in, 0, t.column_parallel});
      groups.back().width += lora.rank;
      lora_fwd_bytes += tokens * (4 * r + 4 * double(t.out));
      lora_bwd_bytes += tokens * (4 * r + 4 * double(t.out));
      if (lora.dropout > 0)  // dropout(x) written in the forward and again for dA, from the kept bit mask
        lora_fwd_bytes += tokens * double(t.in) * 4.125, lora_bwd_bytes += tokens * double(t.in) * 4.125;
    }
    for (const AdapterGroup& g : groups) lora_fwd_bytes += tokens * 2 * double(g.in), lora_bwd_bytes += tokens * 6 * double(g.in);
    const double flops = 2.0 * tokens * double(lora_layer);
    lora_fwd = std::max(flops / (rates.gemm_fwd * scale.compute), lora_fwd_bytes / copy_rate);
    lora_bwd = std::max(2 * flops / (rates.gemm_bwd * scale.compute), lora_bwd_bytes / copy_rate);
  }
  // QLoRA: each use of a layer's weights dequantizes them into one bf16 buffer, memory-bound (read the stored bytes,
  // write 2 per weight) at the measured copy bandwidth: once in the forward, once in the backward, once in a full
  // recompute.
  double dequant = 0;
  int64_t layer_quantized_bytes = 0, layer_quantized_elements = 0;
  if (adapters && lora.base_quant != BaseQuant::None) {
    for (const ParamTensor& t : layout.tensors())
      if (t.layer == 0 && base_tensor_quantized(t))
        layer_quantized_bytes += base_storage_bytes(t, lora.base_quant), layer_quantized_elements += t.numel;
    dequant = double(layer_quantized_bytes + 2 * layer_quantized_elements) / copy_rate;
  }
  // Causal attention inside documents of `span` tokens: each query sees span / 2 keys on average, and the kernels
  // run at the rate measured for causal attention of that length (their blocks are those of a span-long row).
  const double doc_tokens = job.mean_doc_tokens > 0 ? std::min<double>(job.mean_doc_tokens, double(l.seq_len))
                                                    : double(l.seq_len);
  const int64_t span = std::max<int64_t>(1, std::llround(doc_tokens));
  const double att_flops = 4.0 * double(l.micro_batch) * double(d.heads) * double(l.seq_len) * doc_tokens / 2 *
                           double(c.head_dim);
  const double att_fwd = att_flops / (rates.attention_rate(c.head_dim, span, false) * scale.compute);
  const double att_bwd = 2.5 * att_flops / (rates.attention_rate(c.head_dim, span, true) * scale.compute);
  // sp: the norms run on each tp rank's seq / tp rows.
  const double norm_rows = l.sp ? double(n) / double(l.tp) : double(n);
  const double norm_fwd = mem_time(norm_rows * (4.0 * C + 4), "rmsnorm_fwd");
  const double norm_bwd = mem_time(norm_rows * 8.0 * C, "rmsnorm_bwd");
  const double rope = mem_time(4.0 * double(n) * double(qd + kvd), "rope");
  const double swiglu_fwd = mem_time(6.0 * double(n) * F, "swiglu_fwd"), swiglu_bwd = mem_time(10.0 * double(n) * F, "swiglu_bwd");
  const double layer_mem_fwd = 2 * norm_fwd + rope + swiglu_fwd, layer_mem_bwd = 2 * norm_bwd + rope + swiglu_bwd;
  double recompute = 0;
  if (l.recompute == Recompute::Full) recompute = layer_fwd_gemm + lora_fwd + dequant + att_fwd + layer_mem_fwd;
  if (l.recompute == Recompute::Selective) recompute = 2 * norm_fwd + swiglu_fwd;
  // The loss head, once per micro-batch (vocab-parallel under tp); a frozen head has no weight gradient.
  const double head_flops = 2.0 * double(n) * double(C) * double(V);
  const double head = (adapters ? 2 : 3) * head_flops / (rates.lm_head * scale.compute) +
                      mem_time(4.0 * double(n) * V, "classifier") + norm_fwd + norm_bwd;
  const double A = double(job.grad_accum);
  // One micro-batch through one stage: its layers, and the head on the last stage (the embedding lookup costs
  // nothing here). Under 1F1B every stage runs at the pace of the slowest one.
  const double layer_kernels = layer_fwd_gemm + layer_bwd_gemm + lora_fwd + lora_bwd + 2 * dequant + att_fwd +
                               att_bwd + layer_mem_fwd + layer_mem_bwd + recompute;
  const auto micro_kernels = [&](const PipelineStage& s) {
    return double(s.layers()) * layer_kernels + (s.head ? head : 0.0);
  };
  // Tensor parallel, on the critical path inside a node: per layer two collectives of a bf16 [tokens, hidden] in the
  // forward and two in the backward (two more in a full recompute's forward), one for the vocab-parallel embedding and
  // one for the head. Without sp each is an all-reduce; with sp an all-gather before a column-parallel GEMM and a
  // reduce-scatter after a row-parallel one, the all-reduce's bytes in two collectives (two latencies).
  const double tp_bytes = 2.0 * double(n) * double(C);  // one bf16 [tokens, hidden] tensor
  const bool full = l.recompute == Recompute::Full;
  const auto tp_count = [&](const PipelineStage& s) {
    return l.tp > 1 ? double(4 * s.layers() + s.embedding + s.head + (full ? 2 * s.layers() : 0)) : 0.0;
  };
  const double tp_one = ring_factor_all_reduce(l.tp) * tp_bytes / k.intra_busbw + (l.sp ? 20e-6 : 10e-6);
  // sp keeps a norm's output split: the backward gathers it again for the weight gradient of q|k|v and of gate|up,
  // while the input-gradient GEMM of the same weights runs (Megatron's overlap): what outlasts that GEMM is exposed.
  const bool sp = l.sp && l.tp > 1;
  const double regather = sp ? ring_factor_gather(l.tp) * tp_bytes / k.intra_busbw + 10e-6 : 0.0;
  const double regather_exposed = sp ? std::max(0.0, regather - gemm_time(C, qd + 2 * kvd, 1)) +
                                           std::max(0.0, regather - gemm_time(C, 2 * F, 1))
                                     : 0.0;
  // The replicated adapter factor of each group needs its r-wide product summed over tp: B^T dy of a
  // column-parallel group (for dA), A x of a row-parallel target (for dB). One all-reduce per group and layer.
  double adapter_tp_layer = 0;
  if (l.tp > 1 && adapters)
    for (const AdapterGroup& g : groups)
      adapter_tp_layer += ring_factor_all_reduce(l.tp) * 2.0 * double(n) * double(g.width) / k.intra_busbw + 10e-6;
  // A stage's micro-batch period: its kernels with their launch gaps and its exposed tp collectives.
  const auto period = [&](const PipelineStage& s) {
    return micro_kernels(s) * (1 + rates.overhead) + tp_count(s) * tp_one +
           double(s.layers()) * (adapter_tp_layer + regather_exposed);
  };
  int64_t slow = 0;
  for (int64_t s = 1; s < l.pp; s++)
    if (period(p.stages[s]) > period(p.stages[slow])) slow = s;
  p.slowest_stage = slow;
  const PipelineStage& st = p.stages[slow];
  const double Ls = double(st.layers());

  // Where the ranks sit: rank = (dp_rank x pp + stage) x tp + tp_rank (comm/comm.h Mesh), gpus_per_node to a node.
  const auto node_of = [&](int64_t dp_rank, int64_t stage) { return (dp_rank * l.pp + stage) * l.tp / k.gpus_per_node; };
  bool across = false;  // a dp group spans nodes
  for (int64_t dr = 1; dr < l.dp; dr++)
    for (int64_t s = 0; s < l.pp; s++) across |= node_of(dr, s) != node_of(0, s);
  const double bw = across ? k.inter_busbw : k.intra_busbw;
  const std::string link = across ? k.inter_note : k.intra_note;
  const double latency = (across ? 25e-6 : 10e-6) * (l.dp > 1 ? 1 : 0);
  const double g = ring_factor_gather(l.dp), ar = ring_factor_all_reduce(l.dp);
  const std::string what = adapters ? "layer's adapter" : "unit";

  // Each stage's optimizer and data-parallel collectives, over its own parameters (with adapters, pp 1: this rank's
  // piece of each layer's adapters). The step ends with the stage whose tail is longest.
  struct Tail {
    int64_t owned = 0;
    double adamw = 0, grad_norm = 0, dp_s = 0, dp_hidden = 0, overlap = 0, kernels = 0;
    double base_bytes = 0;  // with adapters: the stage's frozen base, in its stored bytes (per tp rank)
    std::string dp_what;
  };
  const auto tail_of = [&](const PipelineStage& stage) {
    Tail t;
    int64_t params = 0, unit_count = 0;
    for (int u : pipeline_stage_units(layout, stage)) {
      const auto [begin, end] = layout.unit_range(u);
      params += end - begin, unit_count++;
      t.owned += l.zero >= 1 ? shard_range(end - begin, 0, static_cast<int>(l.dp)).size() : end - begin;
      if (adapters)
        for (const ParamTensor& x : layout.tensors())
          if (x.offset >= begin && x.offset < end) t.base_bytes += double(base_storage_bytes(x, lora.base_quant));
    }
    // With adapters: the stage's layers' adapters (a stage holds its own, model/lora.h).
    const int64_t stage_layers = stage.layers();
    if (adapters)
      t.owned = stage_layers * (l.zero >= 1 ? shard_range(lora_layer, 0, static_cast<int>(l.dp)).size() : lora_layer);
    t.adamw = mem_time(double(t.owned) * (4 + 2 * 4 + 4 * (l.bf16_moments ? 2 : 4) + 2),
                       l.bf16_moments ? "adamw_bf16" : "adamw_fp32");
    t.grad_norm = mem_time(4.0 * double(t.owned), "grad_norm");
    t.kernels = A * micro_kernels(stage) + t.adamw + t.grad_norm;
    // With adapters only their gradients cross dp (one unit per layer); at ZeRO-3 the frozen base's units are
    // gathered too, in their stored bytes.
    const double grads = adapters ? double(stage_layers * lora_layer) : double(params);
    const double units = adapters ? double(stage_layers) : double(unit_count);
    switch (l.zero) {
      case 0:
        t.dp_s = ar * 4.0 * grads / bw + latency * units;
        t.dp_what = adapters ? "all-reduce of the adapters' fp32 gradients after the backward"
                             : "all-reduce of the fp32 gradients after the backward";
        break;
      case 1:
        t.dp_s = g * (4.0 + 4.0) * grads / bw + 2 * latency * units;
        t.dp_what = str("reduce-scatter of the ", adapters ? "adapters' " : "",
                        "fp32 gradients, all-gather of the weights (fp32, through the gradient buffer)");
        break;
      case 2:
        t.dp_s = A * (g * 4.0 * grads / bw + latency * units) + g * 2.0 * grads / bw + latency * units;
        t.dp_what = str("per micro-batch a reduce-scatter of each ", what,
                        "'s fp32 gradient; after the step an all-gather of the ", adapters ? "adapters' " : "",
                        "bf16 weights");
        break;
      default:
        if (adapters) {
          const double base_units = double(unit_count);
          t.dp_s = A * (g * 2.0 * t.base_bytes / bw + 2 * latency * base_units + g * 4.0 * grads / bw + latency * units) +
                   g * 2.0 * grads / bw + latency * units;
          t.dp_what = str("per micro-batch two all-gathers of each unit of the frozen base (",
                          lora.base_quant == BaseQuant::None ? "bf16" : base_quant_name(lora.base_quant), ", ",
                          human_bytes(t.base_bytes), " per tp rank) and a reduce-scatter of each layer's adapter gradient");
        } else {
          t.dp_s = A * (g * (2.0 + 2.0 + 4.0) * grads / bw + 3 * latency * units);
          t.dp_what =
              "per micro-batch two all-gathers of each unit's bf16 weights and a reduce-scatter of its fp32 gradient";
        }
    }
    // What the engine hides behind compute: ZeRO-0/1 on cuda communicate after the backward (nothing hidden);
    // ZeRO-2/3 as designed overlap every unit but the first gather and the last reduce-scatter.
    t.overlap = job.overlap ? *job.overlap : l.zero <= 1 ? 0.0 : 1.0 - 2.0 / (units + 2);
    t.dp_hidden = std::min(t.dp_s * t.overlap, t.kernels);
    return t;
  };
  int64_t tail_stage = 0;
  Tail tail = tail_of(p.stages[0]);
  for (int64_t s = 1; s < l.pp; s++) {
    const Tail t = tail_of(p.stages[s]);
    const auto length = [&](const Tail& x) { return (x.adamw + x.grad_norm) * (1 + rates.overhead) + x.dp_s - x.dp_hidden; };
    if (length(t) > length(tail)) tail = t, tail_stage = s;
  }

  const double kernels = A * micro_kernels(st) + tail.adamw + tail.grad_norm;
  p.compute = {
      {"layer GEMMs", A * Ls * (layer_fwd_gemm + layer_bwd_gemm),
       str(adapters ? "frozen: forward and input gradient, no weight gradient; " : "",
           rates.gemm_shapes.empty() ? "at the measured layer rates, " : "at the nearest measured shapes, ",
           format_number(rates.gemm_fwd / 1e12, 0), "/", format_number(rates.gemm_bwd / 1e12, 0), " TFLOP/s fwd/bwd")},
  };
  if (adapters)
    p.compute.push_back(
        {"adapter GEMMs", A * Ls * (lora_fwd + lora_bwd),
         str(human_count(double(lora_layer * st.layers())), " adapter weights on this GPU (", describe_lora(lora), "): ",
             format_number(2.0 * double(n) * double(lora_layer) * 3 / 1e9, 2), " GFLOP and ",
             human_bytes(lora_fwd_bytes + lora_bwd_bytes), " per layer and micro-batch, ",
             lora_fwd_bytes + lora_bwd_bytes > 0 &&
                     (lora_fwd_bytes + lora_bwd_bytes) / copy_rate >
                         3 * 2.0 * double(n) * double(lora_layer) / (rates.gemm_bwd * scale.compute)
                 ? "bound by the bytes at the copy bandwidth (r-wide GEMMs)"
                 : "bound by the FLOPs")});
  if (dequant > 0)
    p.compute.push_back({"dequantization", A * Ls * 2 * dequant,
                         str(base_quant_name(lora.base_quant), " to bf16 per layer and use (forward, backward",
                             l.recompute == Recompute::Full ? "; a full recompute's third is under recompute" : "", "): ",
                             human_bytes(double(layer_quantized_bytes)), " read and ",
                             human_bytes(2.0 * double(layer_quantized_elements)), " written at the copy bandwidth")});
  const std::vector<TimeItem> rest = {
      {"attention", A * Ls * (att_fwd + att_bwd),
       str("hd ", c.head_dim, ", seq ", l.seq_len,
           span < l.seq_len ? str(", documents of ", format_number(doc_tokens, 0), " tokens (masked)") : std::string(),
           ": ", format_number(rates.attention_rate(c.head_dim, span, false) / 1e12, 0), "/",
           format_number(rates.attention_rate(c.head_dim, span, true) / 1e12, 0), " TFLOP/s fwd/bwd")},
      {"norms, RoPE, SwiGLU", A * Ls * (layer_mem_fwd + layer_mem_bwd),
       str("memory-bound, at their measured share of the copy bandwidth", sp ? "; the norms on seq / tp rows (sp)" : "")},
      {"loss head", st.head ? A * head : 0.0,
       str("lm_head at ", format_number(rates.lm_head / 1e12, 0), " TFLOP/s, cross-entropy",
           adapters ? "; frozen: no weight gradient" : "")},
      {"recompute", A * Ls * recompute, l.recompute == Recompute::None ? "none" : str(recompute_name(l.recompute), " recompute")},
      {"AdamW and gradient norm", tail.adamw + tail.grad_norm,
       str(human_count(double(tail.owned)), adapters ? " adapter parameters owned" : " parameters owned",
           l.pp > 1 ? str(" (stage ", tail_stage, ")") : std::string())},
      {"launch gaps", kernels * rates.overhead, str(format_number(100 * rates.overhead, 1), "% of kernel time, measured")},
  };
  p.compute.insert(p.compute.end(), rest.begin(), rest.end());
  p.compute_s = kernels * (1 + rates.overhead);
  // 1F1B: m micro-batches take m + pp - 1 periods of the slowest stage; the pp - 1 more are the pipe filling and
  // draining, when a stage waits (the bubble, (pp - 1) / m of the micro-batches' time).
  p.bubble_s = double(l.pp - 1) * period(st);

  // Communication.
  const double tp_s = A * tp_count(st) * tp_one;
  if (l.tp > 1)
    p.communication.push_back(
        {sp ? "tensor-parallel all-gathers and reduce-scatters (sp)" : "tensor-parallel all-reduces", tp_s,
         str(format_number(tp_count(st), 0), sp ? " pairs" : "", " per micro-batch over ", l.tp, " GPUs, ",
             human_bytes(tp_bytes), " each", sp ? " gathered or scattered (the all-reduce's bytes)" : "", ", ",
             k.intra_note)});
  const double adapter_tp_s = A * Ls * adapter_tp_layer;
  if (l.tp > 1 && adapters)
    p.communication.push_back({"tensor-parallel adapter all-reduces", adapter_tp_s,
                               str(groups.size(), " per layer and micro-batch (r-wide: latency-bound), ", k.intra_note)});
  const double regather_s = A * Ls * 2 * regather, regather_exposed_s = A * Ls * regather_exposed;
  if (sp)
    p.communication.push_back(
        {"sequence-parallel backward re-gathers", regather_s,
         str("2 per layer and micro-batch (the norm outputs for the weight gradients of q|k|v and gate|up), ",
             format_number(regather_s > 0 ? 100 * (1 - regather_exposed_s / regather_s) : 100, 0),
             "% hidden behind the input-gradient GEMMs")});
  // Pipeline point to point: per micro-batch an activation forward and its gradient backward across each stage
  // boundary (with sp each tp rank's rows), on a stream of their own: hidden behind the next micro-batch's compute but
  // for the pipe's fill (the first activation through every boundary) and drain (the last gradient back), and for
  // whatever a transfer outlasts a micro-batch period.
  double p2p_s = 0, p2p_exposed = 0;
  if (l.pp > 1) {
    const double p2p_bytes = 2.0 * (sp ? double(n) / double(l.tp) : double(n)) * double(C);
    double worst = 0, fill_drain = 0;
    bool crosses = false;
    for (int64_t b = 0; b + 1 < l.pp; b++) {
      bool across_b = false;
      for (int64_t dr = 0; dr < l.dp; dr++) across_b |= node_of(dr, b) != node_of(dr, b + 1);
      const double one = p2p_bytes / (across_b ? k.inter_busbw : k.intra_busbw) + (across_b ? 25e-6 : 10e-6);
      worst = std::max(worst, one), fill_drain += 2 * one, crosses |= across_b;
    }
    p2p_s = A * 2 * worst;
    p2p_exposed = fill_drain + A * std::max(0.0, worst - period(st));
    p.communication.push_back(
        {"pipeline sends (1F1B)", p2p_s,
         str("per micro-batch an activation and its gradient, ", human_bytes(p2p_bytes), " each, across the slowest ",
             "stage boundary (", crosses ? k.inter_note : k.intra_note, "); ",
             format_number(p2p_s > 0 ? 100 * (1 - p2p_exposed / p2p_s) : 100, 0),
             "% hidden behind compute (exposed: the pipe's fill and drain)")});
  }
  if (l.dp > 1)
    p.communication.push_back({"data-parallel (ZeRO-" + std::to_string(l.zero) + ")", tail.dp_s,
                               str(tail.dp_what, l.pp > 1 ? str(" (stage ", tail_stage, "'s own)") : std::string(), "; ",
                                   link, "; ", format_number(100 * tail.overlap, 0), "% hidden behind compute",
                                   job.overlap   ? " (--overlap)"
                                   : l.zero <= 1 ? " (ZeRO-0/1 communicate between passes: nothing hidden)"
                                                 : " (ZeRO-2/3 communicate on a stream of their own: all but the first "
                                                   "gather and the last reduce-scatter, assumed hidden)")});
  p.communication_s = tp_s + adapter_tp_s + regather_s + p2p_s + tail.dp_s;
  p.exposed_s = tp_s + adapter_tp_s + regather_exposed_s + p2p_exposed + tail.dp_s - tail.dp_hidden;
  p.step_s = p.compute_s + p.bubble_s + p.exposed_s;
  if (l.pp > 1)
    p.notes.push_back(str("pipeline: ", format_pipeline_stages(p.stages), "; 1F1B over ", job.grad_accum,
                          " micro-batches: the bubble is (pp - 1) / m = ", format_number(100.0 * double(l.pp - 1) / A, 1),
                          "% of stage ", slow, "'s micro-batch time (it sets the pace)"));

  // The job.
  p.tokens_per_step = double(l.micro_batch * l.seq_len) * A * double(l.dp);
  p.tokens_per_s_per_gpu = p.tokens_per_step / p.step_s / double(k.gpus());
  // Model FLOPs count the attention a token does: over its document (the mask), not the whole window.
  p.mfu = p.tokens_per_s_per_gpu * (adapters ? lora_flops_per_token(c, lora, span) : model_flops_per_token(c, span)) /
          k.gpu.peak_bf16_flops;
  p.steps = std::ceil(job.tokens / p.tokens_per_step);
  p.wall_s = p.steps * p.step_s;
  p.cost = p.wall_s / 3600 * double(k.gpus()) * job.price_per_gpu_hour;
  p.finishes = job.hours <= 0 || p.wall_s <= job.hours * 3600;
  p.within_budget = job.budget <= 0 || p.cost <= job.budget;
  if (adapters) {
    // The frozen base whole on every dp rank needs no gathers; say which it is, and whether the other would fit.
    MemoryLayout other = l;
    other.zero = l.zero == 3 ? 2 : 3;
    const double other_bytes = double(gpu_peak(c, other).peak) + k.reserve_bytes;
    const bool other_fits = other_bytes <= k.gpu.hbm_bytes;
    const std::string base = str("the frozen base (", lora.base_quant == BaseQuant::None ? "bf16" : base_quant_name(lora.base_quant),
                                 ", ", gb(tail.base_bytes), l.tp > 1 ? " per tp rank" : "",
                                 l.pp > 1 ? str(" of stage ", tail_stage) : std::string(), ")");
    if (l.zero < 3 || l.dp == 1)
      p.notes.push_back(str(base, " is whole on every dp rank: no gathers", l.dp > 1 ? ", only the adapters' gradients cross dp" : ""));
    else
      p.notes.push_back(str(base, " is sharded by ZeRO-3 and gathered a unit at a time; whole on every dp rank (ZeRO-2) it ",
                            other_fits ? str("would fit too (", gb(other_bytes), " per GPU) without gathers")
                                       : str("does not fit (", gb(other_bytes), " per GPU)")));
  }
  if (!p.memory_is_engines)
    p.notes.push_back("memory as designed, not the engine's plan: the CUDA engine refuses this layout today (" +
                      p.not_implemented + ")");
  return p;
}

}  // namespace

Prediction predict(const JobSpec& job, const Rates& rates) { return predict_layout(job, rates, true); }

// ---- search ----

namespace {

std::vector<JobSpec> layouts_of(const JobSpec& job) {
  // The global batch stays the user's: micro_batch x grad_accum x dp sequences.
  const int64_t global = job.layout.micro_batch * job.grad_accum * job.layout.dp;
  const int64_t gpus = job.cluster.gpus();
  std::vector<JobSpec> out;
  for (int64_t tp = 1; tp <= job.cluster.gpus_per_node; tp *= 2) {
    if (job.model.num_key_value_heads % tp != 0 || gpus % tp != 0) continue;
    // Pipeline stages (with adapters too: a stage holds its layers' adapters) up to 8, as many as divide the GPUs
    // left: each stage has a plan of its own to make, and deeper pipes need more micro-batches than stages per step.
    for (int64_t pp = 1; pp <= std::min<int64_t>(8, job.model.num_hidden_layers) && gpus % (tp * pp) == 0; pp *= 2) {
      const int64_t dp = gpus / (tp * pp);
      for (bool sp : {false, true}) {
        if (sp && (tp == 1 || job.layout.seq_len % tp != 0)) continue;
        // ZeRO-3 with stages would gather a stage's weights again for every micro-batch in flight: left out.
        // At dp 1 ZeRO shards nothing (ZeRO-0 holds the least); the pp 1 search keeps every stage as before.
        for (int zero = 0; zero <= (pp == 1 ? 3 : dp == 1 ? 0 : 2); zero++)
          for (int64_t mb : {1, 2, 4, 8, 16}) {
            if (global % (mb * dp) != 0 || global / (mb * dp) < pp) continue;
            for (Recompute rc : {Recompute::None, Recompute::Selective, Recompute::Full})
              for (bool bf16 : {false, true}) {
                JobSpec j = job;
                j.layout.tp = tp, j.layout.pp = pp, j.layout.sp = sp, j.layout.dp = dp, j.layout.zero = zero;
                j.layout.micro_batch = mb, j.layout.recompute = rc, j.layout.bf16_moments = bf16;
                j.layout.dp_rank = j.layout.tp_rank = j.layout.pp_rank = 0;
                j.grad_accum = global / (mb * dp);
                out.push_back(j);
              }
          }
      }
    }
  }
  return out;
}

}  // namespace

std::vector<Prediction> search_layouts(const JobSpec& job, const Rates& rates, size_t limit, bool offer_adapters) {
  std::vector<Prediction> all;
  bool finished = false;
  for (const JobSpec& j : layouts_of(job)) {
    all.push_back(predict_layout(j, rates, false));
    finished |= all.back().fits && all.back().finishes;
  }
  // A full fine-tune that no layout finishes in time: the same job with adapters, the base in bf16 and in nf4.
  if (offer_adapters && !finished && job.hours > 0 && !job.layout.lora.enabled() && job.offer_lora_rank > 0)
    for (BaseQuant quant : {BaseQuant::None, BaseQuant::Nf4}) {
      JobSpec a = job;
      a.layout.lora = LoraPlan{};
      a.layout.lora.rank = job.offer_lora_rank, a.layout.lora.base_quant = quant;
      for (const JobSpec& j : layouts_of(a)) all.push_back(predict_layout(j, rates, false));
    }
  std::stable_sort(all.begin(), all.end(), [](const Prediction& a, const Prediction& b) {
    if (a.fits != b.fits) return a.fits;
    return a.step_s / a.tokens_per_step < b.step_s / b.tokens_per_step;
  });
  if (all.size() > limit) all.resize(limit);
  return all;
}

// ---- printing ----


namespace {

std::string dollars(double x) {
  if (x >= 1e4) return "$" + human_count(x);
  return "$" + format_number(x, x >= 100 ? 0 : 2);
}

std::string layout_text(const MemoryLayout& l, int64_t accum) {
  return str(l.lora.enabled() ? describe_lora(l.lora) + ", " : "", "dp ", l.dp,
             l.pp > 1 ? str(" x pp ", l.pp) : std::string(), " x tp ", l.tp, l.sp ? " with sp" : "", ", ZeRO-", l.zero,
             ", micro_batch ", l.micro_batch, " x seq ", l.seq_len, ", grad_accum ", accum, ", recompute ",
             recompute_name(l.recompute), l.bf16_moments ? ", bf16 moments" : "");
}

// "full", "LoRA r16", "QLoRA r16": the search table's method column.
std::string method_text(const LoraPlan& lora) {
  if (!lora.enabled()) return "full";
  return str(lora.base_quant == BaseQuant::None ? "LoRA" : lora.base_quant == BaseQuant::Nf4 ? "QLoRA" : "LoRA-int8",
             " r", lora.rank);
}

// The best layout of `job` on its cluster (fitting, fastest), if any fits.
std::optional<Prediction> best_fit(const JobSpec& job, const Rates& rates) {
  const std::vector<Prediction> ranked = search_layouts(job, rates, 1, /*offer_adapters=*/false);
  if (ranked.empty() || !ranked[0].fits) return std::nullopt;
  return ranked[0];
}

}  // namespace

std::string format_plan(const JobSpec& job, const Prediction& p, const Rates& rates) {
  const Cluster& k = job.cluster;
  std::ostringstream o;
  o << "tuna plan: " << job.model_name << " (" << human_count(double(job.model.n_params())) << " parameters) on "
    << k.gpus() << " x " << k.gpu.name << " (" << k.nodes << " node" << (k.nodes > 1 ? "s" : "") << " x "
    << k.gpus_per_node << "), " << human_count(job.tokens) << " tokens"
    << (job.hours > 0 ? str(", ", format_number(job.hours, 0), " h") : "")
    << (job.price_per_gpu_hour > 0 ? str(", $", format_number(job.price_per_gpu_hour, 2), " per GPU-hour") : "")
    << (job.budget > 0 ? str(", budget ", dollars(job.budget)) : "") << "\n";
  if (p.layout.lora.enabled())
    o << "adapters: " << describe_lora(p.layout.lora) << ", " << human_count(double(lora_params(job.model, p.layout.lora, 1)))
      << " parameters (" << format_number(100.0 * double(lora_params(job.model, p.layout.lora, 1)) / double(job.model.n_params()), 2)
      << "% of the model); the base frozen"
      << (p.layout.lora.base_quant == BaseQuant::None ? " in bf16" : str(" in ", base_quant_name(p.layout.lora.base_quant)))
      << "\n";
  o << "layout: " << layout_text(p.layout, p.grad_accum) << " (global batch "
    << p.layout.micro_batch * p.grad_accum * p.layout.dp << " sequences, " << human_count(p.tokens_per_step)
    << " tokens)\n\n";

  if (p.layout.pp > 1) {
    o << "pipeline: " << format_pipeline_stages(p.stages) << "\n";
    for (size_t s = 0; s < p.stages.size(); s++)
      o << "  stage " << s << ": " << gb(p.stage_gpu_bytes[s]) << " per GPU with the reserve"
        << (int64_t(s) == p.fullest_stage ? " (the fullest: its plan below)" : "") << "\n";
    o << "\n";
  }
  o << format_memory_table(p.memory, 0,
                           str("memory per GPU (rank 0", p.layout.pp > 1 ? str(" of stage ", p.fullest_stage) : std::string(),
                               ")", p.memory_is_engines ? ", the CUDA engine's own plan:"
                                                        : ", AS DESIGNED (the CUDA engine does not implement this layout yet):"));
  o << "  " << std::left;
  o << str("reserve outside the plan (CUDA context, cuBLASLt, NCCL): ", gb(k.reserve_bytes),
           " (an estimate; gpu-check measures it)\n");
  o << "  needs " << gb(p.gpu_bytes) << " of the card's " << gb(k.gpu.hbm_bytes) << " ("
    << format_number(k.gpu.hbm_bytes / double(1 << 30), 1) << " GiB): "
    << (p.fits ? str("FITS (", gb(k.gpu.hbm_bytes - p.gpu_bytes), " left)") : "DOES NOT FIT") << "\n\n";

  if (p.layout.pp > 1)
    o << "step time (one optimizer step; stage " << p.slowest_stage << ", the slowest, sets every stage's pace):\n";
  else
    o << "step time (one optimizer step; every GPU the same):\n";
  for (const TimeItem& t : p.compute)
    if (t.seconds > 0) o << "  " << str(t.name, ": ") << format_number(t.seconds * 1e3, 1) << " ms  (" << t.note << ")\n";
  o << "  compute " << format_number(p.compute_s * 1e3, 1) << " ms\n";
  if (p.layout.pp > 1)
    o << "  pipeline bubble (1F1B): " << format_number(p.bubble_s * 1e3, 1) << " ms  (" << p.layout.pp - 1
      << " micro-batch periods of stage " << p.slowest_stage << ", its compute and tp collectives: (pp - 1) / m = "
      << format_number(100.0 * double(p.layout.pp - 1) / double(p.grad_accum), 1) << "%)\n";
  for (const TimeItem& t : p.communication)
    o << "  " << t.name << ": " << format_number(t.seconds * 1e3, 1) << " ms  (" << t.note << ")\n";
  o << "  communication " << format_number(p.communication_s * 1e3, 1) << " ms, of which exposed "
    << format_number(p.exposed_s * 1e3, 1) << " ms\n";
  o << "  step " << format_number(p.step_s * 1e3, 1) << " ms -> " << format_number(p.tokens_per_s_per_gpu, 0)
    << " tokens/s per GPU, MFU " << format_number(100 * p.mfu, 1) << "%\n\n";

  o << "job: " << human_count(job.tokens) << " tokens = " << human_count(p.steps) << " steps = "
    << human_duration(p.wall_s) << " on " << k.gpus() << (k.gpus() == 1 ? " GPU" : " GPUs");
  if (job.price_per_gpu_hour > 0) o << " = " << dollars(p.cost);
  o << "\n";
  for (const std::string& note : p.notes) o << "note: " << note << "\n";

  // The verdict, then what would fit or finish instead.
  o << "\nverdict: " << (p.fits ? "it fits" : "it DOES NOT FIT");
  if (p.fits) {
    if (job.hours > 0)
      o << (p.finishes ? str("; it finishes in ", human_duration(p.wall_s), " (limit ", format_number(job.hours, 0), " h)")
                       : str("; it does NOT finish in ", format_number(job.hours, 0), " h (it needs ",
                             human_duration(p.wall_s), ")"));
    if (job.budget > 0) o << (p.within_budget ? "; within the budget" : str("; it costs ", dollars(p.cost), ", over the budget"));
  }
  o << "\n";
  const bool good = p.fits && p.finishes && p.within_budget;
  if (!good) {
    o << "what would:\n";
    // The job's own method; the adapters the search offers (a full fine-tune that does not finish) on lines of
    // their own.
    std::vector<Prediction> all, offered;
    for (Prediction& q : search_layouts(job, rates, SIZE_MAX))
      (q.layout.lora.enabled() == job.layout.lora.enabled() ? all : offered).push_back(std::move(q));
    const std::optional<Prediction> best = !all.empty() && all[0].fits ? std::optional<Prediction>(all[0]) : std::nullopt;
    auto layout_line = [&](const char* what, const Prediction& b) {
      o << "  - " << what << layout_text(b.layout, b.grad_accum) << ": " << format_number(b.tokens_per_s_per_gpu, 0)
        << " tokens/s per GPU, " << human_duration(b.wall_s) << (job.price_per_gpu_hour > 0 ? ", " + dollars(b.cost) : "")
        << (b.memory_is_engines ? "" : " (as designed: not on cuda yet)") << "\n";
    };
    if (best && (best->step_s / best->tokens_per_step < p.step_s / p.tokens_per_step || !p.fits))
      layout_line("this cluster, layout ", *best);
    // What the CUDA engine runs today, when the best is a design.
    if (!best || !best->memory_is_engines) {
      const Prediction* today = nullptr;
      double least = INFINITY;
      for (const Prediction& q : all)
        if (q.memory_is_engines) {
          if (q.fits && !today) today = &q;
          least = std::min(least, q.gpu_bytes);
        }
      if (today) layout_line("on cuda today, layout ", *today);
      else if (std::isfinite(least))
        o << "  - on cuda today (ZeRO-0/1, tp 1, no recompute) no layout fits: the smallest needs " << gb(least)
          << " per GPU\n";
    }
    const Prediction& ref = best ? *best : p;
    if (ref.fits && job.hours > 0 && !ref.finishes) {
      const double in_time = job.hours * 3600 / ref.step_s * ref.tokens_per_step;
      o << "  - a token budget of " << human_count(in_time) << " (" << format_number(100 * in_time / job.tokens, 1)
        << "% of these tokens) finishes in " << format_number(job.hours, 0) << " h"
        << (job.price_per_gpu_hour > 0 ? " for " + dollars(job.hours * double(k.gpus()) * job.price_per_gpu_hour) : "")
        << "\n";
    }
    // Adapters on this cluster, the fastest layout of each base storage that fits.
    for (BaseQuant quant : {BaseQuant::None, BaseQuant::Nf4, BaseQuant::Int8})
      for (const Prediction& q : offered)
        if (q.fits && q.layout.lora.base_quant == quant) {
          o << "  - adapters, " << layout_text(q.layout, q.grad_accum) << ": "
            << format_number(q.tokens_per_s_per_gpu, 0) << " tokens/s per GPU, " << gb(q.gpu_bytes) << " per GPU; "
            << (q.finishes ? str("all the tokens in ", human_duration(q.wall_s))
                           : str("in ", format_number(job.hours, 0), " h ",
                                 human_count(job.hours * 3600 / q.step_s * q.tokens_per_step), " tokens (",
                                 format_number(100 * job.hours * 3600 / q.step_s * q.tokens_per_step / job.tokens, 0), "%)"))
            << (job.price_per_gpu_hour > 0 && q.finishes ? ", " + dollars(q.cost) : "") << "\n";
          break;
        }
    // More nodes of the same kind, doubling.
    for (int64_t nodes = k.nodes * 2; nodes <= k.nodes * 64; nodes *= 2) {
      JobSpec more = job;
      more.cluster.nodes = nodes;
      more.layout.dp = more.cluster.gpus() / (more.layout.tp * more.layout.pp);
      const std::optional<Prediction> b = best_fit(more, rates);
      if (b && b->finishes && b->within_budget) {
        o << "  - " << nodes << " nodes (" << more.cluster.gpus() << " GPUs), " << layout_text(b->layout, b->grad_accum)
          << ": " << human_duration(b->wall_s) << (job.price_per_gpu_hour > 0 ? ", " + dollars(b->cost) : "")
          << (b->memory_is_engines ? "" : " (as designed: not on cuda yet)") << "\n";
        break;
      }
    }
    // A smaller model of the catalogue that fits and finishes on this cluster.
    for (const auto& [name, config] : model_catalogue()) {
      const LlamaConfig m = LlamaConfig::from_json(config, name);
      if (m.n_params() >= job.model.n_params() || p.layout.seq_len > m.max_position_embeddings) continue;
      JobSpec smaller = job;
      smaller.model = m, smaller.model_name = name;
      if (m.num_key_value_heads % smaller.layout.tp != 0 || smaller.layout.pp > m.num_hidden_layers)
        smaller.layout.tp = 1, smaller.layout.pp = 1, smaller.layout.sp = false, smaller.layout.dp = k.gpus();
      const std::optional<Prediction> b = best_fit(smaller, rates);
      if (!b) continue;
      o << "  - " << name << " (" << human_count(double(m.n_params())) << "), " << layout_text(b->layout, b->grad_accum)
        << ": " << format_number(b->tokens_per_s_per_gpu, 0) << " tokens/s per GPU; ";
      if (b->finishes && b->within_budget)
        o << "all the tokens in " << human_duration(b->wall_s) << (job.price_per_gpu_hour > 0 ? ", " + dollars(b->cost) : "");
      else if (job.hours > 0)
        o << "in " << format_number(job.hours, 0) << " h " << human_count(job.hours * 3600 / b->step_s * b->tokens_per_step)
          << " tokens (" << format_number(100 * job.hours * 3600 / b->step_s * b->tokens_per_step / job.tokens, 0) << "%)";
      else
        o << "all the tokens in " << human_duration(b->wall_s) << (job.price_per_gpu_hour > 0 ? ", " + dollars(b->cost) : "");
      o << (b->memory_is_engines ? " (runs on cuda today)" : " (as designed: not on cuda yet)") << "\n";
    }
  }
  o << "\nrates: " << rates.device << "; gemm: " << rates.sources.at("gemm") << "\n  attention: " << rates.sources.at("attention")
    << "\n  memory-bound: " << rates.sources.at("memory") << "\n  launch gaps: " << rates.sources.at("step_overhead") << "\n";
  return o.str();
}

std::string format_search(const JobSpec& job, const std::vector<Prediction>& ranked) {
  std::ostringstream o;
  o << "layouts of " << job.model_name << " on " << job.cluster.gpus() << " x " << job.cluster.gpu.name
    << " at the same global batch: those that fit first, fastest first:\n";
  for (const Prediction& p : ranked)
    if (p.layout.lora.enabled() != job.layout.lora.enabled()) {
      o << "  (with adapters too: no full fine-tune layout finishes in " << format_number(job.hours, 0)
        << " h; LoRA/QLoRA r" << p.layout.lora.rank << " on all 7 modules of every layer, the base frozen in bf16 / nf4)\n";
      break;
    }
  char line[320];
  std::snprintf(line, sizeof line, "  %-10s %3s %2s %-3s %4s %5s %3s %5s %-9s %-5s %9s %8s %6s %10s %10s  %s\n", "method",
                "tp", "pp", "sp", "dp", "ZeRO", "mb", "accum", "recompute", "mom.", "GB/GPU", "tok/s/GPU", "MFU", "wall",
                "cost", "on cuda today");
  o << line;
  for (const Prediction& p : ranked) {
    std::snprintf(line, sizeof line, "  %-10s %3lld %2lld %-3s %4lld %5d %3lld %5lld %-9s %-5s %9.1f %8.0f %5.1f%% %10s %10s  %s%s\n",
                  method_text(p.layout.lora).c_str(), (long long)p.layout.tp, (long long)p.layout.pp,
                  p.layout.sp ? "yes" : "no", (long long)p.layout.dp, p.layout.zero, (long long)p.layout.micro_batch,
                  (long long)p.grad_accum, recompute_name(p.layout.recompute), p.layout.bf16_moments ? "bf16" : "fp32",
                  p.gpu_bytes / 1e9, p.tokens_per_s_per_gpu, 100 * p.mfu, human_duration(p.wall_s).c_str(),
                  job.price_per_gpu_hour > 0 ? dollars(p.cost).c_str() : "-", p.memory_is_engines ? "yes" : "no (design)",
                  p.fits ? "" : ", DOES NOT FIT");
    o << line;
  }
  return o.str();
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
