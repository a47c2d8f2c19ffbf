// build/train — the trainer's main: config -> ranks -> model -> data -> loop -> checkpoints.
// Wiring only: the math is in model/, the bytes in data/, the ops in kernels/, communication in dist/.
//
//   build/train --config run.toml [--option value ...]
//   mpirun -np 8 build/train --config run.toml --zero 3 [--tp 2]      (see README: Launching)
//
// Ranks: world = dp x tp (comm/comm.h); the loader gives each dp rank disjoint windows. The Engine
// (engine/engine.h) is the model on the chosen device: on cpu, Llama + Zero (every parallel mode); on cuda,
// LlamaGpu on the rank's GPU with gradients all-reduced over NCCL. Rank 0 prints and writes metrics.jsonl;
// every rank writes its checkpoint shard.
//
// Every option is settable in the TOML file and as a flag (flags win). The effective config is printed
// at start and saved in every checkpoint's state.json. SIGTERM/SIGINT/SIGUSR1 (a preemption notice) finish
// the current step, write a checkpoint and exit 75 (EX_TEMPFAIL: "stopped, not finished"; as does
// --stop_at_step before --steps), so a job script requeues and `--resume` continues exactly where it stopped.
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
#include <sstream>
#include <sysexits.h>  // EX_TEMPFAIL

#include "core/error.h"           // tuna::Error, fail, describe_current_exception
#include "core/memory.h"          // host_memory, host_available_bytes, require_host_memory, return_large_frees_to_system
#include "core/options.h"         // Options: TOML + flags
#include "core/progress.h"        // ProgressLine (checkpoint writes), TrainingEta, human_duration, periodic_events_left
#include "core/run_report.h"      // refresh_run_report: out_dir/report.html
#include "core/threads.h"         // set_cpu_threads: OpenMP + OpenBLAS; blas_hint
#include "data/loader.h"          // DataLoader, LoaderCursor, expand_shard_paths, ShardRole
#include "data/tokenizer.h"       // model_tokenizer: what checkpoints carry, what shards must match
#include "comm/comm.h"            // Comm, Mesh, make_world_comm, abort_job
#include "ckpt/checkpoint.h"     // verify_model_directory, resume_data_cursor, load_weights, save_checkpoint, resume_checkpoint, load_checkpoint_state
#include "model/config.h"         // LlamaConfig
#include "engine/engine.h"         // Engine: the model on cpu or cuda, the step's collectives and optimizer
#include "model/llama.h"          // init_random_weights
#include "model/memory_plan.h"    // MemoryLayout, plan_cpu_memory, plan_gpu_memory, format_memory_table
#include "model/optimizer.h"      // OptimizerConfig, learning_rate
#include "ckpt/run_dir.h"        // lock_run_dir, open_run_dir, truncate_metrics, MetricsLog, check_checkpoint_space

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
  int64_t seq_len = 1024;
  int64_t micro_batch = 4;
  int64_t grad_accum = 1;
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
  int64_t max_bad_steps = 5;
  std::string device = "auto";
  int64_t threads = 0;
  int64_t tp = 1;
  int64_t zero = 0;
  bool zero_prefetch = true;
  std::string recompute = "none";
  double comm_timeout = 300;
  bool bf16_moments = false;
  bool stochastic_rounding = false;
  double gpu_hour_cost = 0;
  bool plan_only = false;
  double gpu_memory_gb = 0;
};

