// build/train — the trainer's main: config -> ranks -> model -> data -> loop -> checkpoints.
// Wiring only: the math is in model/, the bytes in data/, the ops in kernels/, the parallelism in dist/ (its
// transports in comm/).
//
//   build/train --config run.toml [--option value ...]
//   mpirun -np 8 build/train --config run.toml --zero 3 [--tp 2] [--pp 2]      (docs/multi-rank.md)
//
// Ranks: world = dp x pp x tp (comm/comm.h Mesh); the loader gives each dp rank disjoint windows. What runs where is
// the support table's (model/support.h), what trains the adapters component's (engine/adapters.h: every parameter, or
// LoRA adapters on a frozen base). The Engine (engine/engine.h) is the model on the chosen device: on cpu, Llama + Zero;
// on cuda, LlamaGpu on the rank's GPU with the GPU ZeRO over NCCL. Rank 0 prints and writes metrics.jsonl; every rank
// writes its checkpoint shard.
//
// Every option is settable in the TOML file and as a flag (flags win). The effective config is printed
// at start and saved in every checkpoint's state.json. SIGTERM/SIGINT/SIGUSR1 (a preemption notice) finish
// the current step, write a checkpoint and exit 75 (EX_TEMPFAIL: "stopped, not finished"; as does
// --stop_at_step before --steps), so a job script requeues and `--resume` continues exactly where it stopped.
// A run whose out_dir lock another run took over stops at the end of its step without a checkpoint and exits 73
// (EX_CANTCREAT: the directory is no longer this run's to write; ckpt/run_dir.h).
// out_dir decides how a run starts (ckpt/run_dir.h): an earlier run there is continued (--resume), replaced
// (--overwrite) or refused.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <sysexits.h>  // EX_TEMPFAIL

#include "ckpt/checkpoint.h"   // resolve_checkpoint, read_config_json, checkpoint_bytes, verify_model_directory
#include "ckpt/run_dir.h"      // lock_run_dir, open_run_dir, truncate_metrics, MetricsLog, stop_at_safe_point
#include "comm/comm.h"         // Comm, Mesh, make_world_comm, abort_job
#include "comm/fault_injection.h"  // TUNA_FAULT: inject_fault_for_tests, nan_loss_for_tests
#include "core/error.h"        // tuna::Error, fail, describe_current_exception
#include "core/memory.h"       // host_memory, return_large_frees_to_system
#include "core/options.h"      // Options: TOML + flags
#include "core/progress.h"     // TrainingEta, human_duration, periodic_events_left
#include "core/run_report.h"   // refresh_run_report: out_dir/report.html
#include "core/threads.h"      // set_cpu_threads: OpenMP + OpenBLAS; blas_hint
#include "data/loader.h"       // DataLoader, LoaderCursor, expand_shard_paths, ShardRole
#include "data/tokenizer.h"    // model_tokenizer: what checkpoints carry, what shards must match
#include "engine/adapters.h"  // Adapters: what trains (every parameter, or LoRA adapters on a frozen base)
#include "engine/checkpointer.h"  // Checkpointer: every / keep / last, save and restore
#include "engine/engine.h"     // Engine: the model on cpu or cuda, the step's collectives and optimizer
#include "engine/preference.h"  // Preference: the objective (sft, or dpo/simpo/orpo over pairs)
#include "engine/step_record.h"   // StepRecord: one step's jsonl row and log line
#include "engine/validator.h"  // Validator: when to validate, and the held-out loss
#include "model/config.h"      // LlamaConfig
#include "model/optimizer.h"   // OptimizerConfig, learning_rate
#include "model/pipeline.h"    // format_pipeline_stages: the --pp split
#include "model/support.h"     // require_support, require_valid: what runs where

namespace fs = std::filesystem;
using nlohmann::json;
using namespace tuna;

