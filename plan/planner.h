// The planner behind build/plan: will a training job fit, how fast will it run, how long and how much will it
// cost, on a GPU cluster that isn't here.
//
//   memory per GPU   plan_gpu_memory (model/memory_plan.h): the same list the CUDA engine lays its arena out from.
//                    For a layout the engine's plan refuses (tensor parallelism was one until the CUDA engine
//                    ran it), the planner says so and prices the layout as designed instead (design_gpu_memory),
//                    marked as such.
//   pipeline (pp)    world = dp x pp x tp (tp inside a node, pp next, dp outermost, as comm/comm.h's Mesh): each
//                    stage's memory is its own plan (the first stage holds the most micro-batches in flight under
//                    1F1B); the step is the slowest stage's micro-batch period x (m + pp - 1) (the bubble is
//                    (pp - 1) / m of it), with the activations and their gradients sent between stages over the link
//                    the two stages share, overlapped with compute but for the pipe's fill and drain.
//   step time        compute from measured rates (plan/plan_rates.json: GEMM and attention TFLOP/s, memory-bound
//                    kernels as a share of the measured copy bandwidth, launch gaps), never from datasheets alone;
//                    communication from the bytes each collective moves over the bus bandwidth of the link it
//                    crosses (nccl-tests' busbw convention), exposed where the engine does not overlap it.
//   the job          tokens/s per GPU, MFU, wall time for a token budget, cost; a verdict, and what would fit or
//                    finish instead (a token budget, more nodes, a smaller model, another layout).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/memory_plan.h"
#include "model/pipeline.h"

namespace tuna {

// ---- hardware ----

struct GpuKind {
  std::string name;           // "h100-80gb"
  std::string description;    // "NVIDIA H100 SXM 80 GB"
  double peak_bf16_flops;     // dense
  double hbm_bytes;           // what the driver reports as total (nvidia-smi memory.total)
  double hbm_bytes_per_s;     // datasheet bandwidth (scales the measured memory-bound rates to this card)
  double nvlink_busbw;        // default intra-node bus bandwidth, bytes/s per GPU
  std::string nvlink;         // what that assumes
};
const std::vector<GpuKind>& gpu_catalogue();
// Fails naming `name` and listing the known kinds.
const GpuKind& find_gpu(const std::string& name);

struct Cluster {
  GpuKind gpu;
  int64_t gpus_per_node = 8, nodes = 1;
  double intra_busbw = 0;     // bytes/s per GPU inside a node
  double inter_busbw = 0;     // bytes/s per GPU between nodes
  std::string intra_note, inter_note;
  double reserve_bytes = 1.5 * (1 << 30);  // per GPU outside the plan: CUDA context, cuBLASLt, NCCL (an estimate)
  int64_t gpus() const { return gpus_per_node * nodes; }
};

// ---- models ----

// Built-in configs of published models (their config.json shapes): "llama-2-70b", "llama-3.1-8b", ...
const std::vector<std::pair<std::string, nlohmann::json>>& model_catalogue();
// A catalogue name, an HF config.json, or a directory holding one (a download or a tuna checkpoint).
LlamaConfig load_model_for_plan(const std::string& spec, std::string* name = nullptr);

// ---- measured rates ----

struct Rates {
  std::string device;  // where they were measured
  double gemm_fwd = 0, gemm_bwd = 0, lm_head = 0;  // FLOP/s
  struct GemmShape {
    int64_t tokens, in, out;
    int pass;  // 0 forward, 1 input gradient, 2 weight gradient
    double flops;
  };
  std::vector<GemmShape> gemm_shapes;  // per-shape rates from the GEMM bench, when present
  // FP8 (--fp8 tensorwise): the layer GEMMs' rates with FP8 operands. Measured per shape by gpu-check (bench_gemm_gpu's
  // BM_GemmFp8) when fp8_measured; until then the bf16 rate times a published cuBLASLt FP8/bf16 ratio (its source in
  // sources["gemm_fp8"]), and a plan that uses it says so. fp8_cast: the casts' share of the copy bandwidth.
  bool fp8_measured = false;
  double fp8_ratio = 0;
  std::vector<GemmShape> fp8_shapes;
  // LoRA: the adapters' skinny products (in -> r, r -> out), measured by gpu-check (bench_gemm_gpu's BM_GemmAdapter).
  // Empty until then: adapters are priced from the roofline (their FLOPs at the layer rates, their bytes at the copy
  // bandwidth), and a plan with adapters says so.
  std::vector<GemmShape> adapter_shapes;
  struct Attention {
    int64_t head_dim, seq;
    double fwd, bwd;  // FLOP/s
  };
  std::vector<Attention> attention;
  double copy_bytes_per_s = 0;
  std::map<std::string, double> of_copy;  // kernel -> achieved share of the copy bandwidth
  double overhead = 0;                    // launch gaps, as a fraction of kernel time
  std::map<std::string, std::string> sources;  // section -> where its figures come from