void declare(Options& o, TrainConfig& c) {
  // Upper bounds are far beyond any real run; they exist so that a typo (or 2^31) fails here, with the
  // option's name, instead of as an allocation of petabytes or an overflow later.
  constexpr double kMaxSteps = 1e12, kMaxTokens = 1 << 22, kMaxRanks = 1 << 16;
  o.add("model_config", &c.model_config, "config.json of a model to train from scratch (instead of --init)");
  o.add("init", &c.init, "model directory to start from: a Hugging Face download or a tuna checkpoint");
  o.add("tokenizer", &c.tokenizer,
        "the model's tokenizer (a file of any format, or a model directory): carried in checkpoints, and the shards "
        "must have been written with it; default: --init's");
  o.add("train_data", &c.train_data, "token shards: files, directories (their train-* shards) or globs, comma-separated");
  o.add("val_data", &c.val_data, "validation shards, same form (a directory: its val-* shards); empty: no validation");
  o.add("seq_len", &c.seq_len, "tokens per sequence", Bounds::closed(1, kMaxTokens));
  o.add("micro_batch", &c.micro_batch, "sequences per forward/backward", Bounds::closed(1, kMaxTokens));
  o.add("grad_accum", &c.grad_accum, "micro-batches per optimizer step", Bounds::closed(1, kMaxTokens));
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
  o.add("max_bad_steps", &c.max_bad_steps,
        "stop the run after this many steps in a row whose loss or gradient norm is not finite (each is skipped)",
        Bounds::closed(1, 1e6));
  o.add("device", &c.device, "cuda when a GPU is visible (auto), or the one named", {"auto", "cpu", "cuda"});
  o.add("threads", &c.threads, "CPU threads per rank; 0: the node's cores divided among its ranks", Bounds::closed(0, kMaxRanks));
  o.add("tp", &c.tp, "tensor-parallel ranks (inside a node); the world is dp x tp", Bounds::closed(1, kMaxRanks));
  o.add("zero", &c.zero, "ZeRO stage: 0 replicate, 1 shard optimizer state, 2 and gradients, 3 and parameters", Bounds::closed(0, 3));
  o.add("zero_prefetch", &c.zero_prefetch, "ZeRO-3: gather the next layer while this one computes (false: when used)");
  o.add("recompute", &c.recompute, "cuda: activations the backward recomputes: none, selective (norms, SwiGLU) or full (each layer from its input)",
        {"none", "selective", "full"});
  o.add("comm_timeout", &c.comm_timeout, "seconds a collective may wait for the other ranks before the job stops; 0: forever",
        Bounds::closed(0, 1e9));
  o.add("bf16_moments", &c.bf16_moments, "cuda: AdamW moments in bf16 (half the optimizer memory)");
  o.add("stochastic_rounding", &c.stochastic_rounding, "cuda: round bf16 weights (and bf16 moments) stochastically");
  o.add("plan_only", &c.plan_only, "cuda: print each rank's device memory plan and whether it fits, then exit without allocating (runs on any machine with --gpu_memory_gb)");
  o.add("gpu_memory_gb", &c.gpu_memory_gb, "plan_only: the GPU memory in GB to fit against (80 for an H100); 0: the visible GPU's free memory",
        Bounds::closed(0, 1e6));
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

std::string format_fixed(double x, int decimals) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, x);
  return buf;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// What the option declarations cannot say alone (each option's own range is checked as it is set).
void check(const TrainConfig& c) {
  if (c.model_config.empty() == c.init.empty())
    fail("give exactly one of --init (a model directory) and --model_config (a config.json to train from scratch)");
  if (c.train_data.empty() && !c.plan_only) fail("option 'train_data' is empty: give token shards (build/prepare writes them)");
  if (c.micro_batch * c.seq_len > (int64_t{1} << 31))
    fail("options 'micro_batch' x 'seq_len' = ", c.micro_batch * c.seq_len, " tokens per micro-batch: at most 2^31");
  validate(c.opt);
  // Every input path now, before anything is loaded (data/loader.h), not after the model.
  if (!c.plan_only) check_shard_specs("train_data", split_list(c.train_data), ShardRole::Train);
  if (!c.plan_only) check_shard_specs("val_data", split_list(c.val_data), ShardRole::Val);
}

LossSum evaluate(Engine& model, DataLoader& val, int64_t max_batches, std::vector<int32_t>& inputs,
                 std::vector<int32_t>& targets) {
  const LoaderOptions& o = val.options();
  val.reset();
  LossSum total;
  for (int64_t b = 0; (max_batches == 0 || b < max_batches) && val.next(inputs.data(), targets.data()); b++) {
    LossSum l = model.forward_loss(inputs.data(), targets.data(), o.micro_batch, o.seq_len);
    total.sum += l.sum;
    total.count += l.count;
  }
  return total;
}