namespace {

struct TrainConfig {
  std::string model_config;  // config.json for a model trained from scratch
  std::string init;          // checkpoint directory to start from (Hugging Face or tuna)
  std::string tokenizer;     // tokenizer file or directory carried in checkpoints; shards must match it
  std::string train_data;    // shard files, directories or globs, comma-separated
  std::string val_data;
  int64_t steps = 1000;
  OptimizerConfig opt;
  int64_t seed = 1337;
  double init_std = 0.02;
  std::string out_dir = "runs/default";
  int64_t ckpt_every = 500;
  int64_t ckpt_keep = 3;
  std::string resume = "false";
  bool overwrite = false;
  int64_t stop_at_step = 0;
  int64_t log_every = 1;
  int64_t val_every = 0;
  int64_t val_batches = 0;
  std::string eval_tasks;    // multiple-choice task records scored at every validation (engine/mc_eval.h)
  int64_t max_bad_steps = 5;
  std::string device = "auto";
  int64_t threads = 0;
  bool zero_prefetch = true;
  double comm_timeout = 300;
  bool stochastic_rounding = false;
  std::string attention = "auto";
  double gpu_hour_cost = 0;
  bool plan_only = false;
  double gpu_memory_gb = 0;
  bool document_mask = true;                 // attention stays inside each token's document
  std::string document_positions = "restart";  // RoPE positions restart at each document (or continue)
  LayoutOptions layout;    // the parallel layout and the step's batch (engine/engine.h): shared with build/plan
  AdapterOptions adapters;  // LoRA (engine/adapters.h): shared with build/plan in part
  PreferenceOptions objective;  // the training objective (engine/preference.h)
};

void declare(Options& o, TrainConfig& c) {
  // Upper bounds are far beyond any real run; they exist so that a typo (or 2^31) fails here, with the
  // option's name, instead of as an allocation of petabytes or an overflow later.
  constexpr double kMaxSteps = 1e12, kMaxRanks = 1 << 16;
  o.add("model_config", &c.model_config, "config.json of a model to train from scratch (instead of --init)");
  o.add("init", &c.init, "model directory to start from: a Hugging Face download or a tuna checkpoint");
  o.add("tokenizer", &c.tokenizer,
        "the model's tokenizer (a file of any format, or a model directory): carried in checkpoints, and the shards "
        "must have been written with it; default: --init's");
  o.add("train_data", &c.train_data, "token shards: files, directories (their train-* shards) or globs, comma-separated");
  o.add("val_data", &c.val_data, "validation shards, same form (a directory: its val-* shards); empty: no validation");
  declare_layout_options(o, c.layout);
  o.add("steps", &c.steps, "optimizer steps of the whole run (the schedule spans them)", Bounds::closed(1, kMaxSteps));
  o.add("lr", &c.opt.lr, "peak learning rate", Bounds::open_closed(0, 1));
  o.add("min_lr", &c.opt.min_lr, "final learning rate of cosine, linear and wsd schedules", Bounds::closed(0, 1));
  o.add("warmup_steps", &c.opt.warmup_steps, "linear warmup steps", Bounds::closed(0, kMaxSteps));
  o.add("schedule", &c.opt.schedule, "learning-rate schedule", {"cosine", "linear", "constant", "wsd"});
  o.add("decay_fraction", &c.opt.decay_fraction, "wsd: fraction of steps in the final decay", Bounds::open_closed(0, 1));
  o.add("beta1", &c.opt.beta1, "AdamW beta1", Bounds::half_open(0, 1));
  o.add("beta2", &c.opt.beta2, "AdamW beta2", Bounds::half_open(0, 1));
  o.add("eps", &c.opt.eps, "AdamW epsilon", Bounds::open_closed(0, 1));
  o.add("weight_decay", &c.opt.weight_decay, "decoupled weight decay on 2-D weights", Bounds::closed(0, 1e3));
  o.add("grad_clip", &c.opt.grad_clip, "global gradient-norm clip; 0 disables", Bounds::closed(0, 1e12));
  o.add("seed", &c.seed, "seed of initialization and data order", Bounds::at_least(0));
  o.add("init_std", &c.init_std, "std of the normal init of 2-D weights (from scratch)", Bounds::open_closed(0, 1));
  o.add("out_dir", &c.out_dir, "run directory: metrics.jsonl and ckpt/");
  o.add("ckpt_every", &c.ckpt_every, "checkpoint every N steps (and at the end); 0: only at the end", Bounds::closed(0, kMaxSteps));
  o.add("ckpt_keep", &c.ckpt_keep, "keep the newest K checkpoints; 0 keeps all", Bounds::closed(0, kMaxSteps));
  o.add_choice("resume", &c.resume, {"false", "true", "auto"}, "true",
               "true (or a bare --resume): continue from the newest complete checkpoint in out_dir/ckpt that verifies, "
               "and fail when there is none; auto: continue when there is one, else start a new run (for job scripts)");
  o.add("overwrite", &c.overwrite, "delete an earlier run's checkpoints and metrics in out_dir and start again "
        "(without it, an out_dir holding a run is refused)");
  o.add("stop_at_step", &c.stop_at_step, "checkpoint and stop after this step (a time-limited allocation; exit code 75 as for a signal); 0: run to the end",
        Bounds::closed(0, kMaxSteps));
  o.add("log_every", &c.log_every, "print a log line every N steps (metrics.jsonl gets every step)", Bounds::closed(1, kMaxSteps));
  o.add("val_every", &c.val_every, "validation loss every N steps; 0: only at the end when val_data is set", Bounds::closed(0, kMaxSteps));
  o.add("val_batches", &c.val_batches, "micro-batches per validation; 0: the whole validation split", Bounds::closed(0, kMaxSteps));
  o.add("eval_tasks", &c.eval_tasks, "multiple-choice task records (JSONL files or directories, comma-separated, as "
        "build/eval --tasks reads them) scored at every validation: accuracy in the log line, metrics.jsonl and the report");
  o.add("max_bad_steps", &c.max_bad_steps,
        "stop the run after this many steps in a row whose loss or gradient norm is not finite (each is skipped)",
        Bounds::closed(1, 1e6));
  o.add("device", &c.device, "cuda when a GPU is visible (auto), or the one named", {"auto", "cpu", "cuda"});
  o.add("document_mask", &c.document_mask,
        "attention stays inside each token's document in packed windows (training and validation); false: "
        "tokens attend across document boundaries");
  o.add("document_positions", &c.document_positions,
        "RoPE positions of packed windows: restart at 0 at each document (as transformers with packed position_ids) "
        "or continue along the window", {"restart", "continue"});
  o.add("threads", &c.threads, "CPU threads per rank; 0: the node's cores divided among its ranks", Bounds::closed(0, kMaxRanks));
  o.add("zero_prefetch", &c.zero_prefetch, "ZeRO-3: gather the next layer while this one computes (false: when used)");
  o.add("comm_timeout", &c.comm_timeout, "seconds a collective may wait for the other ranks before the job stops; 0: forever",
        Bounds::closed(0, 1e9));
  o.add("attention", &c.attention, "cuda: the attention kernels: mma (FlashAttention-2 style, sm_80+), hopper "
        "(FlashAttention-3 style, sm_90a) or auto (mma today); a resume with auto keeps the checkpoint's",
        {"auto", "mma", "hopper"});
  o.add("stochastic_rounding", &c.stochastic_rounding, "cuda: round bf16 weights (and bf16 moments) stochastically");
  o.add("plan_only", &c.plan_only, "cuda: print each rank's device memory plan and whether it fits, then exit without allocating (runs on any machine with --gpu_memory_gb)");
  o.add("gpu_memory_gb", &c.gpu_memory_gb, "plan_only: the GPU memory in GB to fit against (80 for an H100); 0: the visible GPU's free memory",
        Bounds::closed(0, 1e6));
  declare_adapter_shape(o, c.adapters);
  declare_adapter_training(o, c.adapters);
  declare_preference_options(o, c.objective);
  o.add("gpu_hour_cost", &c.gpu_hour_cost, "price of one GPU (or CPU rank) hour, for the cost column of the log; 0: none",
        Bounds::closed(0, 1e9));
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

std::atomic<bool> g_stop_requested{false};
extern "C" void on_stop_signal(int signal) {
  g_stop_requested = true;
  // mpirun ends a job whose rank died with SIGTERM: say which collective this rank was left waiting in.
  if (signal == SIGTERM) note_signal_in_collective(signal);
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// What the option declarations cannot say alone (each option's own range is checked as it is set).
void check(const TrainConfig& c) {
  if (c.model_config.empty() == c.init.empty())
    fail("give exactly one of --init (a model directory) and --model_config (a config.json to train from scratch)");
  if (c.train_data.empty() && !c.plan_only) fail("option 'train_data' is empty: give token shards (build/prepare writes them)");
  if (c.layout.micro_batch * c.layout.seq_len > (int64_t{1} << 31))
    fail("options 'micro_batch' x 'seq_len' = ", c.layout.micro_batch * c.layout.seq_len, " tokens per micro-batch: at most 2^31");
  validate(c.opt);
  // Every input path now, before anything is loaded (data/loader.h), not after the model.
  if (!c.plan_only) check_shard_specs("train_data", split_list(c.train_data), ShardRole::Train);
  if (!c.plan_only) check_shard_specs("val_data", split_list(c.val_data), ShardRole::Val);
}

// Measured against the plan: the largest rank's peak resident memory above its start-up (the plan's scope). Then
// the end row and the exit code: stopped, not finished, is EX_TEMPFAIL, so a job script requeues.
int finish_run(const TrainConfig& cfg, Comm& world, MetricsLog& metrics, const json& plan_record,
               const HostMemory& at_start, Device device, int64_t step, bool stopped_early, double seconds) {
  double above_start = host_memory().peak_mb - at_start.resident_mb;
  if (world.size() > 1) world.all_reduce(&above_start, 1, CommType::F64, ReduceOp::Max, "peak memory");
  if (device == Device::Cpu)
    std::printf("memory: measured peak %.1f MB above the start-up's (largest rank), planned %.1f MB (%+.1f%%)\n",
                above_start, plan_record["peak"].get<double>() / 1e6,
                100.0 * (above_start / (plan_record["peak"].get<double>() / 1e6) - 1.0));
  const bool finished = step >= cfg.steps;
  metrics.write({{"step", step}, {"event", "end"}, {"status", finished ? "finished" : "stopped"},
                 {"host_peak_above_start_mb", above_start}});
  if (world.rank() == 0) refresh_run_report(cfg.out_dir);
  if (!finished) {
    std::printf("stopped at step %lld of %lld (%s) after %s: exit code %d; rerun with --resume to continue\n",
                (long long)step, (long long)cfg.steps, stopped_early ? "signal" : "--stop_at_step",
                human_duration(seconds).c_str(), EX_TEMPFAIL);
    return EX_TEMPFAIL;
  }
  std::printf("done: step %lld of %lld in %s\n", (long long)step, (long long)cfg.steps, human_duration(seconds).c_str());
  return 0;
}

// Where a run's weights, model and tokenizer come from. A resume checkpoint beats --init beats a fresh init. An
// earlier run in out_dir is continued, deleted (--overwrite) or refused, never silently mixed with this one; a
// resume takes the newest checkpoint that verifies on every rank (ckpt/run_dir.h). A plan touches nothing on disk.
struct RunStart {
  std::unique_ptr<RunLock> lock;  // one run per out_dir, held for the run's life (ckpt/run_dir.h)
  std::optional<fs::path> resume_from;
  fs::path init_dir, weights_dir;
  json config_json, checkpoint_state;  // checkpoint_state: a resume's state.json (what its run chose)
  LlamaConfig model;
  ModelTokenizer tokenizer;
  Adapters adapters;  // what trains: every parameter, or adapters on a frozen base (then weights_dir)
};

RunStart open_run(const TrainConfig& cfg, const Options& options, Comm& world) {
  RunStart r;
  const auto warn = [](const std::string& m) { std::fprintf(stderr, "warning: %s\n", m.c_str()); };
  if (!cfg.plan_only) {
    r.lock = lock_run_dir(cfg.out_dir, world, warn);
    r.resume_from = open_run_dir(
        cfg.out_dir, parse_resume_mode(cfg.resume), cfg.overwrite, world,
        [](const std::string& m) { std::printf("%s\n", m.c_str()); }, warn);
  }
  r.init_dir = cfg.init.empty() ? fs::path() : resolve_checkpoint(cfg.init);  // .../latest too
  if (!r.resume_from && !r.init_dir.empty() && !cfg.plan_only &&
      !verify_model_directory(r.init_dir, ModelFiles::Weights, world))
    std::printf("note: %s\n", unverified_note(r.init_dir).c_str());  // the files --init reads, against its manifest
  r.weights_dir = r.resume_from ? *r.resume_from : r.init_dir;
  // With adapters the model, config and tokenizer are the frozen base's: the checkpoint holds the adapters alone.
  r.adapters = Adapters::open(cfg.adapters, options, r.init_dir, r.resume_from, cfg.plan_only, world);
  if (!r.adapters.base().empty()) r.weights_dir = r.adapters.base();
  if (r.resume_from) r.checkpoint_state = read_training_state(*r.resume_from).state;
  r.config_json = r.weights_dir.empty() ? json() : read_config_json(r.weights_dir);
  r.model = r.weights_dir.empty() ? LlamaConfig::load(cfg.model_config)
                                  : LlamaConfig::from_json(r.config_json, (r.weights_dir / "config.json").string());
  if (r.weights_dir.empty()) r.config_json = r.model.to_json(), r.config_json["torch_dtype"] = "float32";
  // The tokenizer checkpoints carry (exactly the one --tokenizer names, else the weights directory's), which
  // the shards must have been written with.
  r.tokenizer = model_tokenizer(cfg.tokenizer, r.weights_dir.string(), r.model.vocab_size);
  const std::string config_path =
      r.weights_dir.empty() ? cfg.model_config : (r.weights_dir / "config.json").string();
  if (!cfg.layout.rope_scaling.empty() && r.adapters.enabled())
    fail("option 'rope_scaling': not with adapters: the adapters load onto the base, whose config.json decides the "
         "rope; scale the base's config.json instead, or train the whole model");
  apply_rope_scaling(r.model, r.config_json, cfg.layout.rope_scaling, "rope_scaling", config_path);
  check_seq_len(r.model, cfg.layout.seq_len, "seq_len", config_path);
  return r;
}

// What DPO's precomputed reference is keyed by besides the shards (data/reference_logps.h): the starting weights' files
// (the frozen base's and --lora_init's with adapters; a model drawn from scratch by its config and draw), and the
// options that change a pair's log-probs.
ReferenceInputs reference_inputs(const TrainConfig& cfg, const RunStart& start) {
  ReferenceInputs in;
  const auto add_weights = [&](const fs::path& dir) {
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
    in.weight_files.insert(in.weight_files.end(), files.begin(), files.end());
  };
  const fs::path weights = start.adapters.enabled() ? start.adapters.base() : start.init_dir;
  if (!weights.empty()) add_weights(weights);
  if (!cfg.adapters.lora_init.empty()) add_weights(resolve_checkpoint(cfg.adapters.lora_init));
  in.model_text = str(start.model.to_json().dump(), weights.empty() ? str(" seed ", cfg.seed, " std ", cfg.init_std) : "",
                      " lora ", cfg.adapters.lora_rank, " ", cfg.adapters.lora_alpha, " ", cfg.adapters.lora_targets, " ",
                      cfg.adapters.base_quant);
  in.options_text = str("seq_len ", cfg.layout.seq_len, " document_mask ",
                        cfg.document_mask, " positions ", cfg.document_positions, " rope ", cfg.layout.rope_scaling);
  return in;
}

EngineOptions engine_options(const TrainConfig& cfg, const RunStart& start, const LaunchInfo& launch) {
  if (cfg.plan_only && cfg.device != "cuda") fail("option 'plan_only' prints the CUDA engine's plan: use --device cuda");
  EngineOptions eo;
  eo.device = cfg.plan_only ? Device::Cuda : resolve_device(cfg.device);
  eo.micro_batch = cfg.layout.micro_batch, eo.seq_len = cfg.layout.seq_len, eo.opt = cfg.opt;
  eo.zero = static_cast<int>(cfg.layout.zero), eo.zero_prefetch = cfg.zero_prefetch;
  eo.recompute = parse_recompute(cfg.layout.recompute, "option 'recompute'");
  eo.bf16_moments = cfg.layout.bf16_moments;
  eo.sp = cfg.layout.sp;
  eo.fp8 = parse_fp8_mode(cfg.layout.fp8, "option 'fp8'");
  eo.fp8_forward_codes = parse_fp8_forward_codes(cfg.layout.fp8_weight_codes, "option 'fp8_weight_codes'");
  eo.documents = DocumentMode{cfg.document_mask, parse_document_positions(cfg.document_positions)};
  start.adapters.configure(eo, start.model);  // what trains
  eo.seed = static_cast<uint64_t>(cfg.seed);
  std::string note;
  eo.attention = choose_attention(cfg.attention, start.checkpoint_state, &note);
  if (!note.empty()) std::printf("note: %s\n", note.c_str());
  eo.gpu.stochastic_rounding = cfg.stochastic_rounding, eo.gpu.seed = static_cast<uint32_t>(cfg.seed);
  eo.gpu.device = launch.local_rank;  // one GPU per rank: the rank's index on its node
  if (eo.device == Device::Cpu && (cfg.layout.bf16_moments || cfg.stochastic_rounding))
    fail("options 'bf16_moments' and 'stochastic_rounding' are for --device cuda (the CPU backend keeps fp32)");
  return eo;
}

// What state.json holds besides the engine's state: where the run is, and what it chose.
json training_state(const Options& options, const TrainConfig& cfg, const Mesh& mesh, const Engine& engine,
                    const DataLoader& train, int64_t step, int64_t skipped_steps) {
  json state = {{"step", step},
                {"skipped_steps", skipped_steps},
                {"train_config", options.to_json()},
                {"data_cursor", train.cursor()},
                {"rng", {{"seed", cfg.seed}}},
                {"world", {{"dp", mesh.dp_size}, {"pp", mesh.pp_size}, {"tp", mesh.tp_size}, {"zero", cfg.layout.zero}}}};
  if (!engine.attention_kernels().empty()) state["kernels"] = {{"attention", engine.attention_kernels()}};
  return state;
}

void print_banner(const TrainConfig& cfg, const Options& options, const RunStart& start, const Engine& engine,
                  const Comm& world, const Mesh& mesh, const MemoryLayout& layout, int threads) {
  std::printf("tuna train | device %s | %d CPU threads per rank | %d ranks = dp %d x %stp %d%s | ZeRO-%lld (%s)\n",
              engine.describe().c_str(), threads, world.size(), mesh.dp_size,
              mesh.pp_size > 1 ? str("pp ", mesh.pp_size, " x ").c_str() : "", mesh.tp_size,
              mesh.tp_size < 2 ? "" : cfg.layout.sp ? " (sequence parallel)" : " (sequence parallel off)", (long long)cfg.layout.zero,
              world.backend().c_str());
  if (mesh.pp_size > 1) std::printf("pipeline %s\n", format_pipeline_stages(layout.stages).c_str());
  std::printf("config %s\n", options.to_json().dump().c_str());
  if (const std::string w = schedule_warning(cfg.opt, cfg.steps); !w.empty()) std::printf("warning: %s\n", w.c_str());
  if (engine.describe() == "cpu" && *blas_hint()) std::printf("note: %s\n", blas_hint());
  if (!start.resume_from && !cfg.init.empty()) std::printf("initialized from %s\n", start.init_dir.c_str());
  else if (!start.resume_from) std::printf("initialized from scratch (seed %lld, std %g)\n", (long long)cfg.seed, cfg.init_std);
  std::printf("tokenizer %s\n", start.tokenizer.description.c_str());
  if (!start.tokenizer.note.empty()) std::printf("note: %s\n", start.tokenizer.note.c_str());
}

void print_run_shape(const TrainConfig& cfg, const RunStart& start, Engine& engine, const DataLoader& train,
                     int64_t tokens_per_step) {
  const LlamaConfig& m = start.model;
  std::printf("model %lld parameters (%d layers, hidden %lld, %lld heads / %lld kv, vocab %lld); activations %.1f MB\n",
              (long long)m.n_params(), (int)m.num_hidden_layers, (long long)m.hidden_size,
              (long long)m.num_attention_heads, (long long)m.num_key_value_heads, (long long)m.vocab_size,
              engine.activation_bytes() / 1e6);
  std::printf("%s\n", start.adapters.describe(m).c_str());
  if (cfg.layout.fp8 == "tensorwise")
    std::printf("fp8 tensorwise: the seven projections' GEMMs in FP8 (e4m3 weights and activations, e5m2 output "
                "gradients, one scale per tensor from its amax, fp32 accumulation)%s; the lm_head, attention, norms "
                "and optimizer as they are\n", start.adapters.enabled() ? ", the frozen base's included" : "");
  std::printf("%s", engine.memory_report().c_str());
  std::printf("data %llu windows of %lld tokens in %zu shard(s); %lld tokens per step; %.2f epochs over %lld steps\n",
              (unsigned long long)train.total_windows(), (long long)cfg.layout.seq_len, train.shard_count(),
              (long long)tokens_per_step,
              double(cfg.steps) * cfg.layout.micro_batch * cfg.layout.grad_accum / double(std::max<uint64_t>(1, train.windows_per_epoch())),
              (long long)cfg.steps);
  std::fflush(stdout);
}

// metrics.jsonl holds this run's rows only (a resume drops the rows logged after its checkpoint, keeping a
// backup); the checkpoint directory is proved writable and large enough now, not at the first checkpoint.
void open_metrics(MetricsLog& metrics, const TrainConfig& cfg, const RunStart& start, int64_t step, int64_t last_step) {
  const fs::path out_dir = cfg.out_dir;
  const MetricsTruncation cut = truncate_metrics(out_dir / "metrics.jsonl", step);
  if (cut.dropped > 0)
    std::printf("metrics.jsonl: kept the %lld rows up to step %lld, dropped %lld logged after it (the file as it was: %s)\n",
                (long long)cut.kept, (long long)step, (long long)cut.dropped, cut.backup.c_str());
  const std::string space = check_checkpoint_space(
      out_dir / "ckpt", start.adapters.checkpoint_bytes(start.model, start.tokenizer.files),
      checkpoints_to_write(step, last_step, cfg.ckpt_every, start.resume_from.has_value()), cfg.ckpt_keep);
  if (!space.empty()) std::printf("warning: %s\n", space.c_str());
  metrics.open(out_dir / "metrics.jsonl");
}

// --plan_only: every rank plans its own layout; rank 0 prints. Exit 0 when every rank's plan fits.
int print_plan(const LlamaConfig& model, const EngineOptions& eo, const Mesh& mesh, Comm& world, double gpu_memory_gb) {
  const GpuFit fit = plan_gpu_run(model, eo, mesh, gpu_memory_gb);
  std::printf("%s", fit.report.c_str());
  int64_t all_fit = fit.fits ? 1 : 0;
  if (world.size() > 1) world.all_reduce(&all_fit, 1, CommType::I64, ReduceOp::Sum, "plan verdicts");
  return all_fit == world.size() ? 0 : 1;
}

// A signal reaches ranks at different moments: they stop together, at the first step any rank saw it. A lost
// run-directory lock stops them too, without a checkpoint (ckpt/run_dir.h).
StopRequest stop_requested(Comm& world, int64_t step, const RunLock* lock) {
  const StopRequest stop = stop_at_safe_point(world, g_stop_requested, lock);
  if (stop == StopRequest::Signal) std::printf("stop requested (signal): checkpointing at step %lld\n", (long long)step);
  return stop;
}

void install_stop_signals() {
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGUSR1, on_stop_signal);  // mpirun forwards SIGUSR1 to every rank (SIGTERM to mpirun ends the job)
}

// metrics.jsonl's first row: what the run report needs besides the steps (core/run_report.h).
json start_row(const Options& options, const TrainConfig& cfg, const RunStart& start, const Engine& engine,
               const Comm& world, const Mesh& mesh, int64_t step, int64_t tokens_per_step, const json& plan_record,
               double resident_mb_at_start) {
  const LlamaConfig& m = start.model;
  return {{"step", step}, {"event", "start"}, {"config", options.to_json()}, {"device", engine.describe()},
          {"world", {{"size", world.size()}, {"dp", mesh.dp_size}, {"pp", mesh.pp_size}, {"tp", mesh.tp_size}, {"zero", cfg.layout.zero}}},
          {"model", {{"parameters", m.n_params()}, {"layers", m.num_hidden_layers}, {"hidden", m.hidden_size},
                     {"vocab", m.vocab_size}, {"trainable_parameters", start.adapters.trainable_parameters(m)}}},
          {"tokens_per_step", tokens_per_step}, {"memory_plan", plan_record}, {"host_mb_at_start", resident_mb_at_start}};
}

// A step whose loss or gradient was not finite made no update; too many in a row stop the run.
void report_skipped_step(const StepResult& r, int64_t step, int64_t in_a_row, int64_t skipped, const TrainConfig& cfg) {
  std::printf("step %6lld | loss %g | grad norm %g | not finite: update skipped (%lld in a row, %lld in all)\n",
              (long long)step, r.loss, r.stats.grad_norm, (long long)in_a_row, (long long)skipped);
  std::fflush(stdout);
  if (in_a_row >= cfg.max_bad_steps)
    fail("the loss or the gradient norm was not finite in ", in_a_row, " steps in a row (up to step ", step,
         ", --max_bad_steps ", cfg.max_bad_steps, "): the run diverged. Resume from the last checkpoint (",
         (fs::path(cfg.out_dir) / "ckpt").string(), ") with a lower --lr or a --grad_clip, or look for bad data near this step");
}

// The CUDA engine's device comms: NCCL over each group of the mesh (none without NCCL: one rank only).
DeviceCommFactory device_comms(const Mesh& mesh, double timeout_s) {
  DeviceCommFactory factory;
#if TUNA_NCCL
  factory = [&mesh, timeout_s](Comm& group, void* stream) {
    // The pipeline's comm takes 2 CTAs: it moves one activation or gradient at a time, and a receive posted ahead
    // spins through the forward it overlaps on SMs that forward needs (comm/comm.h NcclOptions).
    NcclOptions nccl;
    if (&group == mesh.pp.get()) nccl.max_ctas = 2;
    return make_nccl_comm(group.split(0, group.rank()), stream, timeout_s, nccl);
  };
#endif
  return factory;
}

int run(int argc, char** argv) {
  TrainConfig cfg;
  Options options("build/train", "Fine-tunes or pretrains a LLaMA-family model on token shards.");
  declare(options, cfg);
  const std::vector<std::string> positional = options.parse(argc, argv);
  if (!positional.empty()) fail("unexpected argument '", positional[0], "' (options are --name value)");
  check(cfg);
  return_large_frees_to_system();  // freed transients leave the resident set: the measured peak is the planned one

  // Start-up: ranks, the run directory, the model and its tokenizer, the memory plan, the engine.
  const LaunchInfo launch = detect_launch();
  std::unique_ptr<Comm> world = make_world_comm(cfg.comm_timeout);
  Mesh mesh = make_mesh(*world, cfg.layout.tp, cfg.layout.pp);
  if (world->rank() != 0 && !std::freopen("/dev/null", "w", stdout)) fail("cannot silence stdout of rank ", world->rank());
  const int threads = set_cpu_threads(cfg.threads, launch.local_size);
  const RunStart start = open_run(cfg, options, *world);
  start.adapters.record(cfg.adapters);  // the logged config and state.json say what runs (a resume's base quantization)
  const EngineOptions eo = engine_options(cfg, start, launch);
  // What runs where (model/support.h): --plan_only prints a design too; a run needs what its engine runs.
  const MemoryLayout layout = engine_memory_layout(start.model, eo, mesh);
  if (cfg.plan_only) require_valid(start.model, layout, eo.device);
  else require_support(start.model, layout, eo.device);
  // The objective (engine/preference.h): what its passes run on is the support table's too.
  Preference preference(cfg.objective, start.adapters.enabled());
  if (!cfg.plan_only) require_objective_support(preference.config(), layout, eo.device);
  if (!cfg.plan_only && !cfg.eval_tasks.empty())
    if (const Support s = eval_tasks_support(layout, eo.device); !s.runs()) fail(s.reason);
  if (cfg.plan_only) {
    // A plan is printed whatever the engine runs, but what a run of this config would be refused for besides its
    // memory is said with it: a config that plans on cuda then fails at start on a GPU machine is worse than one line.
    std::vector<Support> refusals = {support(start.model, layout, eo.device),
                                     objective_support(preference.config(), layout, eo.device)};
    if (!cfg.eval_tasks.empty()) refusals.push_back(eval_tasks_support(layout, eo.device));
    if (world->rank() == 0)
      for (const Support& s : refusals)
        if (!s.runs()) std::printf("note: a run of this config would be refused: %s\n", s.reason.c_str());
    return print_plan(start.model, eo, mesh, *world, cfg.gpu_memory_gb);
  }
  // Each rank reads (or draws) only its own pieces; a resume restores after construction, but a frozen base is read at
  // every start (the checkpoint holds the adapters alone).
  WeightFill initial = start.adapters.base_weights();
  if (!initial && !start.resume_from)
    initial = cfg.init.empty() ? random_weights(static_cast<uint64_t>(cfg.seed), cfg.init_std)
                               : weights_from_directory(start.init_dir.string());
  const DeviceCommFactory device_comm = device_comms(mesh, cfg.comm_timeout);
  const HostMemory at_start = host_memory();
  const json plan_record = check_memory_plan(start.model, eo, mesh, at_start.resident_mb, launch.local_size);
  std::unique_ptr<Engine> engine = make_engine(start.model, eo, mesh, initial, device_comm);
  print_banner(cfg, options, start, *engine, *world, mesh, layout, threads);
  std::printf("host memory at init: %.0f MB peak on this rank\n", engine->status().host_peak_mb);

  // Resume: the engine's state a piece at a time from the files, the step, the data cursor.
  int64_t step = 0, skipped_steps = 0;  // skipped: steps whose loss or gradient was not finite (no update)
  std::optional<LoaderCursor> saved_cursor;  // a resume's, checked against its step and resharded
  if (start.resume_from) {
    const TrainingState resumed = Checkpointer::restore(*engine, *start.resume_from);
    step = resumed.step, skipped_steps = resumed.skipped_steps;
    saved_cursor = resume_data_cursor(resumed, mesh.dp_size, *start.resume_from);
    if (resumed.state.contains("train_config"))  // options that differ; a reshaped schedule is a warning
      for (const std::string& line : resume_option_changes(resumed.state["train_config"], options.to_json(), cfg.opt, step))
        std::printf("%s\n", line.c_str());
    std::printf("resumed from %s at step %lld\n", start.resume_from->c_str(), (long long)step);
  }

  // Data, and the components the loop calls: the checkpointer, the validator, the metrics and the ETA.
  LoaderOptions train_opts{cfg.layout.seq_len, cfg.layout.micro_batch, mesh.dp_rank, mesh.dp_size, static_cast<uint64_t>(cfg.seed),
                           start.model.vocab_size, false, start.tokenizer.fingerprint, start.tokenizer.description};
  const std::vector<std::string> train_shards = expand_shard_paths(split_list(cfg.train_data), ShardRole::Train);
  DataLoader train(train_shards, train_opts);
  preference.check_data(train, "train_data");
  if (saved_cursor) train.set_cursor(*saved_cursor);
  LoaderOptions val_opts = train_opts;
  val_opts.eval = true;
  const std::vector<std::string> val_shards =
      cfg.val_data.empty() ? std::vector<std::string>() : expand_shard_paths(split_list(cfg.val_data), ShardRole::Val);
  Validator validator(val_shards.empty() ? nullptr : std::make_unique<DataLoader>(val_shards, val_opts),
                      cfg.val_every, cfg.val_batches);
  if (validator.enabled()) preference.check_data(*validator.data(), "val_data");
  validator.set_objective(&preference, mesh.dp.get());
  if (!cfg.eval_tasks.empty()) {  // the tokenizer the run's checkpoints carry encodes the tasks
    const std::string tokenizer = !cfg.tokenizer.empty() ? cfg.tokenizer : start.weights_dir.string();
    if (tokenizer.empty()) fail("--eval_tasks: the tasks are text and this run has no tokenizer (give --tokenizer)");
    // The CUDA engine scores a request per row (Engine::target_logps there takes no document positions).
    auto tasks = std::make_unique<McEvaluator>(cfg.eval_tasks, Tokenizer(tokenizer), /*skip_bad=*/false,
                                               cfg.layout.micro_batch, cfg.layout.seq_len, mesh.dp.get(),
                                               /*packed=*/eo.device == Device::Cpu);
    std::printf("%s\n", tasks->describe().c_str());
    validator.set_tasks(std::move(tasks));
  }
  if (preference.enabled()) std::printf("%s\n", preference.describe().c_str());
  // DPO's precomputed reference: the starting weights' log-probs of every pair, before the first step (a resume and a
  // second run read them back).
  if (preference.config().reference == ReferenceSource::Precompute) {
    const ReferenceInputs inputs = reference_inputs(cfg, start);
    DataLoader pass(train_shards, val_opts);
    preference.prepare_reference(*engine, train_shards, pass, inputs, !start.resume_from, true, *world, mesh.dp.get());
    if (validator.enabled())
      preference.prepare_reference(*engine, val_shards, *validator.data(), inputs, !start.resume_from, false, *world,
                                   mesh.dp.get());
  }
  const int64_t tokens_per_step = cfg.layout.micro_batch * cfg.layout.seq_len * cfg.layout.grad_accum * mesh.dp_size;
  print_run_shape(cfg, start, *engine, train, tokens_per_step);
  Checkpointer checkpointer(fs::path(cfg.out_dir) / "ckpt", cfg.ckpt_every, cfg.ckpt_keep, *world, mesh,
                            start.config_json, start.tokenizer.files);
  start.adapters.attach(checkpointer);  // a LoRA run's checkpoints: PEFT adapter directories
  install_stop_signals();
  const int64_t first_step = step;
  const int64_t last_step = cfg.stop_at_step > 0 ? std::min(cfg.steps, cfg.stop_at_step) : cfg.steps;
  MetricsLog metrics;  // rank 0's; closed on the others
  if (world->rank() == 0) open_metrics(metrics, cfg, start, step, last_step);
  metrics.write(start_row(options, cfg, start, *engine, *world, mesh, step, tokens_per_step, plan_record,
                          at_start.resident_mb));
  // The ETA counts the validations and checkpoints still to come, at their measured cost (core/progress.h).
  TrainingEta eta(cfg.layout.grad_accum, validator.batches());
  auto save = [&](int64_t at) {
    eta.checkpoint_done(checkpointer.save(*engine, at, training_state(options, cfg, mesh, *engine, train, at, skipped_steps)));
  };
  auto validate = [&](int64_t at) {
    const Validator::Result v = validator.run(*engine, at);
    std::printf("%s\n", v.line().c_str());
    metrics.write(v.record());
    if (world->rank() == 0) refresh_run_report(cfg.out_dir);
    eta.validation_done(v.seconds);
  };
  if (validator.due_at_start(step)) validate(0);  // the starting point: how far training moves the held-out loss

  // The loop: micro-batches, the step (loss over ranks, gradient sync, clip, AdamW), the record, then whatever
  // is due.
  // The step's micro-batches, read before any runs (a pipeline runs them together); positions: each token's place
  // in its document (the masks, RoPE).
  const int64_t window = cfg.layout.micro_batch * cfg.layout.seq_len;
  std::vector<int32_t> inputs(cfg.layout.grad_accum * window), targets(cfg.layout.grad_accum * window),
      positions(cfg.layout.grad_accum * window);
  std::vector<MicroBatch> micro_batches(cfg.layout.grad_accum);
  for (int64_t micro = 0; micro < cfg.layout.grad_accum; micro++)
    micro_batches[micro] = {inputs.data() + micro * window, targets.data() + micro * window,
                            positions.data() + micro * window, cfg.layout.micro_batch, cfg.layout.seq_len};
  const auto run_start = std::chrono::steady_clock::now();
  int64_t bad_in_a_row = 0;
  bool stopped_early = false;
  while (step < last_step) {
    const auto t0 = std::chrono::steady_clock::now();
    engine->begin_step();
    LossSum loss;
    if (preference.enabled()) {
      loss = preference.step(*engine, train, cfg.layout.grad_accum, mesh.dp.get());  // {loss sum, pairs}
    } else {
      for (int64_t micro = 0; micro < cfg.layout.grad_accum; micro++)
        train.next(inputs.data() + micro * window, targets.data() + micro * window, positions.data() + micro * window);
      loss = engine->forward_backward_step(micro_batches);
    }
    inject_fault_for_tests(world->rank(), step);  // TUNA_FAULT, tests only
    if (nan_loss_for_tests(world->rank(), step)) loss.sum = NAN;
    const double lr = learning_rate(cfg.opt, step, cfg.steps);
    const StepResult result = engine->finish_step(loss, lr);  // no update when not finite, on every rank alike
    step++;
    bad_in_a_row = result.stats.applied ? 0 : bad_in_a_row + 1;
    if (!result.stats.applied) report_skipped_step(result, step, bad_in_a_row, ++skipped_steps, cfg);
    StepRecord r;
    r.step = step, r.total_steps = cfg.steps, r.loss = result.loss, r.lr = lr, r.stats = result.stats;
    r.tokens = result.tokens, r.window_tokens = tokens_per_step, r.skipped_steps = skipped_steps;
    r.seconds = seconds_since(t0), r.elapsed_s = seconds_since(run_start);
    eta.step_done(r.seconds);
    r.eta_s = eta.seconds_left(cfg.steps - step, validator.left(step, cfg.steps),
                               periodic_events_left(step, cfg.steps, cfg.ckpt_every));
    r.tokens_per_s = tokens_per_step / r.seconds;
    // MFU: model FLOPs of the step over what every rank's device could do in the same time; with document masks,
    // attention over each token's document, as the kernels compute it (this rank's windows stand for every
    // replica's). A preference step reads its pair windows itself: whole windows are counted for it.
    const bool spans = cfg.document_mask && !preference.enabled();
    const double flops_per_token = engine->flops_per_token(
        spans ? attention_span(positions.data(), int64_t(positions.size())) : cfg.layout.seq_len);
    r.mfu = tokens_per_step * flops_per_token / r.seconds / (engine->peak_flops() * world->size());
    if (cfg.gpu_hour_cost > 0) r.cost = r.elapsed_s / 3600.0 * world->size() * cfg.gpu_hour_cost;  // so far
    r.status = engine->status();
    if (preference.enabled()) r.preference = preference.metrics();
    metrics.write(r.json());
    if (step % cfg.log_every == 0 || step == last_step || step == first_step + 1) {
      std::printf("%s\n", r.line().c_str());
      std::fflush(stdout);
    }
    if (validator.due(step, cfg.steps)) validate(step);
    const StopRequest stop = stop_requested(*world, step, start.lock.get());
    if (stop == StopRequest::LockLost) return kLockLostExitCode;  // out_dir is another run's now: write nothing
    if ((stopped_early = stop == StopRequest::Signal)) break;
    if (checkpointer.due(step, last_step)) save(step);
  }

  // The end: the last validation and checkpoint, memory against the plan, the exit code.
  if (validator.due_at_end(step, cfg.steps, stopped_early)) validate(step);
  if (stop_at_safe_point(*world, false, start.lock.get()) == StopRequest::LockLost) return kLockLostExitCode;
  if (step > first_step || !start.resume_from) save(step);
  return finish_run(cfg, *world, metrics, plan_record, at_start, eo.device, step, stopped_early,
                    seconds_since(run_start));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (...) {  // every exception, not only tuna::Error: nothing ends the trainer with SIGABRT and no message
    const std::string message = describe_current_exception();
    const LaunchInfo launch = detect_launch();
    if (launch.size > 1) std::fprintf(stderr, "error: rank %d: %s\n", launch.rank, message.c_str());
    else std::fprintf(stderr, "error: %s\n", message.c_str());
    std::fflush(stderr);
    abort_job(1);  // the other ranks must not wait for this one in their next collective
  }
}
