// build/plan — before a run: will it fit, how fast, how long, at what cost (plan/planner.h).
//
//   build/plan --model llama-2-70b --gpu h100-80gb --nodes 2 --tokens 130B --hours 72 --price 4.34
//              --tp 8 --zero 3 --micro_batch 1 --seq_len 4096 --grad_accum 32 [--search]    (one line)
//   build/plan --model llama-2-70b --gpu h100-80gb --nodes 2 --tokens 130B --pp 2 --tp 8 --sp ...  (pipeline + sp)
//   build/plan --model ~/models/Llama-3.2-1B --gpu h200 --data 'data/contracts/train-*.bin' --json
//   build/plan --model llama-2-70b --gpu h100-80gb --gpus_per_node 1 --tokens 100M --lora_rank 16 --base_quant nf4
//   build/plan --refresh_rates GPU_CHECK_OUTDIR [--rates_out plan/plan_rates.json]
#include <cmath>
#include <cstdio>
#include <fstream>

#include "core/error.h"
#include "core/options.h"
#include "data/loader.h"  // expand_shard_paths
#include "data/shard.h"   // ShardReader
#include "engine/adapters.h"  // AdapterOptions, declare_adapter_shape: the trainer's adapter options
#include "engine/engine.h"    // LayoutOptions, declare_layout_options: the trainer's layout options
#include "model/config.h"  // apply_rope_scaling
#include "plan/planner.h"