int run(int argc, char** argv) {
  TrainConfig cfg;
  Options options("build/train", "Fine-tunes or pretrains a LLaMA-family model on token shards.");
  declare(options, cfg);
  const std::vector<std::string> positional = options.parse(argc, argv);
  if (!positional.empty()) fail("unexpected argument '", positional[0], "' (options are --name value)");
  check(cfg);
  return_large_frees_to_system();  // freed transients leave the resident set: the measured peak is the planned one

  const LaunchInfo launch = detect_launch();
  std::unique_ptr<Comm> world = make_world_comm(cfg.comm_timeout);
  Mesh mesh = make_mesh(*world, cfg.tp);
  if (world->rank() != 0 && !std::freopen("/dev/null", "w", stdout)) fail("cannot silence stdout of rank ", world->rank());
  const int threads = set_cpu_threads(cfg.threads, launch.local_size);

  const fs::path out_dir = cfg.out_dir, ckpt_root = out_dir / "ckpt";
  // Where the weights come from: a resume checkpoint beats --init beats a fresh init. An earlier run in
  // out_dir is continued, deleted (--overwrite) or refused, never silently mixed with this one; a resume takes
  // the newest checkpoint that verifies on every rank (ckpt/run_dir.h). A plan touches nothing on disk.
  std::optional<fs::path> resume_from;
  const auto warn = [](const std::string& m) { std::fprintf(stderr, "warning: %s\n", m.c_str()); };
  const std::unique_ptr<RunLock> run_lock = cfg.plan_only ? nullptr : lock_run_dir(out_dir, *world, warn);  // one run per out_dir
  if (!cfg.plan_only)
    resume_from = open_run_dir(
        out_dir, parse_resume_mode(cfg.resume), cfg.overwrite, *world,
        [](const std::string& m) { std::printf("%s\n", m.c_str()); }, warn);
  const fs::path init_dir = cfg.init.empty() ? fs::path() : resolve_checkpoint(cfg.init);  // .../latest too
  if (!resume_from && !init_dir.empty() && !cfg.plan_only && !verify_model_directory(init_dir, ModelFiles::Weights, *world))
    std::printf("note: %s\n", unverified_note(init_dir).c_str());  // the files --init reads, against its manifest
  const fs::path weights_dir = resume_from ? *resume_from : init_dir;
  json config_json = weights_dir.empty() ? json() : read_config_json(weights_dir);
  LlamaConfig model_cfg = weights_dir.empty() ? LlamaConfig::load(cfg.model_config)
                                              : LlamaConfig::from_json(config_json, (weights_dir / "config.json").string());
  if (weights_dir.empty()) config_json = LlamaConfig::load(cfg.model_config).to_json(), config_json["torch_dtype"] = "float32";
  // The tokenizer checkpoints carry (exactly the one --tokenizer names, else the weights directory's), which
  // the shards must have been written with.
  const ModelTokenizer tokenizer = model_tokenizer(cfg.tokenizer, weights_dir.string(), model_cfg.vocab_size);
  check_seq_len(model_cfg, cfg.seq_len, "seq_len",
                weights_dir.empty() ? cfg.model_config : (weights_dir / "config.json").string());

  EngineOptions eo;
  if (cfg.plan_only && cfg.device != "cuda") fail("option 'plan_only' prints the CUDA engine's plan: use --device cuda");
  eo.device = cfg.plan_only ? cfg.device : resolve_device(cfg.device);
  eo.micro_batch = cfg.micro_batch, eo.seq_len = cfg.seq_len, eo.opt = cfg.opt;
  eo.zero = static_cast<int>(cfg.zero), eo.zero_prefetch = cfg.zero_prefetch;
  eo.recompute = parse_recompute(cfg.recompute, "option 'recompute'");
  eo.bf16_moments = cfg.bf16_moments, eo.stochastic_rounding = cfg.stochastic_rounding;
  eo.seed = static_cast<uint64_t>(cfg.seed);
  eo.gpu = launch.local_rank;  // one GPU per rank: the rank's index on its node
  if (eo.device == "cpu" && (cfg.bf16_moments || cfg.stochastic_rounding))
    fail("options 'bf16_moments' and 'stochastic_rounding' are for --device cuda (the CPU backend keeps fp32)");

  if (cfg.plan_only) {  // every rank plans its own layout; rank 0 prints
    const GpuFit fit = plan_gpu_run(model_cfg, eo, mesh, cfg.gpu_memory_gb);
    std::printf("%s", fit.report.c_str());
    int64_t all_fit = fit.fits ? 1 : 0;
    if (world->size() > 1) world->all_reduce(&all_fit, 1, CommType::I64, ReduceOp::Sum, "plan verdicts");
    return all_fit == world->size() ? 0 : 1;
  }

  // Where the starting weights come from (a resume restores them after construction instead).
  WeightFill initial;  // each rank reads (or draws) only its own pieces
  if (!resume_from && !cfg.init.empty()) initial = weights_from_directory(init_dir.string());
  else if (!resume_from) initial = random_weights(static_cast<uint64_t>(cfg.seed), cfg.init_std);
  DeviceCommFactory device_comm;
#if TUNA_NCCL
  device_comm = [&](Comm& group, void* stream) {
    return make_nccl_comm(group.split(0, group.rank()), stream, cfg.comm_timeout);
  };
#endif
  // The memory plan, before anything large is allocated: a run that cannot fit stops here (model/memory_plan.h).
  const HostMemory at_start = host_memory();
  nlohmann::json plan_record;
  if (eo.device == "cpu") {
    const MemoryPlan plan = plan_cpu_memory(model_cfg, engine_memory_layout(eo, mesh.dp_size, mesh.dp_rank, mesh.tp_size, mesh.tp_rank));
    std::printf("%s", format_memory_table(plan, host_available_bytes(),
                                          str("memory plan per rank (host, above the ", format_fixed(at_start.resident_mb, 0),
                                              " MB resident at start; capacity: this node's available memory)")).c_str());
    std::fflush(stdout);
    plan_record = memory_plan_json(plan), plan_record["device"] = "cpu";
    require_host_memory(plan.peak(), launch.local_size, "the memory plan's peak per rank");
  } else {  // the device's plan, for the run report's memory plot (the CUDA engine checks the fit itself)
    plan_record = memory_plan_json(plan_gpu_memory(model_cfg, engine_memory_layout(eo, mesh.dp_size, mesh.dp_rank, mesh.tp_size, mesh.tp_rank))), plan_record["device"] = "cuda";
  }
  std::unique_ptr<Engine> engine = make_engine(model_cfg, eo, mesh, initial, device_comm);
  std::printf("tuna train | device %s | %d CPU threads per rank | %d ranks = dp %d x tp %d | ZeRO-%lld (%s)\n",
              engine->describe().c_str(), threads, world->size(), mesh.dp_size, mesh.tp_size, (long long)cfg.zero,
              world->backend().c_str());
  std::printf("config %s\n", options.to_json().dump().c_str());
  if (const std::string w = schedule_warning(cfg.opt, cfg.steps); !w.empty()) std::printf("warning: %s\n", w.c_str());
  if (eo.device == "cpu" && *blas_hint()) std::printf("note: %s\n", blas_hint());
  if (!resume_from && !cfg.init.empty()) std::printf("initialized from %s\n", init_dir.c_str());
  else if (!resume_from) std::printf("initialized from scratch (seed %lld, std %g)\n", (long long)cfg.seed, cfg.init_std);
  std::printf("tokenizer %s\n", tokenizer.description.c_str());
  if (!tokenizer.note.empty()) std::printf("note: %s\n", tokenizer.note.c_str());
  std::printf("host memory at init: %.0f MB peak on this rank\n", engine->status().host_peak_mb);

  json saved_cursor;
  int64_t step = 0, skipped_steps = 0;  // skipped: steps whose loss or gradient was not finite (no update)
  if (resume_from) {
    const TrainingState resumed = read_training_state(*resume_from);  // step, cursor and counts checked
    const json& state = resumed.state;
    step = resumed.step, skipped_steps = resumed.skipped_steps;
    // A piece at a time from the files into the engine: no rank holds its shard on the host.
    const int64_t steps_taken = load_checkpoint_state(*resume_from, engine->layout(), engine->segments(),
                                                      [&](const StateSource& source) { engine->import_state(source); });
    check_optimizer_steps(resumed, steps_taken, *resume_from);
    engine->set_steps_taken(steps_taken);
    saved_cursor = resume_data_cursor(resumed, mesh.dp_size, *resume_from);  // checked against the step, resharded
    if (state.contains("train_config"))  // options that differ; a reshaped schedule is a warning (ckpt/run_dir.h)
      for (const std::string& line : resume_option_changes(state["train_config"], options.to_json(), cfg.opt, step))
        std::printf("%s\n", line.c_str());
    std::printf("resumed from %s at step %lld\n", resume_from->c_str(), (long long)step);
  }
  LoaderOptions train_opts{cfg.seq_len, cfg.micro_batch, mesh.dp_rank, mesh.dp_size, static_cast<uint64_t>(cfg.seed),
                           model_cfg.vocab_size, false, tokenizer.fingerprint, tokenizer.description};
  DataLoader train(expand_shard_paths(split_list(cfg.train_data), ShardRole::Train), train_opts);
  if (!saved_cursor.is_null()) train.set_cursor(saved_cursor.get<LoaderCursor>());
  std::unique_ptr<DataLoader> val;
  if (!cfg.val_data.empty()) {
    LoaderOptions val_opts = train_opts;
    val_opts.eval = true;
    val = std::make_unique<DataLoader>(expand_shard_paths(split_list(cfg.val_data), ShardRole::Val), val_opts);
  }

  const int64_t tokens_per_step = cfg.micro_batch * cfg.seq_len * cfg.grad_accum * mesh.dp_size;
  std::printf("model %lld parameters (%d layers, hidden %lld, %lld heads / %lld kv, vocab %lld); activations %.1f MB\n",
              (long long)model_cfg.n_params(), (int)model_cfg.num_hidden_layers, (long long)model_cfg.hidden_size,
              (long long)model_cfg.num_attention_heads, (long long)model_cfg.num_key_value_heads,
              (long long)model_cfg.vocab_size, engine->activation_bytes() / 1e6);
  std::printf("%s", engine->memory_report().c_str());
  std::printf("data %llu windows of %lld tokens in %zu shard(s); %lld tokens per step; %.2f epochs over %lld steps\n",
              (unsigned long long)train.total_windows(), (long long)cfg.seq_len, train.shard_count(),
              (long long)tokens_per_step,
              double(cfg.steps) * cfg.micro_batch * cfg.grad_accum / double(std::max<uint64_t>(1, train.windows_per_epoch())),
              (long long)cfg.steps);
  std::fflush(stdout);

  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGUSR1, on_stop_signal);  // mpirun forwards SIGUSR1 to every rank (SIGTERM to mpirun ends the job)
  const int64_t first_step = step;
  const int64_t last_step = cfg.stop_at_step > 0 ? std::min(cfg.steps, cfg.stop_at_step) : cfg.steps;
  // metrics.jsonl holds this run's rows only (a resume drops the rows logged after its checkpoint, keeping a
  // backup); the checkpoint directory is proved writable and large enough now, not at the first checkpoint.
  MetricsLog metrics;  // rank 0's; closed on the others
  if (world->rank() == 0) {
    const MetricsTruncation cut = truncate_metrics(out_dir / "metrics.jsonl", step);
    if (cut.dropped > 0)
      std::printf("metrics.jsonl: kept the %lld rows up to step %lld, dropped %lld logged after it (the file as it was: %s)\n",
                  (long long)cut.kept, (long long)step, (long long)cut.dropped, cut.backup.c_str());
    const std::string space = check_checkpoint_space(
        ckpt_root, checkpoint_bytes(model_cfg.n_params(), tokenizer.files),
        checkpoints_to_write(first_step, last_step, cfg.ckpt_every, resume_from.has_value()), cfg.ckpt_keep);
    if (!space.empty()) std::printf("warning: %s\n", space.c_str());
    metrics.open(out_dir / "metrics.jsonl");
  }
  // What the run report needs besides the steps (core/run_report.h): the effective config, the world, the plan.
  metrics.write({{"step", step}, {"event", "start"}, {"config", options.to_json()}, {"device", engine->describe()},
                 {"world", {{"size", world->size()}, {"dp", mesh.dp_size}, {"tp", mesh.tp_size}, {"zero", cfg.zero}}},
                 {"model", {{"parameters", model_cfg.n_params()}, {"layers", model_cfg.num_hidden_layers},
                            {"hidden", model_cfg.hidden_size}, {"vocab", model_cfg.vocab_size}}},
                 {"tokens_per_step", cfg.micro_batch * cfg.seq_len * cfg.grad_accum * mesh.dp_size},
                 {"memory_plan", plan_record}, {"host_mb_at_start", at_start.resident_mb}});
  // The ETA counts the validations and checkpoints still to come, at their measured cost (core/progress.h).
  TrainingEta eta_model(cfg.grad_accum, !val ? 0
                                             : cfg.val_batches > 0 ? std::min<int64_t>(cfg.val_batches, val->batches_per_epoch())
                                                                   : static_cast<int64_t>(val->batches_per_epoch()));

  auto save = [&](int64_t at_step) {
    const auto started = std::chrono::steady_clock::now();
    json state = {{"step", at_step},
                  {"skipped_steps", skipped_steps},
                  {"train_config", options.to_json()},
                  {"data_cursor", train.cursor()},
                  {"rng", {{"seed", cfg.seed}}},
                  {"world", {{"dp", mesh.dp_size}, {"tp", mesh.tp_size}, {"zero", cfg.zero}}}};
    const ParamLayout& layout = engine->layout();
    // The engine hands its weights and moments a piece at a time straight into the files (no host copy).
    const StateExport export_state = [&](const StateSink& sink) { engine->export_state(sink); };
    int64_t shard_elements = 0;
    for (const Segment& s : engine->segments()) shard_elements += s.size;
    fs::path p;
    if (world->size() == 1) {  // one rank: the single-file format (also a Hugging Face model directory)
      TUNA_CHECK(shard_elements == layout.total(), "one rank's shard is not the whole model");
      ProgressLine progress(str("checkpoint step ", at_step), 12.0 * double(shard_elements), ProgressLine::Unit::Bytes,
                            stdout);
      CheckpointContents contents{&config_json, nullptr, {nullptr, nullptr, engine->steps_taken()}, state,
                                  tokenizer.files, &progress, &engine->segments(), export_state};
      p = save_checkpoint(ckpt_root, at_step, layout, contents, cfg.ckpt_keep);
      progress.finish();
    } else {  // one file per rank, written in parallel (ckpt/checkpoint.h)
      if (world->rank() == 0) prepare_sharded_checkpoint(ckpt_root, at_step);
      world->barrier("checkpoint directory created");
      // Rank 0's file (ranks write theirs in parallel, of about the same size).
      ProgressLine progress(str("checkpoint step ", at_step, ", rank 0's file"), 12.0 * double(shard_elements),
                            ProgressLine::Unit::Bytes, world->rank() == 0 ? stdout : nullptr);
      write_checkpoint_shard(checkpoint_tmp_dir(ckpt_root, at_step), world->rank(), layout,
                             ShardState{&engine->segments(), export_state, engine->steps_taken(),
                                        /*write_replicated=*/mesh.tp_rank == 0, &progress});
      progress.finish();
      CheckpointContents contents{&config_json, nullptr, {}, state, tokenizer.files};
      world->barrier("checkpoint shards written");
      if (world->rank() == 0) p = finish_sharded_checkpoint(ckpt_root, at_step, contents, cfg.ckpt_keep);
      world->barrier("checkpoint renamed");
    }
    if (world->rank() == 0) refresh_run_report(out_dir);  // its checkpoint table lists this one now
    std::printf("checkpoint %s\n", p.c_str());
    std::fflush(stdout);
    eta_model.checkpoint_done(seconds_since(started));
  };
  auto validate_now = [&](int64_t at_step) {
    const auto started = std::chrono::steady_clock::now();
    std::vector<int32_t> vin(cfg.micro_batch * cfg.seq_len), vtg(cfg.micro_batch * cfg.seq_len);
    LossSum v = engine->all_reduce_loss(evaluate(*engine, *val, cfg.val_batches, vin, vtg));
    const double loss = v.count ? v.sum / v.count : NAN;
    std::printf("step %6lld | val loss %.4f | val ppl %.2f | %lld tokens\n", (long long)at_step, loss, std::exp(loss),
                (long long)v.count);
    metrics.write({{"step", at_step}, {"val_loss", loss}, {"val_ppl", std::exp(loss)}, {"val_tokens", v.count}});
    if (world->rank() == 0) refresh_run_report(out_dir);
    eta_model.validation_done(seconds_since(started));
  };

  // The starting point, so the log shows how far training moved the held-out loss.
  if (val && step == 0) validate_now(0);

  std::vector<int32_t> inputs(cfg.micro_batch * cfg.seq_len), targets(cfg.micro_batch * cfg.seq_len);
  const double flops_per_token = engine->flops_per_token(cfg.seq_len);
  const auto run_start = std::chrono::steady_clock::now();
  int64_t bad_in_a_row = 0;
  bool stopped_early = false;
  while (step < last_step) {
    const auto t0 = std::chrono::steady_clock::now();
    engine->begin_step();
    LossSum loss;
    for (int64_t micro = 0; micro < cfg.grad_accum; micro++) {
      train.next(inputs.data(), targets.data());
      LossSum l = engine->forward_backward(inputs.data(), targets.data(), cfg.micro_batch, cfg.seq_len);
      loss.sum += l.sum;
      loss.count += l.count;
    }
    inject_fault_for_tests(world->rank(), step);  // TUNA_FAULT, tests only
    if (nan_loss_for_tests(world->rank(), step)) loss.sum = NAN;
    const double lr = learning_rate(cfg.opt, step, cfg.steps);
    // Loss over all ranks, gradient synchronization, global-norm clip and AdamW (engine/engine.h); no update when
    // the loss or the gradient norm is not finite (the same decision on every rank).
    const StepResult result = engine->finish_step(loss, lr);
    const OptimizerStats& stats = result.stats;
    step++;
    bad_in_a_row = stats.applied ? 0 : bad_in_a_row + 1;
    if (!stats.applied) {
      skipped_steps++;
      std::printf("step %6lld | loss %g | grad norm %g | not finite: update skipped (%lld in a row, %lld in all)\n",
                  (long long)step, result.loss, stats.grad_norm, (long long)bad_in_a_row, (long long)skipped_steps);
      std::fflush(stdout);
      if (bad_in_a_row >= cfg.max_bad_steps)
        fail("the loss or the gradient norm was not finite in ", bad_in_a_row, " steps in a row (up to step ", step,
             ", --max_bad_steps ", cfg.max_bad_steps, "): the run diverged. Resume from the last checkpoint (",
             ckpt_root.string(), ") with a lower --lr or a --grad_clip, or look for bad data near this step");
    }
    const double secs = seconds_since(t0), elapsed = seconds_since(run_start);
    eta_model.step_done(secs);
    const double eta = eta_model.seconds_left(cfg.steps - step, val ? periodic_events_left(step, cfg.steps, cfg.val_every) : 0,
                                              periodic_events_left(step, cfg.steps, cfg.ckpt_every));
    const double mean_loss = result.loss;
    const double tok_s = tokens_per_step / secs;
    // MFU: model FLOPs of the step over what every rank's device could do in the same time.
    const double mfu = tokens_per_step * flops_per_token / secs / (engine->peak_flops() * world->size());
    const double cost = elapsed / 3600.0 * world->size() * cfg.gpu_hour_cost;  // this allocation's, so far
    const EngineStatus dev = engine->status();
    json record = {{"step", step},          {"loss", mean_loss},       {"lr", lr},
                   {"grad_norm", stats.grad_norm}, {"clip_scale", stats.clip_scale}, {"tokens", result.tokens},
                   {"tokens_per_s", tok_s}, {"ms_per_step", secs * 1e3}, {"elapsed_s", elapsed}, {"eta_s", eta},
                   {"mem_mb", dev.host_mb}, {"peak_mem_mb", dev.host_peak_mb}};
    if (!stats.applied) record["skipped"] = true, record["skipped_steps"] = skipped_steps;
    if (std::isfinite(mfu)) record["mfu"] = mfu;
    if (std::isfinite(dev.gpu_mb)) record["gpu_mem_mb"] = dev.gpu_mb, record["gpu_peak_mem_mb"] = dev.gpu_peak_mb;
    if (std::isfinite(dev.gpu_util)) record["gpu_util"] = dev.gpu_util;
    if (cfg.gpu_hour_cost > 0) record["cost"] = cost;
    metrics.write(record);
    if (step % cfg.log_every == 0 || step == last_step || step == first_step + 1) {
      std::string device_part;
      if (std::isfinite(mfu)) device_part += str(" | MFU ", format_fixed(100 * mfu, 1), "%");
      if (std::isfinite(dev.gpu_mb))
        device_part += str(" | gpu mem ", format_fixed(dev.gpu_mb / 1e3, 1), "/", format_fixed(dev.gpu_total_mb / 1e3, 1),
                           " GB (peak ", format_fixed(dev.gpu_peak_mb / 1e3, 1), ")");
      if (std::isfinite(dev.gpu_util)) device_part += str(" | util ", format_fixed(dev.gpu_util, 0), "%");
      const std::string cost_part = cfg.gpu_hour_cost > 0 ? str(" | cost ", format_fixed(cost, 2)) : "";
      std::printf("step %6lld/%lld | loss %.4f | lr %.3e | grad norm %.3f | %.0f tok/s | %.0f ms%s | mem %.0f MB (peak %.0f)%s | ETA %s\n",
                  (long long)step, (long long)cfg.steps, mean_loss, lr, stats.grad_norm, tok_s, secs * 1e3,
                  device_part.c_str(), dev.host_mb, dev.host_peak_mb, cost_part.c_str(), human_duration(eta).c_str());
      std::fflush(stdout);
    }
    if (val && cfg.val_every > 0 && step % cfg.val_every == 0 && step != cfg.steps) validate_now(step);
    // A signal reaches ranks at different moments: stop together, at the first step any rank saw it.
    int64_t stop = g_stop_requested ? 1 : 0;
    if (world->size() > 1) world->all_reduce_sum(&stop, 1, "stop request");
    if (stop) {
      std::printf("stop requested (signal): checkpointing at step %lld\n", (long long)step);
      stopped_early = true;
      break;
    }
    if (cfg.ckpt_every > 0 && step % cfg.ckpt_every == 0 && step != last_step) save(step);
  }
  if (val && step == cfg.steps && !stopped_early) validate_now(step);
  if (step > first_step || !resume_from) save(step);
  // Measured against the plan: the largest rank's peak resident memory above its start-up (the plan's scope).
  double above_start = host_memory().peak_mb - at_start.resident_mb;
  if (world->size() > 1) world->all_reduce(&above_start, 1, CommType::F64, ReduceOp::Max, "peak memory");
  if (eo.device == "cpu")
    std::printf("memory: measured peak %.1f MB above the start-up's (largest rank), planned %.1f MB (%+.1f%%)\n",
                above_start, plan_record["peak"].get<double>() / 1e6,
                100.0 * (above_start / (plan_record["peak"].get<double>() / 1e6) - 1.0));
  const bool finished = step >= cfg.steps;
  metrics.write({{"step", step}, {"event", "end"}, {"status", finished ? "finished" : "stopped"},
                 {"host_peak_above_start_mb", above_start}});
  if (world->rank() == 0) refresh_run_report(out_dir);
  if (!finished) {  // stopped, not finished: a distinct exit code, so a job script requeues
    std::printf("stopped at step %lld of %lld (%s) after %s: exit code %d; rerun with --resume to continue\n",
                (long long)step, (long long)cfg.steps, stopped_early ? "signal" : "--stop_at_step",
                human_duration(seconds_since(run_start)).c_str(), EX_TEMPFAIL);
    return EX_TEMPFAIL;
  }
  std::printf("done: step %lld of %lld in %s\n", (long long)step, (long long)cfg.steps,
              human_duration(seconds_since(run_start)).c_str());
  return 0;
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
