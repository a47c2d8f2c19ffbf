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
#include "plan/planner.h"

namespace {

using namespace tuna;

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

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string model, gpu = "h100-80gb", tokens_text, data, recompute = "none", rates_path, refresh, rates_out;
    int64_t gpus_per_node = 8, nodes = 1, tp = 1, pp = 1, zero = 0, micro_batch = 1, seq_len = 4096, grad_accum = 1;
    int64_t nics_per_node = 8;
    double intra_gbps = 0, inter_gbps = 0, nic_gbit = 400, hours = 0, price = 0, budget = 0, text_gb = 0;
    double bytes_per_token = 3.85, reserve_gib = 1.5, overlap = -1, mean_doc_tokens = 0;
    bool bf16_moments = false, search = false, as_json = false, sp = false, stage_tables = false;
    int64_t lora_rank = 0, search_lora_rank = 16;
    double lora_dropout = 0;
    std::string lora_targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", base_quant = "none";
    std::string objective = "sft";
    Options o("build/plan", "Plans a training job before it runs: memory per GPU, step time, tokens/s, MFU, wall time, "
                            "cost, and a verdict with what would fit or finish instead.");
    o.add("model", &model, "a model the planner knows (llama-2-7b/13b/70b, llama-3.1-8b/70b, llama-3.2-1b/3b), a "
                           "config.json, or a Hugging Face / tuna model directory");
    o.add("gpu", &gpu, "GPU kind: h100-80gb, h200, a100-80gb or rtx-4090");
    o.add("gpus_per_node", &gpus_per_node, "GPUs per node");
    o.add("nodes", &nodes, "nodes");
    o.add("intra_gbps", &intra_gbps, "bus bandwidth inside a node, GB/s per GPU (default: the GPU's NVLink at 80%)");
    o.add("inter_gbps", &inter_gbps, "bus bandwidth between nodes, GB/s per GPU (default: nics_per_node x nic_gbit at 80%)");
    o.add("nics_per_node", &nics_per_node, "InfiniBand/RoCE NICs per node");
    o.add("nic_gbit", &nic_gbit, "Gb/s of one NIC");
    o.add("tp", &tp, "tensor-parallel ranks (inside a node); dp = GPUs / (tp x pp)");
    o.add("pp", &pp, "pipeline stages (1F1B; the layers split by cost, the embedding on the first stage and the head on "
                     "the last; stages span nodes, tp stays inside one)", Bounds::at_least(1));
    o.add("sp", &sp, "sequence parallelism with tp (Megatron's): the norm and residual region split along the sequence "
                     "over the tp ranks");
    o.add("zero", &zero, "ZeRO stage over dp: 0-3");
    o.add("recompute", &recompute, "activation recompute: none | selective | full");
    o.add("bf16_moments", &bf16_moments, "AdamW moments in bf16");
    o.add("micro_batch", &micro_batch, "sequences per GPU per forward/backward");
    o.add("seq_len", &seq_len, "tokens per sequence");
    o.add("grad_accum", &grad_accum, "micro-batches per optimizer step");
    o.add("mean_doc_tokens", &mean_doc_tokens,
          "mean tokens per document in the packed windows: attention (masked at document boundaries, the trainer's "
          "default) costs seq_len x mean_doc_tokens / 2 scores per window; 0: one document per window", Bounds::at_least(0));
    o.add("objective", &objective,
          "the training objective: sft, or a preference loss over pairs: dpo (its reference: with adapters the base's "
          "forward per micro-batch, else precomputed once before training), simpo, orpo",
          {"sft", "dpo", "simpo", "orpo"});
    o.add("lora_rank", &lora_rank, "train adapters of this rank, the base frozen (LoRA); 0: a full fine-tune",
          Bounds::at_least(0));
    o.add("lora_targets", &lora_targets, "the modules with adapters, PEFT's names (comma list)");
    o.add("lora_dropout", &lora_dropout, "dropout on the adapters' input (a mask kept per target for the backward)");
    o.add("base_quant", &base_quant, "storage of the frozen base with adapters: none (bf16) | nf4 (QLoRA) | int8");
    o.add("search_lora_rank", &search_lora_rank,
          "the rank of the adapters --search (and the verdict) offers when no layout of a full fine-tune finishes in "
          "--hours; 0: offer none", Bounds::at_least(0));
    o.add("tokens", &tokens_text, "token budget: 130B, 7.5e9, 500M (or --data, or --text_gb)");
    o.add("data", &data, "token shards (build/prepare's): the budget is their token count");
    o.add("text_gb", &text_gb, "the budget as GB of text, at --bytes_per_token");
    o.add("bytes_per_token", &bytes_per_token, "text bytes per token for --text_gb (LLaMA tokenizers on English: ~3.6-4.2; "
                                               "build/prepare's report measures yours)");
    o.add("hours", &hours, "time limit of the job; 0: none");
    o.add("price", &price, "price of one GPU-hour in dollars");
    o.add("budget", &budget, "money limit in dollars; 0: none");
    o.add("reserve_gib", &reserve_gib, "GPU memory outside the plan per GPU (CUDA context, cuBLASLt, NCCL)");
    o.add("overlap", &overlap, "share of the ZeRO collectives hidden behind compute, 0-1 (default: what the engine does)");
    o.add("search", &search, "rank every layout that fits by predicted time");
    o.add("stage_tables", &stage_tables, "print every pipeline stage's memory table and verdict, as build/train "
                                         "--plan_only prints it on that stage's ranks (the card's memory as capacity)");
    o.add("json", &as_json, "print the prediction as one JSON object (scripts)");
    o.add("rates", &rates_path, "measured rates table (default: plan/plan_rates.json of this checkout)");
    o.add("refresh_rates", &refresh, "a gpu-check OUTDIR: write the rates table refreshed from its bench JSON and stop");
    o.add("rates_out", &rates_out, "where --refresh_rates writes (default: the table it read)");
    if (!o.parse(argc, argv).empty()) fail("unexpected positional argument (options are --name value; see --help)");