namespace {

using namespace tuna;

// build/plan's options: the cluster, the layout, the adapters, the token budget and what to print.
struct PlanOptions {
  std::string model, gpu = "h100-80gb", tokens_text, data, rates_path, refresh, rates_out;
  int64_t gpus_per_node = 8, nodes = 1, nics_per_node = 8, search_lora_rank = 16;
  double intra_gbps = 0, inter_gbps = 0, nic_gbit = 400, hours = 0, price = 0, budget = 0, text_gb = 0;
  double bytes_per_token = 3.85, reserve_gib = 1.5, overlap = -1, mean_doc_tokens = 0;
  std::string objective = "sft";
  bool search = false, as_json = false, stage_tables = false;
  // The layout's and the adapters' options are the trainer's (engine/engine.h, engine/adapters.h); a plan's batch
  // defaults to one 4096-token sequence per GPU.
  LayoutOptions layout{.micro_batch = 1, .seq_len = 4096, .rope_scaling = {}};
  AdapterOptions adapters;
};

void declare(Options& o, PlanOptions& a) {
  o.add("model", &a.model, "a model the planner knows (llama-2-7b/13b/70b, llama-3.1-8b/70b, llama-3.2-1b/3b), a "
                           "config.json, or a Hugging Face / tuna model directory");
  o.add("gpu", &a.gpu, "GPU kind: h100-80gb, h200, a100-80gb or rtx-4090");
  o.add("gpus_per_node", &a.gpus_per_node, "GPUs per node");
  o.add("nodes", &a.nodes, "nodes");
  o.add("intra_gbps", &a.intra_gbps, "bus bandwidth inside a node, GB/s per GPU (default: the GPU's NVLink at 80%)");
  o.add("inter_gbps", &a.inter_gbps, "bus bandwidth between nodes, GB/s per GPU (default: nics_per_node x nic_gbit at 80%)");
  o.add("nics_per_node", &a.nics_per_node, "InfiniBand/RoCE NICs per node");
  o.add("nic_gbit", &a.nic_gbit, "Gb/s of one NIC");
  declare_layout_options(o, a.layout);
  o.add("mean_doc_tokens", &a.mean_doc_tokens,
        "mean tokens per document in the packed windows: attention (masked at document boundaries, the trainer's "
        "default) costs seq_len x mean_doc_tokens / 2 scores per window; 0: one document per window", Bounds::at_least(0));
  o.add("objective", &a.objective,
        "the training objective: sft, or a preference loss over pairs: dpo (its reference: with adapters the base's "
        "forward per micro-batch, else precomputed once before training), simpo, orpo",
        {"sft", "dpo", "simpo", "orpo"});
  declare_adapter_shape(o, a.adapters);
  o.add("search_lora_rank", &a.search_lora_rank,
        "the rank of the adapters --search (and the verdict) offers when no layout of a full fine-tune finishes in "
        "--hours; 0: offer none", Bounds::at_least(0));
  o.add("tokens", &a.tokens_text, "token budget: 130B, 7.5e9, 500M (or --data, or --text_gb)");
  o.add("data", &a.data, "token shards (build/prepare's): the budget is their token count");
  o.add("text_gb", &a.text_gb, "the budget as GB of text, at --bytes_per_token");
  o.add("bytes_per_token", &a.bytes_per_token, "text bytes per token for --text_gb (LLaMA tokenizers on English: ~3.6-4.2; "
                                               "build/prepare's report measures yours)");
  o.add("hours", &a.hours, "time limit of the job; 0: none");
  o.add("price", &a.price, "price of one GPU-hour in dollars");
  o.add("budget", &a.budget, "money limit in dollars; 0: none");
  o.add("reserve_gib", &a.reserve_gib, "GPU memory outside the plan per GPU (CUDA context, cuBLASLt, NCCL)");
  o.add("overlap", &a.overlap, "share of the ZeRO collectives hidden behind compute, 0-1 (default: what the engine does)");
  o.add("search", &a.search, "rank every layout that fits by predicted time");
  o.add("stage_tables", &a.stage_tables, "print every pipeline stage's memory table and verdict, as build/train "
                                         "--plan_only prints it on that stage's ranks (the card's memory as capacity)");
  o.add("json", &a.as_json, "print the prediction as one JSON object (scripts)");
  o.add("rates", &a.rates_path, "measured rates table (default: plan/plan_rates.json of this checkout)");
  o.add("refresh_rates", &a.refresh, "a gpu-check OUTDIR: write the rates table refreshed from its bench JSON and stop");
  o.add("rates_out", &a.rates_out, "where --refresh_rates writes (default: the table it read)");
}

double tokens_in_shards(const std::string& specs) {
  std::vector<std::string> list;
  std::string item;
  for (char c : specs + ",") {
    if (c != ',') item += c;
    else if (!item.empty()) list.push_back(item), item.clear();
  }
  double tokens = 0;
  for (const std::string& path : expand_shard_paths(list)) tokens += double(ShardReader(path).token_count());
  return tokens;
}

// --refresh_rates: the rates table refreshed from a gpu-check run's bench JSON, written where --rates_out says.
void refresh_rates(const std::filesystem::path& table, const PlanOptions& a) {
  std::ifstream in(table);
  if (!in) fail(table.string(), ": cannot open the rates table to refresh");
  const nlohmann::json refreshed = rates_from_bench(nlohmann::json::parse(in), a.refresh);
  const std::string out = a.rates_out.empty() ? table.string() : a.rates_out;
  std::ofstream(out) << refreshed.dump(2) << "\n";
  std::printf("%s: refreshed from %s\n", out.c_str(), a.refresh.c_str());
}

// The cluster: the GPU kind, the node count and the links (NVLink inside a node, the NICs between nodes).
Cluster cluster_of(const PlanOptions& a) {
  Cluster k;
  k.gpu = find_gpu(a.gpu);
  if (a.gpus_per_node < 1 || a.nodes < 1) fail("--gpus_per_node and --nodes must be >= 1");
  k.gpus_per_node = a.gpus_per_node, k.nodes = a.nodes;
  k.intra_busbw = a.intra_gbps > 0 ? a.intra_gbps * 1e9 : k.gpu.nvlink_busbw;
  k.intra_note = a.intra_gbps > 0 ? str("NVLink ", a.intra_gbps, " GB/s (--intra_gbps)")
                                  : str("NVLink ", std::lround(k.gpu.nvlink_busbw / 1e9), " GB/s (", k.gpu.nvlink, ")");
  const double nic = 0.8 * double(a.nics_per_node) * a.nic_gbit / 8 * 1e9 / double(a.gpus_per_node);
  k.inter_busbw = a.inter_gbps > 0 ? a.inter_gbps * 1e9 : nic;
  k.inter_note = a.inter_gbps > 0 ? str("between nodes ", a.inter_gbps, " GB/s (--inter_gbps)")
                                  : str("between nodes ", std::lround(nic / 1e9), " GB/s per GPU (", a.nics_per_node,
                                        " x ", a.nic_gbit, " Gb/s per node, 80% assumed reached)");
  k.reserve_bytes = a.reserve_gib * double(1 << 30);
  return k;
}

// The job: the model, the cluster, the layout over it, the adapters and the token budget.
JobSpec job_of(const PlanOptions& a) {
  JobSpec job;
  job.model = load_model_for_plan(a.model, &job.model_name);
  job.cluster = cluster_of(a);
  const LayoutOptions& l = a.layout;
  // As the trainer applies it (the rope's tables are a few MB: what it changes for the plan is the seq_len it allows).
  nlohmann::json scaled = job.model.to_json();
  apply_rope_scaling(job.model, scaled, l.rope_scaling, "rope_scaling", a.model);
  if (job.cluster.gpus() % l.tp != 0) fail("--tp ", l.tp, " must divide the ", job.cluster.gpus(), " GPUs");
  if (job.cluster.gpus() % (l.tp * l.pp) != 0)
    fail("--pp ", l.pp, " x --tp ", l.tp, " must divide the ", job.cluster.gpus(), " GPUs (world = dp x pp x tp)");
  job.layout.tp = l.tp, job.layout.pp = l.pp, job.layout.sp = l.sp, job.layout.dp = job.cluster.gpus() / (l.tp * l.pp);
  job.layout.zero = static_cast<int>(l.zero);
  job.layout.recompute = parse_recompute(l.recompute, "option 'recompute'");
  job.layout.bf16_moments = l.bf16_moments, job.layout.micro_batch = l.micro_batch, job.layout.seq_len = l.seq_len;
  job.grad_accum = l.grad_accum;
  job.layout.fp8 = parse_fp8_mode(l.fp8, "option 'fp8'");
  job.layout.fp8_forward_codes = parse_fp8_forward_codes(l.fp8_weight_codes, "option 'fp8_weight_codes'");
  job.mean_doc_tokens = a.mean_doc_tokens;
  job.objective = a.objective;
  job.layout.lora = adapter_shape(a.adapters);
  check_lora_plan(job.model, job.layout.lora, "build/plan --lora_rank, --lora_targets, --lora_dropout, --base_quant");
  job.offer_lora_rank = a.search_lora_rank;
  const int budgets = !a.tokens_text.empty() + !a.data.empty() + (a.text_gb > 0);
  if (budgets != 1) fail("give the token budget once: --tokens, --data or --text_gb");
  job.tokens = !a.tokens_text.empty() ? parse_count(a.tokens_text, "option 'tokens'")
               : !a.data.empty()      ? tokens_in_shards(a.data)
                                      : a.text_gb * 1e9 / a.bytes_per_token;
  if (!(job.tokens > 0)) fail("the token budget is 0 tokens");
  job.hours = a.hours, job.price_per_gpu_hour = a.price, job.budget = a.budget;
  if (a.overlap >= 0) job.overlap = std::min(1.0, a.overlap);
  return job;
}

// --json: the prediction as one object, for scripts.
nlohmann::json prediction_json(const JobSpec& job, const Prediction& p, const std::string& gpu) {
  return {{"model", job.model_name},          {"gpu", gpu},
          {"method", describe_lora(job.layout.lora)},
          {"adapter_params", lora_params(job.model, job.layout.lora, 1)},
          {"gpus", job.cluster.gpus()},        {"memory_plan", memory_plan_json(p.memory)},
          {"pp", job.layout.pp},               {"sp", job.layout.sp},
          {"stage_gpu_bytes", p.stage_gpu_bytes}, {"fullest_stage", p.fullest_stage},
          {"slowest_stage", p.slowest_stage},  {"bubble_s", p.bubble_s},
          {"memory_is_engines", p.memory_is_engines}, {"gpu_bytes", p.gpu_bytes},
          {"fits", p.fits},                    {"compute_s", p.compute_s},
          {"communication_s", p.communication_s}, {"exposed_s", p.exposed_s},
          {"step_s", p.step_s},                {"tokens_per_step", p.tokens_per_step},
          {"tokens_per_s_per_gpu", p.tokens_per_s_per_gpu}, {"mfu", p.mfu},
          {"steps", p.steps},                  {"wall_s", p.wall_s},
          {"cost", p.cost},                    {"finishes", p.finishes},
          {"notes", p.notes}};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    PlanOptions a;
    Options o("build/plan", "Plans a training job before it runs: memory per GPU, step time, tokens/s, MFU, wall time, "
                            "cost, and a verdict with what would fit or finish instead.");
    declare(o, a);
    if (!o.parse(argc, argv).empty()) fail("unexpected positional argument (options are --name value; see --help)");

    const std::filesystem::path table = a.rates_path.empty() ? default_rates_path() : std::filesystem::path(a.rates_path);
    if (!a.refresh.empty()) {
      refresh_rates(table, a);
      return 0;
    }
    const Rates rates = load_rates(table);
    if (a.model.empty()) fail("--model is required (see --help)");
    const JobSpec job = job_of(a);
    const Prediction p = predict(job, rates);
    if (a.as_json) {
      std::printf("%s\n", prediction_json(job, p, a.gpu).dump().c_str());
      return 0;
    }
    std::printf("%s", format_plan(job, p, rates).c_str());
    if (a.stage_tables)
      for (int64_t s = 0; s < job.layout.pp; s++) {
        MemoryLayout stage = job.layout;
        stage.pp_rank = s;
        std::printf("\n%s", check_gpu_fit(job.model, stage, static_cast<int64_t>(job.cluster.gpu.hbm_bytes)).report.c_str());
      }
    if (a.search) std::printf("\n%s", format_search(job, search_layouts(job, rates)).c_str());
    return 0;
  } catch (const tuna::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
