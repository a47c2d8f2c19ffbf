// What build/plan prints (plan/planner.h): the plan of one layout and the search's table.
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
             recompute_name(l.recompute), l.bf16_moments ? ", bf16 moments" : "",
             l.fp8 != Fp8Mode::Off && l.fp8_forward_codes ? ", --fp8_weight_codes forward" : "");
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

// The plan's head: the job, the adapters, the layout.
void print_job_line(std::ostream& o, const JobSpec& job, const Prediction& p) {
  const Cluster& k = job.cluster;
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
}

// Memory: each pipeline stage's, the fullest stage's table, the reserve and whether it fits.
void print_memory(std::ostream& o, const JobSpec& job, const Prediction& p) {
  const Cluster& k = job.cluster;
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
}

// The step's time by part: compute, the pipeline's bubble, communication, the step and its rates.
void print_step_time(std::ostream& o, const Prediction& p) {
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
}

// The job's time and cost, the notes, and the verdict.
void print_job_and_verdict(std::ostream& o, const JobSpec& job, const Prediction& p) {
  const Cluster& k = job.cluster;
  o << "job: " << human_count(job.tokens) << " tokens = " << human_count(p.steps) << " steps = "
    << human_duration(p.wall_s) << " on " << k.gpus() << (k.gpus() == 1 ? " GPU" : " GPUs");
  if (job.price_per_gpu_hour > 0) o << " = " << dollars(p.cost);
  o << "\n";
  for (const std::string& note : p.notes) o << "note: " << note << "\n";

  o << "\nverdict: " << (p.fits ? "it fits" : "it DOES NOT FIT");
  if (p.fits) {
    if (job.hours > 0)
      o << (p.finishes ? str("; it finishes in ", human_duration(p.wall_s), " (limit ", format_number(job.hours, 0), " h)")
                       : str("; it does NOT finish in ", format_number(job.hours, 0), " h (it needs ",
                             human_duration(p.wall_s), ")"));
    if (job.budget > 0) o << (p.within_budget ? "; within the budget" : str("; it costs ", dollars(p.cost), ", over the budget"));
  }
  o << "\n";
}

// What would fit or finish on this cluster: a faster layout of the same method, what the CUDA engine runs today when
// that is a design, a token budget that finishes, and the adapters the search offers (one line per base storage).
void print_this_cluster(std::ostream& o, const JobSpec& job, const Prediction& p, const Rates& rates) {
  const Cluster& k = job.cluster;
  // The job's own method; the adapters the search offers (a full fine-tune that does not finish) on lines of their own.
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
}

// More nodes of the same kind, doubling: the first count whose best layout finishes within the budget.
void print_more_nodes(std::ostream& o, const JobSpec& job, const Rates& rates) {
  const Cluster& k = job.cluster;
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
}

// The catalogue's smaller models that fit on this cluster, each at its best layout: what it trains in the time.
void print_smaller_models(std::ostream& o, const JobSpec& job, const Prediction& p, const Rates& rates) {
  const Cluster& k = job.cluster;
  for (const auto& [name, config] : model_catalogue()) {
    const LlamaConfig m = LlamaConfig::from_json(config, name);
    if (m.n_params() >= job.model.n_params() || p.layout.seq_len > m.max_context()) continue;
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

}  // namespace

std::string format_plan(const JobSpec& job, const Prediction& p, const Rates& rates) {
  std::ostringstream o;
  print_job_line(o, job, p);
  print_memory(o, job, p);
  print_step_time(o, p);
  print_job_and_verdict(o, job, p);
  if (!(p.fits && p.finishes && p.within_budget)) {
    o << "what would:\n";
    print_this_cluster(o, job, p, rates);
    print_more_nodes(o, job, rates);
    print_smaller_models(o, job, p, rates);
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

}  // namespace tuna