  double gemm(int64_t tokens, int64_t in, int64_t out, int pass) const;  // FLOP/s of the nearest measured shape
  double gemm_fp8(int64_t tokens, int64_t in, int64_t out, int pass) const;  // the same with FP8 operands
  double gemm_adapter(int64_t tokens, int64_t in, int64_t out, int pass) const;  // nearest adapter shape (measured)
  double attention_rate(int64_t head_dim, int64_t seq, bool backward) const;
  double memory_rate(const std::string& kernel) const;  // bytes/s
};
// Parses plan/plan_rates.json's format; `source` names the file in errors (a missing field is named).
Rates parse_rates(const nlohmann::json& j, const std::string& source);
Rates load_rates(const std::filesystem::path& path);
// plan/plan_rates.json of this checkout: beside the running binary's build/ directory, else the working directory.
std::filesystem::path default_rates_path();
// The rates table `base` with the GEMM, attention and memory sections replaced by what gpu-check measured
// (OUTDIR/benches.json, or a directory of gemm.json, attention.json, memory.json: Google Benchmark JSON);
// sections without a bench keep theirs.
nlohmann::json rates_from_bench(const nlohmann::json& base, const std::filesystem::path& gpu_check_dir);

// ---- one job ----

struct JobSpec {
  LlamaConfig model;
  std::string model_name;
  Cluster cluster;
  MemoryLayout layout;       // dp, pp, tp, sp, zero, recompute, bf16_moments, micro_batch, seq_len, lora (rank 0)
  int64_t grad_accum = 1;    // micro-batches per optimizer step (with pp: those that flow through the pipe)
  double tokens = 0;         // the token budget: the corpus, or what the user wants trained
  double hours = 0;          // the time limit; 0: none
  double price_per_gpu_hour = 0;
  double budget = 0;         // dollars; 0: none
  std::optional<double> overlap;  // fraction of the ZeRO collectives hidden behind compute (default: the engine's)
  // Mean tokens per document in the packed windows (the trainer masks attention at document boundaries by
  // default): attention's FLOPs and time per window are those of documents of this length, seq_len x
  // mean_doc_tokens / 2 scores instead of seq_len^2 / 2 (the kernels skip key blocks outside a document). 0, or at
  // least seq_len: one document per window.
  double mean_doc_tokens = 0;
  // The adapters the search offers (LoRA of this rank on every module, the base in bf16 and in nf4) when the job
  // is a full fine-tune that no layout finishes in `hours`; 0: none.
  int64_t offer_lora_rank = 16;
  // The training objective (model/objective.h): sft, or a preference loss (dpo, simpo, orpo) over pairs. A preference
  // step runs the head's logits twice (the log-probs, then the weighted backward); DPO adds its reference: with
  // adapters the base's forward per micro-batch (adapters off), for a full fine-tune a precompute pass over the data
  // once, before training (a forward of every token).
  std::string objective = "sft";
};

struct TimeItem {
  std::string name;
  double seconds = 0;
  std::string note;
};

struct Prediction {
  MemoryLayout layout;
  int64_t grad_accum = 1;
  // Pipeline stages (pp 1: one): the layer split, each stage's memory (its plan's peak + the reserve), the stage whose
  // plan `memory` is (the fullest: the layout fits when it does), and the stage whose compute sets the pace.
  std::vector<PipelineStage> stages;
  std::vector<double> stage_gpu_bytes;
  int64_t fullest_stage = 0, slowest_stage = 0;
  MemoryPlan memory;
  bool memory_is_engines = true;  // false: the layout as designed (the CUDA engine does not implement it yet)
  std::string not_implemented;    // the engine's refusal, when memory_is_engines is false
  double gpu_bytes = 0;           // the plan's peak + the reserve
  bool fits = false;
  std::vector<TimeItem> compute, communication;  // per optimizer step
  double compute_s = 0, communication_s = 0, exposed_s = 0, step_s = 0;
  double bubble_s = 0;  // 1F1B's fill and drain: pp - 1 micro-batch periods of the slowest stage, idle
  double tokens_per_step = 0, tokens_per_s_per_gpu = 0, mfu = 0;
  double steps = 0, wall_s = 0, cost = 0;
  double precompute_s = 0;  // DPO's reference log-probs of a full fine-tune, once before training (in wall_s)
  bool finishes = true, within_budget = true;
  std::vector<std::string> notes;  // what the figures assume
};

Prediction predict(const JobSpec& job, const Rates& rates);

// Layouts of the same cluster and global batch (tp, pipeline stages, sp, ZeRO stage, micro-batch, recompute, bf16
// moments), those that fit first, fastest first. `limit`: at most this many. When the job is a full fine-tune with a time limit that no
// layout meets, and offer_adapters, the adapters of job.offer_lora_rank are searched too (Prediction::layout.lora).
std::vector<Prediction> search_layouts(const JobSpec& job, const Rates& rates, size_t limit = 12,
                                       bool offer_adapters = true);

// What build/plan prints: the memory table, the step's time by part, the job, the verdict and what would fit or
// finish instead (from the catalogue's smaller models and more nodes).
std::string format_plan(const JobSpec& job, const Prediction& p, const Rates& rates);
std::string format_search(const JobSpec& job, const std::vector<Prediction>& ranked);

// The layout as designed, for a layout the CUDA engine's plan refuses (see the top of this file): the
// engine's own plan of one tp rank's dimensions taken as a model of their own.
MemoryPlan design_gpu_memory(const LlamaConfig& config, const MemoryLayout& layout);

// "130B", "7.5e9", "500M", "1,000,000" -> a count; fails naming `what`.
double parse_count(const std::string& text, const std::string& what);

}  // namespace tuna