    const std::filesystem::path table = rates_path.empty() ? default_rates_path() : std::filesystem::path(rates_path);
    if (!refresh.empty()) {
      std::ifstream in(table);
      if (!in) fail(table.string(), ": cannot open the rates table to refresh");
      const nlohmann::json refreshed = rates_from_bench(nlohmann::json::parse(in), refresh);
      const std::string out = rates_out.empty() ? table.string() : rates_out;
      std::ofstream(out) << refreshed.dump(2) << "\n";
      std::printf("%s: refreshed from %s\n", out.c_str(), refresh.c_str());
      return 0;
    }
    const Rates rates = load_rates(table);

    if (model.empty()) fail("--model is required (see --help)");
    JobSpec job;
    job.model = load_model_for_plan(model, &job.model_name);
    job.cluster.gpu = find_gpu(gpu);
    if (gpus_per_node < 1 || nodes < 1) fail("--gpus_per_node and --nodes must be >= 1");
    job.cluster.gpus_per_node = gpus_per_node, job.cluster.nodes = nodes;
    job.cluster.intra_busbw = intra_gbps > 0 ? intra_gbps * 1e9 : job.cluster.gpu.nvlink_busbw;
    job.cluster.intra_note = intra_gbps > 0 ? str("NVLink ", intra_gbps, " GB/s (--intra_gbps)")
                                            : str("NVLink ", std::lround(job.cluster.gpu.nvlink_busbw / 1e9), " GB/s (",
                                                  job.cluster.gpu.nvlink, ")");
    const double nic = 0.8 * double(nics_per_node) * nic_gbit / 8 * 1e9 / double(gpus_per_node);
    job.cluster.inter_busbw = inter_gbps > 0 ? inter_gbps * 1e9 : nic;
    job.cluster.inter_note = inter_gbps > 0 ? str("between nodes ", inter_gbps, " GB/s (--inter_gbps)")
                                            : str("between nodes ", std::lround(nic / 1e9), " GB/s per GPU (", nics_per_node,
                                                  " x ", nic_gbit, " Gb/s per node, 80% assumed reached)");
    job.cluster.reserve_bytes = reserve_gib * double(1 << 30);
    if (tp < 1 || job.cluster.gpus() % tp != 0) fail("--tp ", tp, " must divide the ", job.cluster.gpus(), " GPUs");
    if (job.cluster.gpus() % (tp * pp) != 0)
      fail("--pp ", pp, " x --tp ", tp, " must divide the ", job.cluster.gpus(), " GPUs (world = dp x pp x tp)");
    job.layout.tp = tp, job.layout.pp = pp, job.layout.sp = sp, job.layout.dp = job.cluster.gpus() / (tp * pp);
    job.layout.zero = static_cast<int>(zero);
    job.layout.recompute = parse_recompute(recompute, "option 'recompute'");
    job.layout.bf16_moments = bf16_moments, job.layout.micro_batch = micro_batch, job.layout.seq_len = seq_len;
    job.grad_accum = grad_accum;
    job.mean_doc_tokens = mean_doc_tokens;
    job.objective = objective;
    job.layout.lora.rank = lora_rank;
    job.layout.lora.targets = parse_lora_targets(lora_targets);
    job.layout.lora.dropout = lora_dropout;
    job.layout.lora.base_quant = parse_base_quant(base_quant, "option 'base_quant'");
    check_lora_plan(job.model, job.layout.lora, "build/plan --lora_rank, --lora_targets, --lora_dropout, --base_quant");
    job.offer_lora_rank = search_lora_rank;
    const int budgets = !tokens_text.empty() + !data.empty() + (text_gb > 0);
    if (budgets != 1) fail("give the token budget once: --tokens, --data or --text_gb");
    job.tokens = !tokens_text.empty() ? parse_count(tokens_text, "option 'tokens'")
                 : !data.empty()      ? tokens_in_shards(data)
                                      : text_gb * 1e9 / bytes_per_token;
    if (!(job.tokens > 0)) fail("the token budget is 0 tokens");
    job.hours = hours, job.price_per_gpu_hour = price, job.budget = budget;
    if (overlap >= 0) job.overlap = std::min(1.0, overlap);

    const Prediction p = predict(job, rates);
    if (as_json) {
      nlohmann::json j = {{"model", job.model_name},          {"gpu", gpu},
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
      std::printf("%s\n", j.dump().c_str());
      return 0;
    }
    std::printf("%s", format_plan(job, p, rates).c_str());
    if (stage_tables)
      for (int64_t s = 0; s < job.layout.pp; s++) {
        MemoryLayout stage = job.layout;
        stage.pp_rank = s;
        std::printf("\n%s", check_gpu_fit(job.model, stage, static_cast<int64_t>(job.cluster.gpu.hbm_bytes)).report.c_str());
      }
    if (search) std::printf("\n%s", format_search(job, search_layouts(job, rates)).c_str());
    return 0;
  } catch (const tuna::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
